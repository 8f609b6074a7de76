"""aed/decode_policy.py alone, without a model: wait-k's lag and tokens per chunk, AlignAtt's fixed and
adaptive thresholds, the closing window, and the stall guard."""

import logging

import pytest

from aed.decode_policy import (ALIGNATT_MAX, ALIGNATT_MIN, PEAK_SPACINGS, PEAK_SPACINGS_MIN, STALL_SECONDS,
                               CommitPolicy, PolicyState)
from aed.decode_stream import StreamConfig

FRAME = 0.08  # seconds per encoder frame (10 ms features, 8x subsampling)
ATTEND = 20  # frames the decoder hears in each test chunk
NEWEST = ATTEND - 1  # a peak on the newest frame: AlignAtt holds it at any threshold


def per_chunk(policy, state, chunks: int, peak: int) -> list[int]:
    """Tokens committed at each of `chunks` chunks by a decoder that always has more to say."""
    out = []
    for chunk in range(chunks):
        taken = 0
        while taken < 10 and policy.decide(state, (chunk + 1) * 0.5, chunk, taken, peak, ATTEND):
            taken += 1
        out.append(taken)
    return out


def spaced(policy, spacings: list[float]) -> PolicyState:
    """A stream whose sentence committed tokens with attention peaks `spacings` seconds apart."""
    state, peak = PolicyState(), 1.0
    policy.committed(state, peak)
    for spacing in spacings:
        peak += spacing
        policy.committed(state, peak)
    return state


@pytest.mark.parametrize("lag,tokens", [(1, 1), (2, 1), (3, 2)])
def test_waitk_commits_nothing_before_its_lag_then_its_tokens_per_chunk(lag, tokens):
    policy = CommitPolicy(StreamConfig(policy="waitk", waitk_lag=lag, waitk_tokens=tokens), FRAME)
    # Peaks on the newest frame, which AlignAtt would hold: wait-k does not read them.
    assert per_chunk(policy, PolicyState(), 5, NEWEST) == [0] * (lag - 1) + [tokens] * (6 - lag)


def test_alignatt_holds_a_token_whose_peak_is_within_its_threshold_of_the_chunks_end():
    policy = CommitPolicy(StreamConfig(alignatt_threshold=0.32), FRAME)  # 4 frames after the peak
    peaks = (0, 14, 15, 16, NEWEST)
    assert [policy.decide(PolicyState(), 1.0, 0, 0, p, ATTEND) for p in peaks] == [True, True, True, False, False]
    # The default, before it has measured anything: ALIGNATT_MAX (8 frames).
    policy = CommitPolicy(StreamConfig(), FRAME)
    assert [policy.decide(PolicyState(), 1.0, 0, 0, p, ATTEND) for p in (11, 12)] == [True, False]
    assert per_chunk(policy, PolicyState(), 3, 0) == [10] * 3  # no cap of its own: the streamer's applies


def test_the_adaptive_threshold_follows_the_90th_percentile_of_recent_peak_spacings_within_its_range():
    policy = CommitPolicy(StreamConfig(), FRAME)
    assert StreamConfig().alignatt_threshold is None  # adaptive by default
    low, high = round(ALIGNATT_MIN / FRAME), round(ALIGNATT_MAX / FRAME)  # 2 and 8 frames
    assert policy.alignatt_frames(PolicyState()) == high
    assert policy.alignatt_frames(spaced(policy, [0.32] * (PEAK_SPACINGS_MIN - 1))) == high  # too few to read
    assert policy.alignatt_frames(spaced(policy, [0.32] * PEAK_SPACINGS_MIN)) == 4
    # The 90th percentile: 0.424 s (5 frames); not the median (1 frame), the 80th (2) or 95th (7), nor the largest (8).
    assert policy.alignatt_frames(spaced(policy, [0.08] * 8 + [0.40, 0.64])) == 5
    assert policy.alignatt_frames(spaced(policy, [0.0] * 20)) == low  # peaks that never move: the floor
    assert policy.alignatt_frames(spaced(policy, [2.0] * 20)) == high  # peaks far apart: the ceiling
    assert policy.alignatt_frames(spaced(policy, [2.0] * PEAK_SPACINGS + [0.32] * PEAK_SPACINGS)) == 4  # recent only
    # The threshold it reads decides: a token 5 frames before the chunk's end waits at 8 frames, not at 4.
    assert not policy.decide(PolicyState(), 1.0, 0, 0, ATTEND - 6, ATTEND)
    assert policy.decide(spaced(policy, [0.32] * PEAK_SPACINGS_MIN), 1.0, 0, 0, ATTEND - 6, ATTEND)


def test_peaks_are_spaced_within_a_sentence_only():
    policy = CommitPolicy(StreamConfig(), FRAME)
    state = spaced(policy, [0.32] * 3)
    policy.new_sentence(state)
    policy.committed(state, 30.0)  # the next sentence's first token: nothing before it to be spaced from
    assert list(state.peak_spacing) == pytest.approx([0.32] * 3) and state.last_peak == 30.0
    policy.committed(state, 29.0)  # a peak before the last one counts as no movement
    assert state.peak_spacing[-1] == 0.0


@pytest.mark.parametrize("config", [StreamConfig(), StreamConfig(alignatt_threshold=100.0),
                                    StreamConfig(policy="waitk", waitk_lag=3)], ids=["adaptive", "fixed", "waitk"])
def test_a_closing_window_commits_whatever_the_policy_would_hold(config):
    policy = CommitPolicy(config, FRAME)
    assert per_chunk(policy, PolicyState(), 1, NEWEST) == [0]  # held while the sentence goes on
    state = PolicyState()
    assert all(policy.decide(state, 1.0, 0, taken, NEWEST, ATTEND, closing=True, repeats=True)
               for taken in range(10))  # its end: every token, a repeat too
    assert state.holding is None  # nothing was held


def test_the_stall_guard_counts_once_per_stall(caplog):
    policy, state = CommitPolicy(StreamConfig(), FRAME), PolicyState()

    def held(now: float, peak: int = NEWEST, repeats: bool = False) -> bool:
        return not policy.decide(state, now, 0, 0, peak, ATTEND, repeats=repeats)

    with caplog.at_level(logging.WARNING, logger="aed.decode_policy"):
        assert held(1.0) and held(1.0 + STALL_SECONDS - 0.1) and state.stalls == 0  # not yet a stall
        assert all(held(1.0 + STALL_SECONDS + k) for k in range(10)) and state.stalls == 1  # one stall, said once
        policy.committed(state, 0.5)  # a commit ends it
        assert held(20.0) and held(20.0 + STALL_SECONDS) and state.stalls == 2
        policy.eos(state)  # so does EOS: the decoder had nothing more to say
        assert held(30.0) and held(30.0 + STALL_SECONDS - 0.1) and state.stalls == 2
        policy.eos(state)
        assert held(40.0) and state.stalls == 2
        # A repeat the search's guard holds counts as held, where the policy alone would commit the token.
        assert policy.decide(PolicyState(), 40.0 + STALL_SECONDS, 0, 0, 0, ATTEND)
        assert held(40.0 + STALL_SECONDS, peak=0, repeats=True) and state.stalls == 3
    assert sum("stream stalls" in r.message for r in caplog.records) == 3
