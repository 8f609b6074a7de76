"""Audio as rooms make it: tools/make_long_audio.py --condition."""

import json
import os
import sys

import numpy as np
import pytest
import soundfile as sf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import make_long_audio  # noqa: E402

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

