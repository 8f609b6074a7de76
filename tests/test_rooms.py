"""Audio as rooms make it (tools/make_long_audio.py --condition), real prompts made into manifests
(tools/manifest_from_prompts.py), and the speech detection bench on them (bench/vad_bench.py)."""

import argparse
import gzip
import importlib.util
import json
import os
import sys

import numpy as np
import pytest
import soundfile as sf
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import make_long_audio  # noqa: E402
import manifest_from_prompts  # noqa: E402

DIGITS = os.path.join(ROOT, "data", "mini", "digits", "dev.jsonl")
RATE = 16000  # the digits'


def long_file(out, *flags):
    """make_long_audio's one 10 s file of the digits (seed 0) with `flags`: (audio, its path, its manifest line)."""
    assert make_long_audio.main(["--manifest", DIGITS, "-o", str(out), "--seconds", "10", "--files", "1",
                                 *flags]) == 0
    line = json.loads((out / "manifest.jsonl").read_text())
    path = out / line["audio_filepath"]
    return sf.read(path, dtype="float64")[0], path, line


def spans(line):
    return [(round(q["start"] * RATE), round(q["end"] * RATE)) for q in line["parts"]]


def power(x):
    return float(np.mean(x**2))


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    return long_file(tmp_path_factory.mktemp("clean"))


def test_clean_is_the_default_and_the_conditions_keep_its_utterances(tmp_path, clean):
    wav, path, line = long_file(tmp_path / "named", "--condition", "clean")
    assert path.read_bytes() == clean[1].read_bytes() and line == clean[2] and line["condition"] == "clean"
    _, _, talkers = long_file(tmp_path / "talkers", "--condition", "talkers")
    assert [q["text"] for q in talkers["parts"]] == [q["text"] for q in line["parts"]]
    assert spans(talkers) == spans(line)


@pytest.mark.parametrize("condition, snr", [("pink", (10, 20)), ("music", (12, 20))])
def test_noise_is_under_the_whole_file_at_the_drawn_snr(tmp_path, clean, condition, snr):
    wav, _, line = long_file(tmp_path / condition, "--condition", condition)
    assert line["condition"] == condition and snr[0] <= line["snr_db"] <= snr[1]
    assert spans(line) == spans(clean[2])
    speech = np.concatenate([clean[0][a:b] for a, b in spans(line)])
    noise = wav - clean[0]
    measured = 10 * np.log10(power(speech) / power(noise))  # the noise's power over the whole file
    assert measured == pytest.approx(line["snr_db"], abs=1.0)
    pauses = np.concatenate([noise[b:a] for (_, b), (a, _) in zip(spans(line), spans(line)[1:])])
    assert power(pauses) > 0.01 * power(noise)  # pauses included


def test_room_tone_holds_a_gap_without_speech_in_the_middle_at_the_floor(tmp_path, clean):
    wav, _, line = long_file(tmp_path / "room", "--condition", "room-tone", "--gap-seconds", "6", "--floor-db", "-50")
    start, end = line["gap"]
    assert end - start == pytest.approx(6.0, abs=1e-3) and line["floor_db"] == -50
    assert all(q["end"] <= start or q["start"] >= end for q in line["parts"])
    assert abs((start + end) / 2 - line["duration"] / 2) < 2.0  # near the middle of the file
    gap = wav[round(start * RATE):round(end * RATE)]
    assert 10 * np.log10(power(gap)) == pytest.approx(-50, abs=1.0)
    k = next(i for i, q in enumerate(line["parts"]) if q["end"] == pytest.approx(start))  # the pause it widened
    before = spans(clean[2])
    assert len(wav) - len(clean[0]) == round(6.0 * RATE) - (before[k + 1][0] - before[k][1])


def test_every_other_talker_is_quieter_by_talker_db(tmp_path, clean):
    wav, _, line = long_file(tmp_path / "talkers", "--condition", "talkers", "--talker-db", "24")
    assert line["talker_db"] == 24 and len(line["parts"]) >= 3
    for k, (a, b) in enumerate(spans(line)):
        gain = 10 * np.log10(power(wav[a:b]) / power(clean[0][a:b]))
        assert gain == pytest.approx(-24.0 if k % 2 else 0.0, abs=1.0)
        assert line["parts"][k].get("gain_db", 0.0) == (-24.0 if k % 2 else 0.0)
    assert all(not wav[b:a].any() for (_, b), (a, _) in zip(spans(line), spans(line)[1:]))  # silent pauses: no noise


def test_a_knock_lands_in_a_pause_away_from_the_utterances(tmp_path, clean):
    wav, _, line = long_file(tmp_path / "knock", "--transient")
    start, end = line["transient"]
    assert end - start == pytest.approx(0.03, abs=1e-4)
    assert any(b["end"] + 0.1 <= start + 1e-4 and end <= a["start"] - 0.1 + 1e-4
               for b, a in zip(line["parts"], line["parts"][1:]))
    assert 0.85 <= np.abs(wav[round(start * RATE):round(end * RATE)]).max() <= 0.95
    outside = np.ones(len(wav), dtype=bool)
    outside[round(start * RATE):round(end * RATE)] = False
    assert np.array_equal(wav[outside], clean[0][outside])


def write_tone(path, seconds=0.5, rate=8000):
    path.parent.mkdir(parents=True, exist_ok=True)
    sf.write(path, 0.3 * np.sin(np.arange(round(seconds * rate)) * 0.3), rate, subtype="PCM_16")


def test_prompts_become_a_manifest_and_every_skip_is_counted(tmp_path, capsys):
    audio = tmp_path / "sounds"
    write_tone(audio / "hello.wav", 0.5)
    write_tone(audio / "digits" / "7.wav", 0.25)
    write_tone(audio / "beep.wav")
    write_tone(audio / "stray.wav")  # on disk, not in the transcript
    (audio / "broken.wav").write_bytes(b"RIFF not a wave file")
    transcript = tmp_path / "prompts.txt.gz"
    with gzip.open(transcript, "wt", encoding="utf-8") as f:
        f.write("; prompts of a fake PBX\n\nhello: Hello,  [pause] world.\ndigits/7: seven\nbeep: [a beep tone]\n"
                "broken: Never heard.\nmissing: No file for this one.\n")
    out = tmp_path / "m" / "prompts.jsonl"
    assert manifest_from_prompts.main(["--lang", "fr", "--audio", str(audio), "--transcript", str(transcript),
                                       "-o", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(os.path.basename(r["audio_filepath"]), r["text"], r["duration"]) for r in rows] == [
        ("7.wav", "seven", 0.25), ("hello.wav", "Hello, world.", 0.5)]
    assert all(os.path.isabs(r["audio_filepath"]) and r["source_lang"] == r["target_lang"] == "fr" for r in rows)
    err = capsys.readouterr().err
    assert "skipping stray.wav: not in the transcript" in err and "skipping beep: no words" in err
    assert "skipping broken: unreadable audio" in err and "skipping missing: no audio file" in err
    assert "1 no audio file, 1 no transcript, 1 no words in the transcript, 1 unreadable audio" in err

    from aed.data_manifest import iter_manifest
    assert [u.text for u in iter_manifest(str(out))] == ["seven", "Hello, world."]  # aed reads it


def test_sphinx_transcripts_name_the_file_last(tmp_path):
    write_tone(tmp_path / "a1.wav")
    (tmp_path / "transcription").write_text("<s> ten of clubs  </s> (a1)\n")
    out = tmp_path / "s.jsonl"
    assert manifest_from_prompts.main(["--lang", "en", "--format", "sphinx", "--audio", str(tmp_path),
                                       "--transcript", str(tmp_path / "transcription"), "-o", str(out)]) == 0
    assert json.loads(out.read_text())["text"] == "ten of clubs"


def test_the_vad_bench_runs_end_to_end_with_the_energy_detectors(tmp_path, capsys):
    import vad_bench
    vad_bench.main(["--manifest", f"digits={DIGITS}", "--conditions", "clean", "pink", "--detectors", "energy",
                    "energy-raw", "--seconds", "6", "--files", "1", "--work-dir", str(tmp_path)])
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    assert "speech kept %" in out and result["detectors"] == ["energy", "energy-raw"]
    for condition in ("clean", "pink"):
        for detector in ("energy", "energy-raw"):
            stat = result["sets"]["digits"][condition][detector]
            assert 0 <= stat["speech_kept_pct"] <= 100 and 0 <= stat["pause_called_pct"] <= 100
            assert stat["speech_frames"] > 0 and stat["pause_frames"] > 0 and stat["cpu_s"] >= 0
    assert result["sets"]["digits"]["clean"]["energy"]["speech_kept_pct"] > 90  # clean speech is found
    for stream in result["streams"].values():
        assert all(0 <= stream[d]["called_pct"] <= 100 for d in ("energy", "energy-raw"))


def test_the_recordings_bench_decodes_offline_and_streamed_with_each_detector_named(tmp_path, capsys):
    """bench/long_audio_bench.py recordings --vad --merge-segments: offline rows once per detector and
    way of cutting, stream rows once per detector, labelled with them; the utterances at their true edges once (the word model on one 6 s file under music)."""
    import long_audio_bench
    assert make_long_audio.main(["--manifest", DIGITS, "-o", str(tmp_path), "--seconds", "6", "--files", "1",
                                 "--condition", "music"]) == 0
    vads = ["energy", "silero"] if SILERO else ["energy"]
    long_audio_bench.run_modes("", long_audio_bench.MODES, "words", [
        "recordings", "--ckpt", str(long_audio_bench.DEFAULT_CKPT), "--manifest", str(tmp_path / "manifest.jsonl"),
        "--policies", "alignatt", "--vad", *vads, "--merge-segments"])
    found = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["sets"][tmp_path.name]
    assert sorted(k for k in found if k.startswith("each")) == [
        "each re-edged, CTC 0.3", "each utterance alone, CTC 0.3", "each utterance alone, greedy"]
    assert sorted(k for k in found if k.startswith(("offline", "stream"))) == sorted(
        [f"{label}, {vad}" for vad in vads for label in ("offline, greedy", "offline, CTC 0.3", "stream alignatt")]
        + [f"offline, {w}, {vad}, merged" for vad in vads for w in ("greedy", "CTC 0.3")])
    assert all(v["words"] == found["each utterance alone, greedy"]["words"] > 0
               for v in found.values() if isinstance(v, dict))


# --- the detectors in rooms ------------------------------------------------------------------

ASTERISK_EN = manifest_from_prompts.ASTERISK_AUDIO.format(lang="en")
SILERO = importlib.util.find_spec("silero_vad") is not None


def voices(tmp_path, which):
    """A manifest of utterances: the digits (synthetic), or Asterisk's prompts (recorded; "asterisk" is
    English, "asterisk-fr" French)."""
    if which == "digits":
        return DIGITS
    lang = which.partition("-")[2] or "en"
    if not os.path.isdir(manifest_from_prompts.ASTERISK_AUDIO.format(lang=lang)):
        pytest.skip(f"recorded voices: apt-get install asterisk-core-sounds-{lang}-wav")
    path = tmp_path / f"asterisk_{lang}.jsonl"
    assert manifest_from_prompts.main(["--lang", lang, "-o", str(path)]) == 0
    return str(path)


def judged_in(tmp_path, which, condition, detector, talker_db=24.0, seconds=40.0, files=2, seed=3):
    """bench/vad_bench.py's figures for `detector` on `files` files of `seconds` of `which` voices in
    `condition`."""
    import vad_bench
    args = argparse.Namespace(seconds=seconds, files=files, seed=seed, transient=condition == "talkers",
                              talker_db=talker_db)
    files = vad_bench.long_files(voices(tmp_path, which), condition, tmp_path / condition, args)
    return vad_bench.measure(vad_bench.DETECTORS[detector], files)


@pytest.mark.slow
@pytest.mark.parametrize("which", ["digits", "asterisk"])
@pytest.mark.parametrize("condition,kept", [("pink", 90), ("room-tone", 95), ("talkers", 90)])
def test_the_energy_rule_finds_speech_under_noise_room_tone_and_a_far_talker_and_no_pause_is_speech(
        tmp_path, which, condition, kept):
    """Pink noise at 10-20 dB SNR, room tone with a 45 s gap, a talker 24 dB below the other with a
    knock near full scale in a pause: at most 2% of the pauses called speech, and most of the
    utterance middles found (under pink noise energy keeps 89-99% of the recorded voices' middles:
    docs/inference.md). A threshold hung from the file's loudest frame and its quietest tenth called
    4-7% of the pauses under pink noise speech, and lost the far talker to the knock."""
    stat = judged_in(tmp_path, which, condition, "energy")
    assert stat["speech_kept_pct"] >= kept and stat["pause_called_pct"] <= 2, stat


@pytest.mark.slow
@pytest.mark.skipif(not SILERO, reason="pip install silero-vad")
@pytest.mark.parametrize("which", ["digits", "asterisk"])
@pytest.mark.parametrize("condition", ["pink", "room-tone", "talkers", "music"])
def test_silero_finds_speech_in_every_room_and_tells_a_music_bed_from_it(tmp_path, which, condition):
    """infer.py --vad silero: 95% of the utterance middles found (90% with the far talker and its
    knock), at most 2% of the pauses called speech, a music bed 12-20 dB below the speech included
    (energy calls 40-50% of such pauses speech: the bed's notes rise over its quiet moments)."""
    stat = judged_in(tmp_path, which, condition, "silero")
    assert stat["speech_kept_pct"] >= (90 if condition == "talkers" else 95), stat
    assert stat["pause_called_pct"] <= 2, stat


@pytest.mark.slow
@pytest.mark.skipif(not SILERO, reason="pip install silero-vad")
@pytest.mark.parametrize("which", ["digits", "asterisk"])
def test_silero_finds_a_talker_40_db_under_the_other(tmp_path, which):
    """A far talker 40 dB under the near one, as a talker 24 dB down is in a corpus whose levels spread
    over 20 dB: Silero as it comes found 48-72% of his utterance middles (it hears quiet speech less
    surely); raised where the audio is quiet (aed.data_speech.lift_gain), 89-97%, no pause called speech."""
    stat = judged_in(tmp_path, which, "talkers", "silero", talker_db=40.0)
    assert stat["speech_kept_pct"] >= 85 and stat["pause_called_pct"] <= 2, stat


@pytest.mark.slow
@pytest.mark.skipif(not SILERO, reason="pip install silero-vad")
def test_silero_keeps_a_music_bed_out_of_the_pauses_of_recorded_french(tmp_path):
    """Four 120 s files of Asterisk's French prompts over a music bed (seed 1): Silero's speech as it
    comes called 3.1% of the pauses speech, short runs of it carrying an utterance's end on into the
    bed; with runs under SILERO_MIN_SPEECH dropped (as its own get_speech_timestamps drops them), 1.0%."""
    stat = judged_in(tmp_path, "asterisk-fr", "music", "silero", seconds=120.0, files=4, seed=1)
    assert stat["speech_kept_pct"] >= 95 and stat["pause_called_pct"] <= 2, stat


def test_the_lift_raises_a_quiet_talker_and_never_a_room():
    """lift_gain on frame energies: a quiet talker over digital silence is raised as far as the silence
    may rise (to LIFT_FLOOR_DB); under a room's floor above that, or loud, nothing is; after a loud
    frame the gain stays down while it is within LIFT_LEVEL_SECONDS, then comes back."""
    from aed.data_speech import FRAME, LIFT_FLOOR_DB, LIFT_LEVEL_SECONDS, SILENCE_DBFS, lift_gain
    quiet = torch.full((600,), -100.0)
    quiet[100:300] = -50.0  # (frames,) a talker at -50 dB between stretches of digital silence
    gain = lift_gain(quiet)
    assert gain[150] == pytest.approx(LIFT_FLOOR_DB - SILENCE_DBFS)  # the silence may rise to -60 dB: 20 dB
    assert lift_gain(quiet + 40).abs().max() == 0  # a floor at -60 dB or above: nothing raised
    assert lift_gain(torch.full((600,), -10.0)).abs().max() == 0  # loud speech: nothing raised
    knock = quiet.clone()
    knock[200] = -3.0
    gain = lift_gain(knock)
    back = 200 + round(LIFT_LEVEL_SECONDS / FRAME)
    assert gain[200:back].abs().max() == 0 and gain[back + 50] == pytest.approx(gain[150])


@pytest.mark.skipif(not SILERO, reason="pip install silero-vad")
def test_silero_scores_a_stream_in_pieces_as_a_whole_file():
    """Silero's state carries across a stream's pieces of any size: the scores are those of the whole."""
    from aed.data_speech import speech_detector
    if not os.path.isdir(ASTERISK_EN):
        pytest.skip("recorded voices: apt-get install asterisk-core-sounds-en-wav")
    wav, rate = sf.read(os.path.join(ASTERISK_EN, "hello-world.wav"), dtype="float32")
    wav = torch.from_numpy(np.repeat(wav, RATE // rate))  # 8 kHz -> 16 kHz, crudely (the same both ways)
    wav = torch.cat([wav, wav * 10 ** (-40 / 20), wav])  # loud, quiet (raised: lift_gain), loud
    whole = speech_detector("silero", RATE).scores(wav, final=True)
    detector = speech_detector("silero", RATE)
    pieces = [wav[:50], wav[50:130]] + list(wav[130:].split(777))  # the first two shorter than a 10 ms frame
    parts = torch.cat([detector.scores(p) for p in pieces] + [detector.scores(wav[:0], final=True)])
    assert parts.shape == whole.shape == (wav.numel() // 160,)
    torch.testing.assert_close(parts, whole)
    assert detector.speech(whole).any()


def test_infer_takes_silero_by_default_where_installed_and_says_how_to_get_it_where_not(tmp_path, monkeypatch):
    """infer.py's --vad auto: Silero where it is installed (it keeps a music bed out of the segments),
    energy where it is not or where the model does not take its 16 kHz, saying which in its header."""
    from aed import cli_infer, data_speech
    from test_train import run_in_process
    _, path, _ = long_file(tmp_path / "music", "--condition", "music")
    word_model = os.path.join(ROOT, "tests", "fixtures", "word_model.pt")
    proc = run_in_process(cli_infer.main, ["--ckpt", word_model, "--chunk-seconds", "3", str(path)])
    assert proc.returncode == 0, proc.stderr
    assert f"speech detector {'silero' if SILERO else 'energy'}" in proc.stderr, proc.stderr
    assert data_speech.detector_name("auto", 8000) == "energy" and data_speech.detector_name("energy", RATE) == "energy"
    monkeypatch.setattr(data_speech.importlib.util, "find_spec", lambda name: None)  # as without Silero
    assert data_speech.detector_name("auto", RATE) == "energy"
    assert "not installed: pip install silero-vad" in cli_infer.detecting("auto", RATE)
    with pytest.raises(ValueError, match="unknown speech detector 'webrtc'"):
        data_speech.detector_name("webrtc", RATE)
