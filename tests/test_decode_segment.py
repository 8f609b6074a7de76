"""Cutting long audio at its pauses (aed/decode_timing.py): no speech frame is left out or cut
where a pause was near, no segment is longer than the limit, silence is not decoded."""

import random

import pytest
import soundfile as sf
import torch

from aed.data_speech import FRAME, edge_silence, frame_db, speech_frames, trim_silence, trimmed_span
from aed.decode_timing import EDGE, PAUSE, plan_segments
from aed.decode_transcribe import Request, plan_chunks


def loud(seconds: float, g: torch.Generator) -> torch.Tensor:
    """Noise shaped like speech: syllables at 5 per second whose level dips 20 dB between them (steady
    noise is a room's, not a talker's)."""
    t = torch.arange(round(seconds * 16000)) / 16000
    return 0.3 * torch.randn(t.numel(), generator=g) * (0.1 + torch.sin(torch.pi * 5 * t).abs())


def speech_with_pauses(seed: int, floor: float = 0.0):
    """Bursts of noise (0.3-2.5 s, with inner gaps of 0.05-0.15 s) between pauses of 0.3-1.5 s, over
    a noise floor: the waveform and the (start, end) seconds of every burst."""
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    pieces, bursts, t = [], [], 0.0
    for _ in range(30):
        pause = rng.uniform(0.3, 1.5)
        pieces.append(torch.zeros(round(pause * 16000)))
        t += pause
        start = t
        for _ in range(rng.randint(1, 4)):  # words with short gaps: one stretch of speech
            if t > start:
                gap = rng.uniform(0.05, 0.15)
                pieces.append(torch.zeros(round(gap * 16000)))
                t += gap
            word = rng.uniform(0.2, 0.6)
            pieces.append(loud(word, g))
            t += word
        bursts.append((start, t))
    wav = torch.cat(pieces)
    return wav + floor * torch.randn(wav.numel(), generator=g), bursts


@pytest.mark.parametrize("seed,floor", [(0, 0.0), (1, 1e-3), (2, 1e-2)])
def test_segments_cover_every_burst_once_and_cut_only_in_pauses(seed, floor):
    wav, bursts = speech_with_pauses(seed, floor)
    limit = 4.0
    cuts = plan_segments(frame_db(wav, 16000), limit)
    assert all(c.end - c.start <= limit + 1e-6 for c in cuts)
    assert all(a.end <= b.start for a, b in zip(cuts, cuts[1:]))
    for start, end in bursts:  # each burst lies inside one segment: no stretch of speech is cut
        inside = [c for c in cuts if c.start <= start + FRAME and end - FRAME <= c.end]
        assert len(inside) == 1, (start, end, cuts)
    for c in cuts:  # a segment holds no pause of PAUSE or more, and at most EDGE of silence at each edge
        speech = [(s, e) for s, e in bursts if c.start <= s < c.end]
        assert speech and speech[0][0] - c.start <= EDGE + 2 * FRAME and c.end - speech[-1][1] <= EDGE + 2 * FRAME
        assert all(b[0] - a[1] < PAUSE + 2 * FRAME for a, b in zip(speech, speech[1:])) or \
            max(e for _, e in speech) - min(s for s, _ in speech) > limit - 2 * EDGE


def test_continuous_speech_is_cut_at_its_quietest_point_and_silence_has_no_segments():
    g = torch.Generator().manual_seed(0)
    wav = torch.cat([loud(3.0, g), 0.3 * loud(0.1, g), loud(3.0, g)])  # a 10 dB dip at 3.0-3.1 s, no gap
    cuts = plan_segments(frame_db(wav, 16000), 4.0)
    assert len(cuts) == 2 and not cuts[0].pause_after and cuts[1].pause_after
    assert 3.0 <= cuts[0].end <= 3.1 and cuts[1].start == cuts[0].end
    assert plan_segments(frame_db(torch.zeros(16000 * 60), 16000), 4.0) == []
    assert not speech_frames(torch.zeros(16000), 16000).any()


def test_plan_chunks_keeps_short_files_whole_and_reads_long_ones_in_blocks(tmp_path, monkeypatch):
    import aed.decode_transcribe as transcribe_module
    wav, bursts = speech_with_pauses(3)
    path = tmp_path / "x.wav"
    sf.write(path, wav.numpy(), 16000, subtype="FLOAT")
    total = wav.numel() / 16000
    assert plan_chunks(Request(str(path), "en", "en", True, "asr"), total + 1, 16000) == (total, [(0.0, None, total)])
    monkeypatch.setattr(transcribe_module, "BLOCK_SECONDS", 7.0)  # block edges fall inside bursts
    seconds, chunks = plan_chunks(Request(str(path), "en", "en", True, "asr"), 4.0, 16000)
    assert seconds == pytest.approx(total)
    assert [(round(o, 2), round(d, 2)) for o, d, _ in chunks] == \
        [(round(c.start, 2), round(c.end - c.start, 2)) for c in plan_segments(frame_db(wav, 16000), 4.0)]
    _, merged = plan_chunks(Request(str(path), "en", "en", True, "asr"), 4.0, 16000, merge=True)
    assert len(merged) < len(chunks) and [(round(o, 2), round(d, 2)) for o, d, _ in merged] == \
        [(round(c.start, 2), round(c.end - c.start, 2)) for c in plan_segments(frame_db(wav, 16000), 4.0, merge=True)]


def test_plan_chunks_trims_a_short_file_as_training_trimmed_its_utterances(tmp_path):
    """With `trim` (a model trained with train.trim_silence) a short input is read from `trim` s before its
    first speech frame to `trim` s after its last: the samples `trim_silence` keeps, at the request's offset."""
    g = torch.Generator().manual_seed(2)
    wav = torch.cat([torch.zeros(9600), loud(1.0, g), torch.zeros(17600)])  # 0.6 s, 1 s of speech, 1.1 s
    path = tmp_path / "x.wav"
    sf.write(path, wav.numpy(), 16000, subtype="FLOAT")
    total, ((offset, duration, seconds),) = plan_chunks(Request(str(path), "en", "en", True, "asr"), 30.0, 16000, trim=0.15)
    start, end = trimmed_span(wav, 16000, 0.15)
    assert total == pytest.approx(2.7) and (offset, duration) == pytest.approx((start / 16000, (end - start) / 16000))
    assert offset == pytest.approx(0.45, abs=2 * FRAME) and seconds == duration == pytest.approx(1.3, abs=2 * FRAME)
    assert torch.equal(trim_silence(wav, 16000, 0.15), wav[start:end])
    later = Request(str(path), "en", "en", True, "asr", offset=0.2)
    assert plan_chunks(later, 30.0, 16000, trim=0.15)[1][0][0] == pytest.approx(offset, abs=1e-6)


@pytest.mark.parametrize("floor", [0.0, 0.003])
def test_trim_silence_keeps_its_margin_around_the_speech_and_leaves_silence_alone(floor):
    """Over digital silence and over a faint noise floor: 0.6 s before and 1.1 s after 1 s of speech
    trimmed to 0.15 s each side (to the frame); an edge shorter than the margin stays as it is."""
    g = torch.Generator().manual_seed(1)
    speech = loud(1.0, g)

    def padded(before, after):
        wav = torch.cat([torch.zeros(round(before * 16000)), speech, torch.zeros(round(after * 16000))])
        return wav + floor * torch.randn(wav.numel(), generator=g)

    trimmed = trim_silence(padded(0.6, 1.1), 16000, 0.15)
    assert trimmed.numel() / 16000 == pytest.approx(1.3, abs=2 * FRAME)
    assert edge_silence([trimmed], 16000) == pytest.approx((0.15, 0.15), abs=FRAME)
    short = trim_silence(padded(0.05, 0.6), 16000, 0.15)
    assert edge_silence([short], 16000) == pytest.approx((0.05, 0.15), abs=FRAME)
    quiet = floor * torch.randn(16000, generator=g)
    assert torch.equal(trim_silence(quiet, 16000, 0.15), quiet)


def test_edge_silence_is_the_median_silence_around_the_speech():
    g = torch.Generator().manual_seed(0)
    wavs = [torch.cat([torch.zeros(round(a * 16000)), loud(1.0, g), torch.zeros(round(b * 16000))])
            for a, b in [(0.1, 0.3), (0.2, 0.1), (0.3, 0.2), (0.0, 0.0)]]
    lead, trail = edge_silence(wavs + [torch.zeros(16000)], 16000)  # silence alone is left out
    assert lead == pytest.approx(0.1, abs=FRAME) and trail == pytest.approx(0.1, abs=FRAME)
    assert edge_silence([torch.zeros(16000)], 16000) is None
    # Segments take those edges: 0.1 s before the speech, 0.1 s after it.
    wav = torch.cat([torch.zeros(16000), loud(1.0, g), torch.zeros(16000), loud(1.0, g), torch.zeros(16000)])
    cuts = plan_segments(frame_db(wav, 16000), 1.5, edges=(lead, trail))
    assert [(round(c.start, 2), round(c.end, 2)) for c in cuts] == [(0.9, 2.1), (2.9, 4.1)]


def coloured(seconds: float, beta: float, dbfs: float, g: torch.Generator) -> torch.Tensor:
    """Noise with a 1/f^beta power spectrum (1 pink, 2 brown: a room's rumble) at `dbfs` RMS."""
    n = round(seconds * 16000)
    spectrum = torch.fft.rfft(torch.randn(n, generator=g))
    noise = torch.fft.irfft(spectrum / torch.arange(spectrum.numel()).clamp(min=1) ** (beta / 2), n)
    return noise / noise.pow(2).mean().sqrt() * 10 ** (dbfs / 20)


@pytest.mark.parametrize("beta,dbfs,seconds", [(0.0, -60.0, 20.0), (1.0, -60.0, 20.0), (2.0, -50.0, 60.0),
                                               (1.0, -20.0, 30.0)])
def test_steady_noise_or_room_tone_of_any_length_holds_no_speech(beta, dbfs, seconds):
    """A minute of room tone or steady noise, faint or loud: nothing in it is speech, so long-form
    decoding has no segment there and a stream no sentence."""
    wav = coloured(seconds, beta, dbfs, torch.Generator().manual_seed(int(beta * 10)))
    assert not speech_frames(wav, 16000).any()
    assert plan_segments(frame_db(wav, 16000), 4.0) == []


@pytest.mark.parametrize("room", ["snr 10 dB", "level change", "quiet talker, knock"])
def test_speech_is_found_in_rooms_and_no_noise_or_knock_is(room):
    """Bursts of speech-like noise (about -13 dBFS) in rooms: pink noise at 10 dB SNR; pink noise that
    rises from -50 to -30 dBFS halfway (a machine switched on); every third burst 24 dB down (a
    far talker) over faint room tone, with a 30 ms knock near full scale in a pause. Every burst lies
    in a segment, and no segment reaches into the middle of a pause of 1 s or more (the knock's)."""
    g = torch.Generator().manual_seed(5)
    wav, bursts = speech_with_pauses(5)
    seconds = wav.numel() / 16000
    if room == "snr 10 dB":
        wav = wav + coloured(seconds, 1.0, -23.0, g)
    elif room == "level change":
        half = wav.numel() // 2
        wav = wav + torch.cat([coloured(half / 16000, 1.0, -50.0, g), coloured(seconds - half / 16000, 1.0, -30.0, g)])
    else:
        for start, end in bursts[1::3]:
            wav[round(start * 16000): round(end * 16000)] *= 10 ** (-24 / 20)
        wav = wav + coloured(seconds, 2.0, -70.0, g)
    pauses = [(a[1] + b[0]) / 2 for a, b in zip(bursts, bursts[1:]) if b[0] - a[1] >= 1.0]
    knock = round(pauses[0] * 16000)
    if room == "quiet talker, knock":
        wav[knock: knock + 480] += 0.9 * torch.randn(480, generator=g)
    cuts = plan_segments(frame_db(wav, 16000), 4.0)
    for start, end in bursts:
        assert any(c.start <= start + 2 * FRAME and end - 2 * FRAME <= c.end for c in cuts), (room, start, end, cuts)
    for middle in pauses:
        assert not any(c.start <= middle <= c.end for c in cuts), (room, middle, cuts)


@pytest.mark.parametrize("seed", [0, 4])
def test_merged_segments_join_short_pauses_up_to_the_limit_and_split_at_the_longest(seed):
    """With `merge`, stretches whose pause is at most the two edges together share a segment while it
    fits the limit; a longer pause always ends one, and a group too long is split at its longest pause."""
    wav, bursts = speech_with_pauses(seed)
    limit, edges = 6.0, (0.35, 0.35)
    apart = plan_segments(frame_db(wav, 16000), limit, edges=edges)
    merged = plan_segments(frame_db(wav, 16000), limit, edges=edges, merge=True)
    assert len(merged) < len(apart) and all(c.end - c.start <= limit + 1e-6 for c in merged)
    groups = [[b for b in bursts if c.start <= b[0] + FRAME and b[1] - FRAME <= c.end] for c in merged]
    assert sorted(b for g in groups for b in g) == sorted(bursts)  # each burst in exactly one segment
    for group in groups:
        assert all(b[0] - a[1] <= sum(edges) + 2 * FRAME for a, b in zip(group, group[1:]))
    assert all(c.pause_after for c in merged)  # every cut is at a pause: nothing to overlap


def test_merged_segments_split_a_group_too_long_at_its_longest_pause():
    """Words of 1 s after pauses of 0.5, 0.4, 0.6, 0.3, then 2.0 s: the first five share a pause of at
    most 0.7 s (two edges of 0.35 s), too long together for 4 s less the edges, so they split at the
    longest inner pause (0.6 s), and the first three, still too long, at theirs (0.5 s); the 2 s pause
    always ends a segment."""
    g = torch.Generator().manual_seed(1)
    pauses = [0.5, 0.4, 0.6, 0.3, 2.0]
    pieces = [loud(1.0, g)]
    for p in pauses:
        pieces += [torch.zeros(round(p * 16000)), loud(1.0, g)]
    wav = torch.cat([torch.zeros(16000)] + pieces + [torch.zeros(16000)])
    starts = [1.0 + i + sum(pauses[:i]) for i in range(6)]  # each word's start (s)
    merged = plan_segments(frame_db(wav, 16000), 4.0, edges=(0.35, 0.35), merge=True)
    words = [[i for i, t in enumerate(starts) if c.start <= t + FRAME and t + 1 - FRAME <= c.end] for c in merged]
    assert words == [[0], [1, 2], [3, 4], [5]]
    assert len(plan_segments(frame_db(wav, 16000), 4.0, edges=(0.35, 0.35))) == 6
