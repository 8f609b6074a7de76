"""Commit policies: whether a stream commits the token its decoder predicts now, or holds it back
until more audio has arrived.

A stream (aed.decode_stream) decodes a sentence chunk by chunk: at each chunk, greedy steps from the
sentence's committed tokens offer the policy one token at a time, until it holds one back (the
decoder predicts it again at the next chunk, from more audio):
  - waitk: after `waitk_lag` chunks, `waitk_tokens` tokens per chunk (Ma et al. 2019's wait-k).
  - alignatt: a token is committed while the cross-attention that predicted it peaks at least a
    threshold before the chunk's end (Papi et al. 2023, "AlignAtt"); a token looking at the newest
    audio waits for the next chunk. The threshold is `alignatt_threshold` seconds, or by default
    adapts to the model: the 90th percentile of the spacing between the attention peaks of
    consecutive committed tokens of a sentence (the stream's last PEAK_SPACINGS), within
    [ALIGNATT_MIN, ALIGNATT_MAX]. A token's sound runs on after its peak for about one such spacing,
    so the threshold covers nine tokens in ten. A character model whose peaks step a frame per
    character commits at the floor; a model whose peaks stand still over a word's pieces and then
    jump keeps NeMo's fixed 0.64 s, which it needs.
Where a sentence ends (`closing`), its audio is decoded to EOS without the policy: every token is
committed, what the policy held back included.

The stall guard: a stream whose decoder keeps predicting tokens that are held back (by the policy,
or by the search's repetition guard) for STALL_SECONDS of audio logs that it stalls, once per stall
(`PolicyState.stalls` counts them).

Each stream keeps its own `PolicyState`, changed only by `CommitPolicy`'s methods; the streamer
reads where its newest committed token's attention peaks (a sentence is never cut before it).
"""

import logging
import math
import statistics
from collections import deque
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

POLICIES = ("alignatt", "waitk")
STALL_SECONDS = 4.0  # audio during which the decoder has more to say but nothing is committed
ALIGNATT_MAX = 0.64  # s: the adaptive AlignAtt threshold's ceiling, and its value until it has measured
# PEAK_SPACINGS_MIN spacings (NeMo's fixed threshold of 8 frames at 80 ms)
ALIGNATT_MIN = 0.16  # s: its floor, two frames of 80 ms
PEAK_SPACINGS = 64  # the adaptive threshold reads the spacings of the peaks of this many recent tokens
PEAK_SPACINGS_MIN = 8  # ... once it has this many


@dataclass
class PolicyState:
    """What the policy keeps of one stream: the stall guard's clock, and the attention peaks of the
    committed tokens that the adaptive AlignAtt threshold reads."""

    holding: float | None = None  # stream time since which tokens are held back, None: none is
    stalls: int = 0  # times the stream stalled (see STALL_SECONDS)
    last_peak: float | None = None  # stream time of the attention peak of the sentence's newest token
    peak_spacing: deque = field(default_factory=lambda: deque(maxlen=PEAK_SPACINGS))  # seconds between the
    # attention peaks of consecutive committed tokens of a sentence


class CommitPolicy:
    """wait-k or AlignAtt, as `config` (an aed.decode_stream.StreamConfig: its policy, waitk_lag,
    waitk_tokens, alignatt_threshold) sets it, over encoder frames of `frame_s` seconds."""

    def __init__(self, config, frame_s: float):
        self.config, self.frame_s = config, frame_s
        self.alignatt_range = [max(1, round(t / frame_s)) for t in (ALIGNATT_MIN, ALIGNATT_MAX)]  # frames

    def decide(self, state: PolicyState, now: float, chunk: int, taken: int, peak: int, attend: int,
               closing: bool = False, repeats: bool = False) -> bool:
        """Whether to commit the decoder's next token (not EOS). now: the stream time (s) of the chunk's
        end; chunk: the chunk's index in the stream, from 0; taken: tokens committed in it so far;
        peak: the frame of the window the token's cross-attention peaks at, of the `attend` frames
        the decoder heard; closing: the sentence ends here; repeats: the search's repetition guard
        holds the token. A token held runs the stall guard."""
        if closing:  # the sentence's whole audio is heard: nothing is worth waiting for
            return True
        # A repeat too is held while more audio may change the decoder's mind.
        if repeats or not self.allows(state, chunk, taken, peak, attend):
            self.hold(state, now)
            return False
        return True

    def allows(self, state: PolicyState, chunk: int, taken: int, peak: int, attend: int) -> bool:
        """The policy's rule alone (see `decide`)."""
        cfg = self.config
        if cfg.policy == "waitk":
            return chunk + 1 >= cfg.waitk_lag and taken < cfg.waitk_tokens
        return attend - (peak + 1) >= self.alignatt_frames(state)

    def alignatt_frames(self, state: PolicyState) -> int:
        """Frames that must follow a token's attention peak in the chunk for AlignAtt to commit it."""
        if self.config.alignatt_threshold is not None:
            return round(self.config.alignatt_threshold / self.frame_s)
        low, high = self.alignatt_range
        if len(state.peak_spacing) < PEAK_SPACINGS_MIN:
            return high
        spacing = statistics.quantiles(state.peak_spacing, n=10, method="inclusive")[-1]  # the 90th percentile
        return min(high, max(low, round(spacing / self.frame_s)))

    def committed(self, state: PolicyState, peak_time: float) -> None:
        """A token was committed whose attention peaked at stream time `peak_time` (s): nothing is held."""
        state.holding = None
        if state.last_peak is not None:
            state.peak_spacing.append(max(0.0, peak_time - state.last_peak))
        state.last_peak = peak_time

    def eos(self, state: PolicyState) -> None:
        """The decoder ended its hypothesis: it has nothing more to say for now, so nothing is held."""
        state.holding = None

    def new_sentence(self, state: PolicyState) -> None:
        """A sentence ended: the next one's first token has no peak before it to be spaced from."""
        state.last_peak = None

    def hold(self, state: PolicyState, now: float) -> None:
        """A token was held back at stream time `now` (s): log once when that has lasted STALL_SECONDS."""
        if state.holding is None:
            state.holding = now
        elif now - state.holding >= STALL_SECONDS:
            state.stalls += 1
            log.warning("stream stalls: the decoder has had more to say for %.1f s of audio (%.1f-%.1f s) and "
                        "the %s policy committed nothing", now - state.holding, state.holding, now,
                        self.config.policy)
            state.holding = math.inf  # said once per stall; the next commit resets it
