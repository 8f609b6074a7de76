import dataclasses
import json
import logging
import math
import os
import shutil

import numpy as np
import pytest
import soundfile as sf
import torch

from aed.config import ConfigError
from aed.data_audio import FeatureConfig, LogMel, load_audio
from aed.data_augment import (AllBad, Augment, RecordingPool, add_noise, change_edges, clip, lossy, lowpass, mulaw,
                              read_recordings, reverberate, telephone)
from aed.data_batch import ExampleDataset
from aed.data_manifest import ManifestError, read_manifest
from aed.data_speech import speech_frames
from aed.train_config import AugmentConfig, TrainConfig
from tools.make_noise import main as make_noise

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MINI = os.path.join(ROOT, "data", "mini")
RATE = 16000


def write_set(tmp_path, name: str, signals: dict) -> str:
    """Writes {stem: samples} as wavs and their manifest tmp_path/name.jsonl; bytes are written as
    they are, and a None signal is listed but never written (a missing file)."""
    lines = []
    for stem, x in signals.items():
        if isinstance(x, bytes):
            (tmp_path / f"{stem}.wav").write_bytes(x)
        elif x is not None:
            sf.write(tmp_path / f"{stem}.wav", x, RATE, subtype="FLOAT")
        lines.append(json.dumps({"audio_filepath": f"{stem}.wav", "duration": 1.0}))
    path = tmp_path / f"{name}.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.fixture
def sets(tmp_path):
    """A noise set and a RIR set of two files each."""
    rng = np.random.default_rng(0)
    decay = np.exp(-np.arange(1600) / 200.0)
    rirs = {f"rir{i}": np.concatenate([np.zeros(20 * i), [1.0], 0.3 * rng.standard_normal(1600) * decay])
            for i in range(2)}
    noise = {f"noise{i}": rng.standard_normal(RATE // 2 + 1000 * i).astype(np.float32) for i in range(2)}
    return write_set(tmp_path, "noise", noise), write_set(tmp_path, "rir", rirs)


def speech(seconds: float = 1.0, seed: int = 1) -> torch.Tensor:
    """A tone with a syllable-like envelope and a little noise, (S,)."""
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(round(seconds * RATE)) / RATE
    return (0.3 * torch.sin(2 * math.pi * 220 * t) * torch.sin(2 * math.pi * 3 * t).abs()
            + 0.01 * torch.randn(t.numel(), generator=g))


def everything(noise: str, rir: str, **kw) -> AugmentConfig:
    return AugmentConfig(**{"reverb_prob": 1.0, "rir_manifests": [rir], "noise_prob": 1.0, "noise_manifests": [noise],
                            "gain_prob": 1.0, "clip_prob": 1.0, "lowpass_prob": 1.0, "codec_prob": 1.0, **kw})


def test_reproducible_from_seed_and_index(sets):
    noise, rir = sets
    wav = speech()
    a, resumed = Augment(everything(noise, rir), RATE), Augment(everything(noise, rir), RATE)
    first = a(wav, 3, 7)
    for i in range(5):  # fill the cache in another order: the draws must not depend on it
        a(wav, 3, i)
    assert first.shape == wav.shape and first.dtype == torch.float32
    assert torch.equal(first, a(wav, 3, 7)) and torch.equal(first, resumed(wav, 3, 7))
    assert not torch.equal(first, a(wav, 3, 8))
    assert not torch.equal(first, a(wav, 4, 7))
    again = a(wav, 3, 7, draw=12)  # the same utterance in a later batch: new degradations, replayable
    assert not torch.equal(first, again) and torch.equal(again, resumed(wav, 3, 7, draw=12))
    assert not torch.allclose(first, wav, atol=1e-3)


def snr_db(clean: torch.Tensor, mixed: torch.Tensor) -> float:
    return 10 * math.log10(clean.double().pow(2).mean() / (mixed.double() - clean.double()).pow(2).mean())


@pytest.mark.parametrize("target", [-5.0, 0.0, 7.5, 20.0])
def test_realised_snr(target):
    wav = speech(1.3)
    noise = torch.randn(RATE // 3)  # shorter than the utterance: looped
    assert abs(snr_db(wav, add_noise(wav, noise, target, start=1234)) - target) < 0.1


def test_snr_through_augment(sets):
    noise, rir = sets
    wav = speech()
    a = Augment(AugmentConfig(noise_prob=1.0, noise_manifests=[noise], snr_db=(12.0, 12.0)), RATE)
    for index in range(4):
        assert abs(snr_db(wav, a(wav, 0, index)) - 12.0) < 0.1


def band_db(wav: torch.Tensor, low_hz: float, high_hz: float) -> float:
    """Energy of wav between two frequencies, in dB."""
    spectrum = torch.fft.rfft(wav.double()).abs() ** 2
    hz = torch.fft.rfftfreq(wav.numel(), 1 / RATE)
    return 10 * math.log10(float(spectrum[(hz >= low_hz) & (hz < high_hz)].sum()) + 1e-30)


def white(seconds: float = 2.0, level: float = 0.1) -> torch.Tensor:
    return level * torch.randn(round(seconds * RATE), generator=torch.Generator().manual_seed(5))


def test_clipping_flattens_what_is_above_the_level_and_nothing_else():
    wav = speech()
    out = clip(wav, 0.4)
    limit = 0.4 * float(wav.abs().max())
    above = wav.abs() >= limit
    assert 0.05 < float(above.float().mean()) < 0.6  # a fraction of the samples reaches the level
    assert torch.equal(out[~above], wav[~above]) and torch.allclose(out[above].abs(), torch.tensor(limit))


def test_lowpass_removes_the_band_above_its_cutoff_and_keeps_the_rest():
    wav = white()
    out = lowpass(wav, RATE, 3000.0)
    assert out.shape == wav.shape
    assert band_db(out, 3600, 8000) < band_db(wav, 3600, 8000) - 40  # the stop band
    assert abs(band_db(out, 100, 2500) - band_db(wav, 100, 2500)) < 0.5  # the pass band


def test_telephone_is_a_300_to_4000_hz_band_and_mu_law_levels():
    wav = white()
    out = telephone(wav, RATE)
    assert out.shape == wav.shape
    assert band_db(out, 4300, 8000) < band_db(wav, 4300, 8000) - 30  # 8 kHz sampling: nothing above 4 kHz
    assert band_db(out, 20, 120) < band_db(wav, 20, 120) - 12  # the 300 Hz high-pass (2nd order)
    assert abs(band_db(out, 600, 3200) - band_db(wav, 600, 3200)) < 1.5  # the voice band


def test_mu_law_has_256_levels_and_a_companded_error():
    wav = speech() * 0.5
    out = mulaw(wav)
    assert len(torch.unique(out)) <= 256
    assert snr_db(wav, out) > 30  # G.711's 8 bits with companding: ~38 dB on speech at this level
    assert float(mulaw(torch.tensor([3.0, -2.0])).abs().min()) == pytest.approx(1.0, abs=1e-3)  # clamped to [-1, 1]


def test_gain_scales_by_its_decibels():
    wav = speech()
    out = Augment(AugmentConfig(gain_prob=1.0, gain_db=(-6.0, -6.0)), RATE)(wav, 0, 0)
    torch.testing.assert_close(out, wav * 10 ** (-6 / 20))


def test_rir_keeps_length_and_alignment():
    wav = speech(0.5)
    for at in (0, 37):  # a delta, with or without leading silence, gives the input back
        delta = torch.zeros(400)
        delta[at] = 1.0
        assert torch.allclose(reverberate(wav, delta), wav, atol=1e-5)
    click = torch.zeros(4000)
    click[100] = 1.0
    rir = torch.cat([0.05 * torch.ones(50), torch.tensor([1.0]), 0.5 * torch.exp(-torch.arange(800) / 100.0)])
    wet = reverberate(click, rir)  # the peak at 50 with taps before it: the direct path stays at time 0
    assert wet.shape == click.shape and int(wet.abs().argmax()) == 100
    assert math.isclose(wet.pow(2).mean(), click.pow(2).mean(), rel_tol=1e-4)  # the level is kept


def test_bad_files_skipped_counted_named_once(tmp_path, caplog):
    bad = {"missing": None, "empty": b"", "nosamples": np.zeros(0, dtype=np.float32),
           "silent": np.zeros(800, dtype=np.float32)}
    good = {"good": np.random.default_rng(0).standard_normal(800).astype(np.float32)}
    pool = RecordingPool([write_set(tmp_path, "noise", bad | good)], "noise", RATE, cache_bytes=2**20)
    with caplog.at_level(logging.WARNING):
        for index in range(30):  # any draw before "good" walks on to it
            assert torch.equal(pool.pick(np.random.default_rng(index)), load_audio(tmp_path / "good.wav"))
    assert pool.faults.counts["unreadable_audio"] == len(bad) and set(pool.bad) == {0, 1, 2, 3}
    for stem in bad:
        assert sum(f"{stem}.wav" in r.getMessage() for r in caplog.records) == 1, stem

    only_bad = write_set(tmp_path, "bad", {"missing": None})
    with pytest.raises(AllBad, match=r"all 1 noise recording\(s\) of .*bad.jsonl.* unreadable"):
        Augment(AugmentConfig(noise_prob=1.0, noise_manifests=[only_bad]), RATE)(speech(), 0, 0)


def test_manifest_and_config_errors(tmp_path):
    (tmp_path / "n.jsonl").write_text('{"audio_filepath": "a.wav", "duration": 1}\n{"audio_filepath": "b.wav"}\n')
    with pytest.raises(ManifestError, match=r"n.jsonl:2: field 'duration'"):
        read_recordings([str(tmp_path / "n.jsonl")], "noise")
    with pytest.raises(ManifestError, match="no such.jsonl"):
        read_recordings([str(tmp_path / "no such.jsonl")], "noise")
    assert not TrainConfig().augment.enabled  # off by default: existing runs are unchanged
    for bad in ({"noise_prob": 0.5}, {"snr_db": (20.0, 0.0)}, {"gain_prob": 1.5}, {"codecs": ["gsm"]},
                {"clip_level": (0.0, 0.5)}, {"edge_prob": -0.1}, {"edge_seconds": (0.5, -0.5)},
                {"edge_floor_prob": 2.0}):
        with pytest.raises(ConfigError, match="augment."):
            AugmentConfig(**bad)
    with pytest.raises(ConfigError, match="lowpass_hz"):
        Augment(AugmentConfig(lowpass_prob=1.0, lowpass_hz=(2000.0, 9000.0)), RATE)


@pytest.mark.parametrize("codec", ["mp3", "opus"])
def test_lossy_codecs_keep_length_and_alignment(codec):
    wav = speech(1.0)
    out = lossy(wav, RATE, codec, 0.5)
    assert out.shape == wav.shape and not torch.equal(out, wav)
    corr = torch.fft.irfft(torch.fft.rfft(out, 2 * RATE) * torch.fft.rfft(wav, 2 * RATE).conj(), 2 * RATE)
    assert int(corr.argmax()) == 0  # no encoder delay left in


def test_dataset_item_replays_with_augment(sets):
    """A resumed run (a new dataset, a new Augment with an empty cache) gets the very same features."""
    noise, rir = sets
    utts = read_manifest(os.path.join(MINI, "train.jsonl"))[:2]
    logmel = LogMel(FeatureConfig(n_mels=32)).train()  # train mode: dither on too

    def dataset(augment=True):
        return ExampleDataset(utts, None, logmel, seed=5,
                              augment=Augment(everything(noise, rir), RATE) if augment else None)

    first = dataset()[1]["feats"]
    assert torch.equal(first, dataset()[1]["feats"]) and torch.equal(first, dataset()[1]["feats"])
    assert first.shape == dataset(augment=False)[1]["feats"].shape
    assert not torch.allclose(first, dataset(augment=False)[1]["feats"], atol=1e-2)
    # as training hands keys, with the number of the batch drawing the utterance: another pass, another degradation
    drawn = dataset()[(1, 40)]["feats"]
    assert torch.equal(drawn, dataset()[(1, 40)]["feats"]) and not torch.equal(drawn, dataset()[(1, 41)]["feats"])


def schroeder_rt60(h: torch.Tensor, rate: int) -> float:
    """Reverberation time of an impulse response's tail: 3 x T20 of its energy decay curve."""
    energy = torch.flip(torch.cumsum(torch.flip(h.double() ** 2, [0]), 0), [0])
    edc = 10 * torch.log10(energy / energy[0])
    t5, t25 = int((edc > -5).sum()), int((edc > -25).sum())
    return 3 * (t25 - t5) / rate


def test_make_noise_writes_readable_sets(tmp_path):
    out = tmp_path / "noise"
    make_noise(["generate", "-o", str(out), "--speech", os.path.join(MINI, "train.jsonl"), "--types", "pink", "babble",
                "--talkers", "2", "2", "--noise-count", "1", "--seconds", "0.5", "--rir-count", "2",
                "--simulator", "decay", "--rt60", "0.1", "0.3"])
    noises = read_recordings([str(out / "noise.jsonl")], "noise")
    rirs = read_recordings([str(out / "rir.jsonl")], "rir")
    assert len(noises) == 2 and len(rirs) == 2
    for r in noises + rirs:
        assert load_audio(r.path).abs().max() > 0
    lines = [json.loads(line) for line in (out / "rir.jsonl").read_text().splitlines()]
    for r, line in zip(rirs, lines):
        h = load_audio(r.path)
        # The direct path is the peak, 1.0, within the 1-20 ms delay, before any of the tail.
        peak = int(h.abs().argmax())
        assert h[peak] == 1.0 and peak <= 0.02 * RATE + 1 and not h[:peak].any()
        assert h[peak + 1:].abs().max() < 1.0
        # The tail decays at the RT60 the line records (0.1-0.3 s asked), measured by Schroeder's
        # backward integration: 3 x the time from -5 to -25 dB of the energy decay curve.
        assert 0.1 <= line["rt60"] <= 0.3 and line["simulator"] == "decay"
        assert schroeder_rt60(h[peak + 1:], RATE) == pytest.approx(line["rt60"], rel=0.25)

    test = tmp_path / "test.jsonl"
    test.write_text("".join((open(os.path.join(MINI, "dev.jsonl")).readlines()[:2])).replace(
        '"audio/', f'"{MINI}/audio/'))
    make_noise(["degrade", "--manifest", str(test), "--noise", str(out / "noise.jsonl"), "--rir",
                str(out / "rir.jsonl"), "--snr", "5", "5", "-o", str(tmp_path / "noisy")])
    clean, noisy = read_manifest(str(test)), read_manifest(str(tmp_path / "noisy" / "manifest.jsonl"))
    assert [u.text for u in noisy] == [u.text for u in clean]
    for c, n in zip(clean, noisy):
        assert abs(load_audio(n.audio_filepath).numel() / RATE - n.duration) < 1e-3
        assert not torch.allclose(load_audio(n.audio_filepath), load_audio(c.audio_filepath), atol=1e-3)


def test_make_noise_degrades_a_corpus_into_unequal_languages_levels_and_edges(tmp_path):
    """degrade as a corpus builder: every kept file quieter by the asked range with longer edges, and
    a language thinned to its share by a seeded draw, the rest kept whole."""
    lines = open(os.path.join(MINI, "train.jsonl")).readlines()
    test = tmp_path / "train.jsonl"
    test.write_text("".join(lines).replace('"audio/', f'"{MINI}/audio/'))
    langs = [json.loads(line)["source_lang"] for line in lines]
    args = ["degrade", "--manifest", str(test), "--gain", "-20", "-10", "--edges", "0.2", "0.4",
            "--keep", f"{langs[0]}=0.5", "--seed", "3"]
    make_noise(args + ["-o", str(tmp_path / "a")])
    make_noise(args + ["-o", str(tmp_path / "b")])
    clean = {u.text: u for u in read_manifest(str(test))}
    out = read_manifest(str(tmp_path / "a" / "manifest.jsonl"))
    kept = [u.source_lang for u in out]
    others = [lang for lang in langs if lang != langs[0]]
    assert sorted(lang for lang in kept if lang != langs[0]) == sorted(others)  # other languages whole
    n = langs.count(langs[0])
    assert 0.2 * n <= kept.count(langs[0]) <= 0.8 * n  # about half of this one
    for u in out:
        c, x = load_audio(clean[u.text].audio_filepath), load_audio(u.audio_filepath)
        assert 0.4 - 0.01 <= (x.numel() - c.numel()) / RATE <= 0.8 + 0.01  # two edges of 0.2-0.4 s each
        peak_db = 20 * math.log10(float(x.abs().max()) / float(c.abs().max()))
        assert -20.01 <= peak_db <= -9.99
    again = read_manifest(str(tmp_path / "b" / "manifest.jsonl"))
    assert [u.text for u in again] == [u.text for u in out]  # the same seed keeps the same lines
    with pytest.raises(SystemExit, match="LANG=SHARE"):
        make_noise(["degrade", "--manifest", str(test), "--keep", "fr", "-o", str(tmp_path / "c")])


def test_make_noise_rooms_by_pyroomacoustics(tmp_path):
    pytest.importorskip("pyroomacoustics")
    make_noise(["generate", "-o", str(tmp_path), "--noise-count", "0", "--rir-count", "1", "--rt60", "0.2", "0.25",
                "--room", "3", "4", "--height", "2.5", "3"])
    line = json.loads((tmp_path / "rir.jsonl").read_text())
    assert line["simulator"] == "pyroomacoustics" and len(line["room"]) == 3
    assert load_audio(tmp_path / line["audio_filepath"]).abs().max() == 1.0


def spectral_flatness(x: torch.Tensor) -> float:
    """Geometric over arithmetic mean of the power spectrum: ~0.56 for white noise, near 0 for tones."""
    power = torch.fft.rfft(x.double()).abs() ** 2 + 1e-20
    return float(power.log().mean().exp() / power.mean())


def test_make_noise_synthesises_sounds_of_each_kind(tmp_path):
    """Each synthesised kind is what it says: tonal music and sirens, hum at the mains frequency, an
    engine's low harmonics, rain's broadband droplets; the held-out kinds are not the training ones."""
    from tools.make_noise import SPLIT_TYPES

    assert not (set(SPLIT_TYPES["train"]) & set(SPLIT_TYPES["heldout"])) - {"babble"}
    kinds = ["music", "hum", "engine", "rain", "siren"] + (["pluck"] if shutil.which("sox") else [])
    make_noise(["generate", "-o", str(tmp_path), "--types", *kinds, "--noise-count", "2", "--seconds", "3",
                "--rir-count", "0"])
    lines = [json.loads(line) for line in (tmp_path / "noise.jsonl").read_text().splitlines()]
    assert sorted({line["type"] for line in lines}) == sorted(kinds) and len(lines) == 2 * len(kinds)
    for line in lines:
        x = load_audio(tmp_path / line["audio_filepath"])
        assert x.numel() == 3 * RATE and abs(float(x.abs().max()) - 0.5) < 1e-3, line
        power = torch.fft.rfft(x.double()).abs() ** 2
        hz = torch.fft.rfftfreq(x.numel(), 1 / RATE)
        below = float(power[hz < 1000].sum() / power.sum())
        kind = line["type"]
        if kind in ("music", "siren", "pluck"):
            assert spectral_flatness(x) < 0.05, line  # tones, not noise
        if kind == "hum":
            mains = min((50, 60), key=lambda f: -float(power[(hz - f).abs() < 1].sum()))
            assert float(power[(hz % mains < 1) | (hz % mains > mains - 1)].sum() / power.sum()) > 0.9, line
        if kind == "engine":
            assert below > 0.75, line  # most of it in the low harmonics
        if kind == "rain":
            assert spectral_flatness(x) > 0.1 and below < 0.9, line  # broadband
        if kind == "siren":
            peak_hz = float(hz[int(power.argmax())])
            assert 350 < peak_hz < 1700, line


# --- the edges ----------------------------------------------------------------------------------


def recording(lead: float = 0.3, trail: float = 0.2, floor: float = 0.0, seconds: float = 0.8) -> torch.Tensor:
    """`lead` s of floor, `seconds` of speech, `trail` s of floor: (S,); the floor Gaussian at RMS `floor`."""
    g = torch.Generator().manual_seed(2)
    n = round((lead + seconds + trail) * RATE)
    wav = floor * torch.randn(n, generator=g)
    start = round(lead * RATE)
    return torch.cat([wav[:start], wav[start: start + round(seconds * RATE)] + speech(seconds),
                      wav[start + round(seconds * RATE):]])


def first_last_speech(wav: torch.Tensor) -> tuple[float, float]:
    """Seconds of non-speech before the first and after the last speech frame."""
    spoken = speech_frames(wav, RATE).nonzero().flatten()
    return int(spoken[0]) / 100, wav.numel() / RATE - (int(spoken[-1]) + 1) / 100


def test_edges_crop_silence_and_never_speech():
    wav = recording(lead=0.3, trail=0.2)
    lead, trail = first_last_speech(wav)
    rng = np.random.default_rng(0)
    some = change_edges(wav, RATE, -0.1, -0.05, "zeros", rng)
    assert some.numel() == wav.numel() - round(0.15 * RATE)
    assert torch.equal(some, wav[round(0.1 * RATE): wav.numel() - round(0.05 * RATE)])
    every = change_edges(wav, RATE, -5.0, -5.0, "zeros", rng)  # far more than it holds: all of it, no speech
    assert torch.equal(every, wav[round(lead * RATE): wav.numel() - round(trail * RATE)])
    silent = torch.zeros(RATE // 2)  # no speech: nothing to crop around, silence still added
    assert torch.equal(change_edges(silent, RATE, -0.2, -0.2, "zeros", rng), silent)
    assert change_edges(silent, RATE, 0.1, -0.2, "zeros", rng).numel() == silent.numel() + RATE // 10


def test_edges_add_zeros_or_the_recordings_own_floor():
    rng = np.random.default_rng(0)
    quiet = recording(floor=1e-3)
    zeros = change_edges(quiet, RATE, 0.25, 0.1, "zeros", rng)
    before, after = round(0.25 * RATE), round(0.1 * RATE)
    assert zeros.numel() == quiet.numel() + before + after
    assert torch.equal(zeros[before: before + quiet.numel()], quiet)
    assert not zeros[:before].any() and not zeros[-after:].any()
    floored = change_edges(quiet, RATE, 0.25, 0.1, "floor", rng)
    assert torch.equal(floored[before: before + quiet.numel()], quiet)
    added = torch.cat([floored[:before], floored[-after:]])
    # the recording's own floor: samples of its non-speech stretches, at their level, with no speech in them
    own = set(quiet[: round(0.25 * RATE)].tolist()) | set(quiet[-round(0.15 * RATE):].tolist())
    assert set(added.tolist()) <= set(quiet.tolist()) and len(set(added.tolist()) & own) > 0.9 * added.numel()
    assert abs(added.pow(2).mean().sqrt() / 1e-3 - 1) < 0.1
    assert first_last_speech(floored)[0] >= 0.25 + first_last_speech(quiet)[0] - 0.011
    # too little floor to loop: zeros instead
    tone = 0.3 * torch.sin(2 * math.pi * 220 * torch.arange(RATE) / RATE)  # speech from end to end
    tight = change_edges(torch.cat([1e-3 * torch.randn(320), tone, 1e-3 * torch.randn(320)]), RATE, 0.2, 0.0, "floor", rng)
    assert not tight[: round(0.2 * RATE)].any()


def test_edges_through_augment_replay_and_bound_the_length(sets):
    noise, rir = sets
    cfg = AugmentConfig(edge_prob=1.0, edge_seconds=(-0.4, 0.3))
    wav = recording(floor=1e-3)
    a, resumed = Augment(cfg, RATE), Augment(cfg, RATE)
    outs = [a(wav, 3, i, draw) for i in range(4) for draw in range(5)]
    assert all(torch.equal(o, resumed(wav, 3, i, draw)) for o, (i, draw) in
               zip(outs, [(i, d) for i in range(4) for d in range(5)]))
    lengths = {o.numel() for o in outs}
    assert len(lengths) == len(outs)  # every pass another edge
    assert max(lengths) <= wav.numel() + round(cfg.added_seconds * RATE)
    assert min(lengths) < wav.numel() < max(lengths)
    # the edges draw apart from the degradations: a gain drawn with edges on is the gain drawn without
    gain = AugmentConfig(gain_prob=1.0)
    both = AugmentConfig(gain_prob=1.0, edge_prob=1.0, edge_seconds=(0.0, 0.0))
    assert torch.equal(Augment(gain, RATE)(wav, 1, 2, 3), Augment(both, RATE)(wav, 1, 2, 3))
    assert AugmentConfig().added_seconds == 0.0 and cfg.added_seconds == pytest.approx(0.6)


def test_edges_vary_only_from_edge_after_on_and_then_as_without_it():
    """Batches before edge_after hear the utterance as read; from it on, the edges drawn as a run
    without the wait draws them (the same generator, so resume and replay hold either way)."""
    wav = recording(floor=1e-3)
    now, later = AugmentConfig(edge_prob=1.0, edge_seconds=(-0.2, 0.3)), AugmentConfig(
        edge_prob=1.0, edge_seconds=(-0.2, 0.3), edge_after=4)
    assert all(torch.equal(Augment(later, RATE)(wav, 3, i, draw), wav) for i in range(3) for draw in range(4))
    assert all(torch.equal(Augment(later, RATE)(wav, 3, i, draw), Augment(now, RATE)(wav, 3, i, draw))
               for i in range(3) for draw in range(4, 7))
    assert later.added_seconds == now.added_seconds  # batches are shaped for the edges from the start
    # A checkpoint says its model heard varied edges (and is decoded so) once it has trained past them.
    from aed.train_checkpoint import varied_edges
    from aed.train_config import TrainConfig
    cfg = TrainConfig(augment=later)
    assert not varied_edges(cfg, 4) and varied_edges(cfg, 5)
    assert varied_edges(dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, grad_accum=2)), 3)
    with pytest.raises(ConfigError, match="edge_after"):
        AugmentConfig(edge_after=-1)
