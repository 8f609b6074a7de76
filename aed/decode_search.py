"""Batched greedy and beam search over the KV-cached decoder, optionally joint with the CTC head
(`CTCPrefixScorer`, first below).

    model.eval()
    options = DecodingOptions(beam_size=4)
    hyps = decode_features(model, feats, feat_lens, prompt, eos_id, options)[0]  # features -> ids per row
    hyps = search(model, *model.encode_with_ctc(feats, feat_lens), prompt, eos_id, options)  # the same, in two steps

CTC prefix scores of growing hypotheses.

The attention decoder alone can loop ("que que que ...") or stop early: nothing ties its output to
the audio. The encoder's CTC head can: the CTC prefix probability of a hypothesis h,

    psi(h) = sum over every label sequence that starts with h of P_ctc(sequence | x),

falls as soon as h says something the frames do not support, and P_ctc(h | x), the score of ending
h with EOS, is small until h covers everything that was said. Joint decoding (Watanabe et al. 2017,
"Hybrid CTC/attention architecture for end-to-end speech recognition", sec. III-B; ESPnet's
CTCPrefixScore) ranks each extension h = g + c by (1 - lambda) log P_att(c | g) + lambda (psi(h) - psi(g)).

psi comes from the CTC forward variables of the prefix, over frames t < T' (n: h's last label is
emitted at frame t, b: a blank is):

    r_n(h)[t] = x_t(c) * (r_n(h)[t-1] + phi[t-1])       phi[t-1] = r_b(g)[t-1] + (r_n(g)[t-1] unless c == last(g))
    r_b(h)[t] = x_t(blank) * (r_n(h)[t-1] + r_b(h)[t-1])
    psi(h)    = sum_t phi[t-1] x_t(c)

with x_t the CTC probabilities, and a virtual frame -1 at which the empty prefix has r_b = 1. Each
recursion is linear, so it unrolls into cumulative sums over frames: with X[t] = sum_{k<=t} log x_k(c),

    log r_n(h)[t] = X[t] + logcumsumexp_s(log phi[s-1] - X[s-1])[t]

(likewise r_b with the blank's cumulative sum). That scores every candidate token of every
hypothesis at once, with no Python loop over frames. Only a few candidates are scored per
hypothesis (the attention decoder's top ones, ESPnet's pre-beam): O(T' x candidates) per step,
not O(T' x vocabulary). With an n-gram of the training transcripts (`DecodingOptions.lm`,
aed/decode_lm.py), each candidate's step score also gains lm_weight x its n-gram log-probability
(shallow fusion); greedy decoding with one is a beam of one.

The searches. `prompt` (B, P) holds the same-length Canary prompt per utterance (`<|startoftranscript|><|src|><|task|>
<|tgt|><|pnc|>`); the result is, per utterance, the generated ids after the prompt, without EOS.
Both searches run one batched decoder step per token for the whole batch, keep finished rows at EOS,
and look at the device (to stop early) only every SYNC_EVERY steps. `model` is an AED, an
aed.model_static.CompiledAED of one (the same steps: cfg, encode_with_ctc, new_cache, decode_step, on a
fixed-shape cache, compiled), or an aed.model_static.ExportedAED of its torch.export programs: these
loops are the only decoding loops, and the searches cannot tell the three apart.

An attention decoder trained on little data babbles: it repeats a word until the length limit. Three
things stop that, all on by default: with a CTC head, hypotheses are ranked by joint CTC/attention
scores (above), which drop as soon as a hypothesis says what the audio does not; a
hypothesis that ends in an n-gram repeated more than `max_repeats` times is stopped; and none may
exceed `max_tokens_per_second` of audio.
"""

import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F

from aed import decode_lm


NEG_INF = float("-inf")


class CTCPrefixScorer:
    """Forward variables of R = B * K hypotheses (row r belongs to utterance r // K), grown one token per step.

        scorer = CTCPrefixScorer(ctc_log_probs, enc_lens, rows_per_utterance=K)
        psi = scorer.score(cand)         # (R, C) log psi(g + c) for candidate tokens cand (R, C)
        end = scorer.end_score()         # (R,) log P_ctc(g | x): g followed by EOS
        scorer.select(origin, choice)    # row r now holds hypothesis origin[r] + cand[origin[r], choice[r]]

    ctc_log_probs (B, T', V + 1) from `model.ctc` (blank = the last id), enc_lens (B,). The log-probs
    are read where they are, per step only those of the candidates; the sums over frames run in
    float64: cumulative log-probabilities reach -1e4 over a few hundred frames, where float32 keeps
    only about three decimals of their differences.
    """

    def __init__(self, ctc_log_probs, enc_lens, rows_per_utterance: int = 1):
        b, t, _ = ctc_log_probs.shape
        assert enc_lens.shape == (b,), f"enc_lens {tuple(enc_lens.shape)} != ({b},)"
        k, device = rows_per_utterance, ctc_log_probs.device
        self.log_probs = ctc_log_probs
        self.utterance = torch.arange(b, device=device).repeat_interleave(k)  # (R,) each row's utterance
        self.frames = torch.arange(t, device=device)
        blank = ctc_log_probs[..., -1].double().repeat_interleave(k, dim=0)  # (R, T')
        self.blank_sum = F.pad(blank.cumsum(-1), (1, 0))  # (R, T'+1): log prod of blanks up to frame t, from frame -1
        lens = enc_lens.repeat_interleave(k)
        self.valid = self.frames[None, :] < lens[:, None]  # (R, T')
        self.last_frame = lens  # index of frame T'-1 in the (T'+1)-long variables, which start at frame -1
        # The empty prefix: emitted nothing (r_n = 0), only blanks (r_b = cumulative blank prob, 1 at frame -1).
        r_n = torch.full_like(self.blank_sum, NEG_INF)
        self.r = torch.stack([r_n, self.blank_sum], dim=1)  # (R, 2, T'+1): log r_n, log r_b per frame -1..T'-1
        self.psi = torch.zeros(b * k, dtype=torch.float64, device=device)  # log psi of each row's prefix
        self.last = torch.full((b * k,), -1, dtype=torch.long, device=device)  # its last token; -1: none
        self.cand_r = None  # (R, C, 2, T'+1) variables of the last scored candidates, for `select`

    def score(self, cand):
        """cand (R, C) token ids (no EOS, no blank) -> log psi(g + c) (R, C), float64."""
        r, c = cand.shape
        x = self.log_probs[self.utterance[:, None, None], self.frames, cand[:, :, None]].double()  # (R, C, T') log x_t(c)
        r_n, r_b = self.r[:, 0, None, :-1], self.r[:, 1, None, :-1]  # (R, 1, T') prefix g at frames -1..T'-2
        # phi[t-1]: g is complete by frame t-1 and c may start at t; a repeated label needs a blank between.
        phi = torch.where(cand[:, :, None] == self.last[:, None, None], r_b, torch.logaddexp(r_n, r_b))  # (R, C, T')
        cum_x = x.cumsum(-1)
        new_n = cum_x + torch.logcumsumexp(phi - F.pad(cum_x[..., :-1], (1, 0)), dim=-1)  # (R, C, T')
        prev_n = F.pad(new_n[..., :-1], (1, 0), value=NEG_INF)  # r_n(h) at frame t-1; -inf at frame -1
        blank_sum = self.blank_sum[:, None, 1:]  # (R, 1, T')
        new_b = blank_sum + torch.logcumsumexp(prev_n - self.blank_sum[:, None, :-1], dim=-1)
        start = torch.full((r, c, 2, 1), NEG_INF, dtype=x.dtype, device=x.device)  # h is never complete at frame -1
        self.cand_r = torch.cat([start, torch.stack([new_n, new_b], dim=2)], dim=3)  # (R, C, 2, T'+1)
        return (phi + x).masked_fill(~self.valid[:, None, :], NEG_INF).logsumexp(-1)  # frames < T' of each row

    def end_score(self):
        """(R,) log P_ctc(g | x): every frame is used and g is complete at the last one."""
        at_end = self.r.gather(2, self.last_frame[:, None, None].expand(-1, 2, 1))  # (R, 2, 1)
        return at_end.logsumexp(dim=(1, 2))

    def select(self, origin, choice, psi, token):
        """Row r continues row origin[r] with candidate column choice[r] of the last `score`; its prefix
        score is psi[r] and its new last token token[r] (all (R,)). A choice past the scored columns
        (EOS) leaves that row's variables as they were: a finished hypothesis is never extended."""
        scored = choice < self.cand_r.size(1)
        picked = self.cand_r[origin, choice.clamp(max=self.cand_r.size(1) - 1)]  # (R, 2, T'+1)
        self.r = torch.where(scored[:, None, None], picked, self.r[origin])
        self.psi = psi
        self.last = token


SYNC_EVERY = 8  # steps between "all finished?" checks: each check waits for the device, stalling the GPU queue
REPEAT_NGRAM = 6  # the repetition guard looks at n-grams of up to this many tokens: a word or two of BPE pieces


@dataclass(frozen=True)
class DecodingOptions:
    """How to search: the one place the decoding options are written. Each field holds its default and,
    in metadata["help"], its description for users: infer.py makes its decoding flags from the fields
    (aed.cli_infer.add_decoding_flags) and validation in training reads them as the val.decoding
    section, so an option added here appears in both. A field marked `set_from` is no user option:
    whoever decodes sets it from the model."""

    # 1: batched greedy search; >1: vectorised beam search over B x beam_size rows
    beam_size: int = field(default=1, metadata={"help": "1: greedy search"})
    # GNMT alpha: rank by logP / ((5 + len) / 6)^alpha; 0 ranks by logP (Canary's default)
    length_penalty: float = field(default=0.0, metadata={
        "help": "beam search GNMT alpha; 0 ranks hypotheses by log-probability"})
    max_delta: int = field(default=50, metadata={
        "help": "at most encoder frames + this many tokens per chunk, as NeMo's max_generation_delta"})
    # An absolute cap on new tokens per utterance, on top of max_delta.
    max_new_tokens: int | None = field(default=None, metadata={"help": "cap on generated tokens per chunk"})
    # Joint CTC/attention scoring, for models with a CTC head: (1 - w) log P_att + w log P_ctc (Watanabe et
    # al. 2017; 0.3 is ESPnet's usual weight for ASR). 0 ranks by the attention decoder alone. Not the CTC
    # loss weight of training (model.ctc_loss_weight), which gives a model its head.
    ctc_weight: float = field(default=0.3, metadata={
        "help": "joint CTC/attention decoding weight for models with a CTC head, streams too; 0: attention only"})
    # CTC's prefix scores cost time per candidate: only the attention decoder's best are scored.
    ctc_candidates: int = field(default=8, metadata={
        "help": "joint CTC/attention decoding: how many of the attention decoder's best tokens (and EOS) CTC "
                "scores per hypothesis and step"})
    # An n-gram is up to REPEAT_NGRAM tokens. The bundled transcripts repeat one at most 3 times (digit strings).
    max_repeats: int = field(default=4, metadata={
        "help": "stop a hypothesis that repeats an n-gram more than this many times in a row; 0: never"})
    # None or 0: no bound. The bundled sentences have at most 16 (espeak-ng speaks fast and their BPE pieces
    # are short); Canary's tokenizers give about 4 on real speech.
    max_tokens_per_second: float | None = field(default=25.0, metadata={
        "help": "stop a hypothesis at this many tokens per second of audio; 0: no bound"})
    # Shallow fusion with an n-gram of the training transcripts (aed/decode_lm.py): a small model spells
    # what it hears as it sounds, and the n-gram knows the corpus's words. The weight was chosen on a
    # development set of the laptop recipe's model (docs/REPORT.md, "A language model of the transcripts").
    # None: transcribe gives a beam search the run's own n-gram where training counted one (train.lm_order).
    lm: str | None = field(default=None, metadata={"metavar": "FILE", "help": (
        "an n-gram language model of the training transcripts (tools/train_lm.py), fused into the search: "
        "each candidate token also scored by lm_weight x its log-probability under it (default: a beam "
        "search fuses the n-gram train.py counted into the model's run directory, lm.pt, where there is one)")})
    lm_weight: float = field(default=0.3, metadata={"help": (
        "weight of the n-gram's log-probabilities in the search (--lm's, or the run's own); 0: none")})
    # Transcribe, Streamer and validation set the model's.
    frame_seconds: float = field(default=0.08, metadata={
        "help": "seconds per encoder frame: converts max_tokens_per_second into frames",
        "set_from": "the model's feature hop x subsampling factor (aed.decode_timing.frame_seconds)"})
    # Whisper's no-speech check (`no_speech_probs`); None: not computed. On by default because joint CTC
    # decoding writes text on noise that the attention decoder, trained with non-speech examples, would end
    # at once: the CTC head still hears tokens in sounds it never met. 0.1 lies far above clean speech's
    # probability (at most 0.004 on the digits' dev set; under music at 0-20 dB SNR, 1 utterance of 48
    # passed it) and below all but a few non-speech clips' after non-speech training; a model never trained
    # on non-speech gives ~1e-5, so the check leaves its output alone (docs/REPORT.md, "Sounds the model
    # never heard"). Whisper's 0.6 applies to its own <|nospeech|> token.
    no_speech_threshold: float | None = field(default=0.1, metadata={"metavar": "P", "help": (
        "Whisper's no-speech check: the decoder's probability of ending right after the prompt (what "
        "non-speech training teaches) is written to --out as no_speech_prob, and a chunk (a stream's "
        "sentence, where it ends) above P gives none; --out counts them under `skipped`; 1: never")})
    # Whisper's second condition, on the mean log-probability per token (`NoSpeech.avg_logprobs`). None (or
    # 0, which every mean meets): the probability alone decides. Off by default: the attention decoder
    # scores the text that joint CTC decoding writes on unheard sounds above -1 on most clips (the demo
    # model after non-speech training: 32-35 of 60 held-out clips with text at -1, against 0 by the
    # probability alone, at the same clean and music WER; docs/REPORT.md, "Sounds the model never heard").
    logprob_threshold: float | None = field(default=None, metadata={"metavar": "L", "help": (
        "Whisper's second condition for the no-speech check: a chunk is emptied only if the decoder's mean "
        "log-probability per token of its text (its EOS counted) is also at most L (Whisper's -1), so a "
        "confident text is kept whatever the no-speech probability (default: off, the probability alone "
        "decides: at -1 the demo model wrote text on 32-35 of 60 held-out non-speech clips that the "
        "probability alone empties)")})

    def __post_init__(self):
        """ValueError naming the first option out of its range."""
        if self.beam_size < 1 or (self.max_new_tokens is not None and self.max_new_tokens < 1):
            raise ValueError(f"beam size ({self.beam_size}) and max new tokens ({self.max_new_tokens}) must be >= 1")
        if not 0 <= self.ctc_weight <= 1:
            raise ValueError(f"CTC weight {self.ctc_weight} must lie in [0, 1]")
        if self.no_speech_threshold is not None and not 0 <= self.no_speech_threshold <= 1:
            raise ValueError(f"no-speech threshold {self.no_speech_threshold} must lie in [0, 1]")
        if self.lm_weight < 0:
            raise ValueError(f"LM weight {self.lm_weight} must be >= 0")
        if self.max_repeats < 0 or (self.max_tokens_per_second or 0) < 0:
            raise ValueError(f"max repeats ({self.max_repeats}) and max tokens per second "
                             f"({self.max_tokens_per_second}) must be >= 0")

    @property
    def fuses_lm(self) -> bool:
        return bool(self.lm) and self.lm_weight > 0

    def no_speech(self, no_speech_prob: float, avg_logprob: float) -> bool:
        """Whether a hypothesis is judged non-speech: its no-speech probability above no_speech_threshold,
        and (Whisper's rule, with a logprob_threshold) its mean log-probability at most that."""
        return (self.no_speech_threshold is not None and no_speech_prob > self.no_speech_threshold
                and (self.logprob_threshold is None or avg_logprob <= self.logprob_threshold))


@torch.inference_mode()
def search(model, memory, memory_lens, prompt, eos_id: int, options: DecodingOptions = DecodingOptions(),
           ctc_log_probs=None, with_logprobs: bool = False):
    """`decode_features` after the encoder: memory (B, T', D), memory_lens (B,) and the CTC head's log-probs
    (B, T', V + 1) or None, from model.encode_with_ctc. For callers that time or batch the encoder
    themselves (aed/decode_transcribe.py). Joint CTC/attention decoding runs as a beam search, of one beam
    for greedy decoding. Returns the generated ids per row; with_logprobs, also (B,) the attention
    decoder's log-probability of each returned hypothesis: the sum over its tokens, and its EOS where it
    ended with one (Whisper's sum_logprob; joint scores rank, the decoder's own ones are summed)."""
    if options.beam_size > 1 or (options.ctc_weight > 0 and ctc_log_probs is not None) or options.fuses_lm:
        return beam_search(model, memory, memory_lens, prompt, eos_id, options, ctc_log_probs, with_logprobs)
    return greedy_search(model, memory, memory_lens, prompt, eos_id, options, with_logprobs)


def _synced_time(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # so each phase's wall time is its own, not queued work
    return time.perf_counter()


def decode_features(model, feats, feat_lens, prompt, eos_id: int, options: DecodingOptions = DecodingOptions(),
                    amp=nullcontext(), decoder=None, with_ctc: bool = False):
    """The one path from a batch of features to hypotheses, for infer.py (aed.decode_transcribe's
    `decode_batch`), validation during training and the tests: feats (B, T, F), feat_lens (B,) and prompts (B, P) -> generated ids
    per row (joint CTC/attention when the model has a CTC head and options.ctc_weight > 0); with_ctc,
    the CTC head's log-probs (B, T', V) and valid lengths (B,) for alignment, else None; the seconds
    spent in the encoder and in the search (the device is synchronised between phases); and with
    options.no_speech_threshold, the no-speech check of every row (`NoSpeech`; the rows it judges
    non-speech come out empty), else None. amp: the autocast context both run in; decoder: the model
    the search steps (a `CompiledAED` of `model`), default `model`."""
    device = feats.device
    t0 = _synced_time(device)
    with amp:
        memory, memory_lens, ctc_log_probs = model.encode_with_ctc(feats, feat_lens)  # ..., (B, T', V+1) or None
    t1 = _synced_time(device)
    no_speech = None
    with amp:
        hyps, logprobs = search(decoder or model, memory, memory_lens, prompt, eos_id, options, ctc_log_probs,
                                with_logprobs=True)
        if options.no_speech_threshold is not None:
            probs = no_speech_probs(model, memory, memory_lens, prompt, eos_id).tolist()
            means = [lp / (len(ids) + 1) for lp, ids in zip(logprobs.tolist(), hyps)]
            emptied = [bool(ids) and options.no_speech(p, m) for ids, p, m in zip(hyps, probs, means)]
            hyps = [[] if e else ids for ids, e in zip(hyps, emptied)]
            no_speech = NoSpeech(probs, means, emptied)
    t2 = _synced_time(device)
    return hyps, (ctc_log_probs, memory_lens) if with_ctc else None, t1 - t0, t2 - t1, no_speech


class NoSpeech(NamedTuple):
    """The no-speech check of a batch's rows (`decode_features`), Whisper's two numbers and its verdict."""

    probs: list[float]  # no_speech_prob: P(EOS) right after the prompt (`no_speech_probs`)
    avg_logprobs: list[float]  # the hypothesis' log-probability (`search`) over its tokens + 1, as Whisper's
    emptied: list[bool]  # judged non-speech (`DecodingOptions.no_speech`) and its text dropped


@torch.inference_mode()
def no_speech_probs(model, memory, memory_lens, prompt, eos_id: int):
    """(B,) the decoder's probability of EOS right after the prompt: that the audio holds nothing to
    write. aed's non-speech examples train exactly that target (prompt then EOS), as Whisper's train
    <|nospeech|> there, whose probability is Whisper's no_speech_prob. One prompt step of its own."""
    cache = model.new_cache(memory, memory_lens, prompt.size(1))
    return model.decode_step(prompt, cache).float().softmax(dim=-1)[:, eos_id]


def token_budget(model, memory_lens, prompt_len: int, options: DecodingOptions):
    """(B,) new tokens each utterance may generate: encoder frames + max_delta, at most max_new_tokens and
    max_tokens_per_second of audio, and prompt + generated must fit the decoder's positions.

    Per utterance (not per batch), so an utterance decodes the same alone and inside a padded batch.
    """
    assert prompt_len < model.cfg.dec_max_len, f"prompt of {prompt_len} tokens leaves no room in {model.cfg.dec_max_len} positions"
    budget = memory_lens + options.max_delta
    if options.max_tokens_per_second:  # None or 0: no bound
        per_frame = options.max_tokens_per_second * options.frame_seconds
        budget = torch.minimum(budget, (memory_lens * per_frame).floor().long().clamp(min=1))
    limit = model.cfg.dec_max_len - prompt_len
    return budget.clamp(max=limit if options.max_new_tokens is None else min(limit, options.max_new_tokens))


def ends_in_repeats(tokens, length: int, max_repeats: int):
    """tokens (R, S) -> (R,) True where tokens[:, :length] ends with an n-gram (n <= REPEAT_NGRAM) repeated
    more than max_repeats times back to back. `length` is a Python int: no host sync."""
    looping = torch.zeros(tokens.size(0), dtype=torch.bool, device=tokens.device)
    for n in range(1, REPEAT_NGRAM + 1):
        span = n * (max_repeats + 1)
        if span > length:
            break
        tail = tokens[:, length - span : length]  # (R, span): periodic with period n iff it is the n-gram repeated
        looping |= (tail[:, n:] == tail[:, :-n]).all(dim=1)
    return looping


def _check_prompt(prompt, memory):
    assert prompt.dim() == 2 and prompt.size(0) == memory.size(0), (
        f"prompt must be (B, P) with B = {memory.size(0)} (one equal-length prompt per utterance), got {tuple(prompt.shape)}"
    )


def _strip(tokens, eos_id: int) -> list[list[int]]:
    """(R, S) ids, EOS-filled after each hypothesis ends -> lists cut at the first EOS (one host transfer)."""
    out = []
    for row in tokens.tolist():
        out.append(row[: row.index(eos_id)] if eos_id in row else row)
    return out


@torch.inference_mode()
def greedy_search(model, memory, memory_lens, prompt, eos_id: int, options: DecodingOptions = DecodingOptions(),
                  with_logprobs: bool = False):
    """Argmax decoding of the attention decoder for the whole batch at once; memory (B, T', D) from
    model.encode. Uses the options' length and repetition limits (beam size and CTC weight, with_logprobs:
    see `search`)."""
    _check_prompt(prompt, memory)
    b, p = prompt.shape
    limits = token_budget(model, memory_lens, p, options)  # (B,)
    steps = int(limits.max())  # the one sync before the loop
    cache = model.new_cache(memory, memory_lens, p + steps)
    logits = model.decode_step(prompt, cache)  # (B, V): the prompt in one chunk
    out = torch.full((b, steps), eos_id, dtype=torch.long, device=memory.device)
    finished = torch.zeros(b, dtype=torch.bool, device=memory.device)
    logprob = torch.zeros(b, device=memory.device)  # (B,) summed log-probs of each row's tokens, its EOS included
    for i in range(steps):
        token = logits.argmax(dim=-1).masked_fill(finished, eos_id)  # finished rows stay at EOS
        logprob += F.log_softmax(logits.float(), dim=-1).gather(1, token[:, None])[:, 0].masked_fill(finished, 0.0)
        out[:, i] = token
        finished |= (token == eos_id) | (i + 1 >= limits)
        if options.max_repeats:
            finished |= ends_in_repeats(out, i + 1, options.max_repeats)
        if i + 1 == steps or ((i + 1) % SYNC_EVERY == 0 and bool(finished.all())):
            break
        logits = model.decode_step(token[:, None], cache)
    hyps = _strip(out, eos_id)
    return (hyps, logprob) if with_logprobs else hyps


def length_penalty(lengths, alpha: float):
    """GNMT length normaliser ((5 + len) / 6)^alpha (Wu et al. 2016), as in NeMo's beam search."""
    return ((5.0 + lengths) / 6.0).pow(alpha)


def joint_candidates(logp, scorer: CTCPrefixScorer, eos_id: int, weight: float, n: int):
    """Attention log-probs (R, V) -> per row, its n best tokens other than EOS, then EOS: ids (R, n+1),
    joint step scores (1 - weight) log P_att(c) + weight (log psi(g + c) - log psi(g)), and the CTC
    prefix scores log psi(g + c) (for `scorer.select`). EOS is always a candidate, so CTC can end a
    hypothesis the attention decoder would continue."""
    att, cand = logp.index_fill(1, torch.tensor([eos_id], device=logp.device), NEG_INF).topk(n, dim=-1)  # (R, n)
    cand = torch.cat([cand, torch.full_like(cand[:, :1], eos_id)], dim=1)  # (R, n+1)
    att = torch.cat([att, logp[:, eos_id, None]], dim=1)
    psi = torch.cat([scorer.score(cand[:, :-1]), scorer.end_score()[:, None]], dim=1)  # (R, n+1) float64
    # A prefix CTC cannot produce stays impossible (and -inf - -inf would be NaN).
    gain = (psi - scorer.psi[:, None]).masked_fill(psi == NEG_INF, NEG_INF).to(att.dtype)
    return cand, (1 - weight) * att + weight * gain, psi


@torch.inference_mode()
def beam_search(model, memory, memory_lens, prompt, eos_id: int, options: DecodingOptions = DecodingOptions(beam_size=4),
                ctc_log_probs=None, with_logprobs: bool = False):
    """Beam search vectorised over R = B * K rows (K = beam_size); returns the best hypothesis per utterance
    (with_logprobs: and its attention log-probability, see `search`).

    Each step: one log-softmax, one topk over the K*W candidates of each utterance, one cache reorder.
    W is the vocabulary, or with CTC log-probs (B, T', V + 1) and options.ctc_weight > 0 the
    `ctc_candidates` best attention tokens plus EOS, ranked by joint scores. Finished hypotheses stay in
    the beam and may only extend with EOS, so they compete with live ones on the same (length-normalised)
    score. One the loop guard (`max_repeats`) stopped pays for EOS at its next step: otherwise a loop,
    whose repeated tokens grow ever more likely, would outrank every hypothesis that ends by saying EOS.
    Row b*K + j is beam j of utterance b.
    """
    _check_prompt(prompt, memory)
    (b, p), k = prompt.shape, options.beam_size
    device = memory.device
    limits = token_budget(model, memory_lens, p, options).repeat_interleave(k)  # (R,)
    steps = int(limits.max())
    # Every beam runs the prompt (K x a few tokens, against ~K x 40 steps after it), so the cache has
    # its final B * K rows from the start: a compiled decoder's buffers never change shape.
    cache = model.new_cache(memory, memory_lens, p + steps, rows_per_utterance=k)
    logp = F.log_softmax(model.decode_step(prompt.repeat_interleave(k, dim=0), cache), dim=-1)  # (R, V)
    v = logp.size(1)
    scorer = None
    if options.ctc_weight > 0 and ctc_log_probs is not None:
        assert ctc_log_probs.shape[:2] == memory.shape[:2] and ctc_log_probs.size(2) == v + 1, (
            f"CTC log-probs {tuple(ctc_log_probs.shape)} do not match memory {tuple(memory.shape)} and {v} tokens + blank"
        )
        scorer = CTCPrefixScorer(ctc_log_probs, memory_lens, rows_per_utterance=k)
    w = v if scorer is None else options.ctc_candidates + 1
    assert k <= w, f"beam_size {k} exceeds the {w} candidates per hypothesis"
    lm = None
    if options.fuses_lm:
        lm = decode_lm.load(options.lm)
        decode_lm.check_fits(lm, v, eos_id, options.lm)
        every_token = torch.arange(v, device=device).expand(b * k, v)  # the candidates without a CTC scorer

    # Only beam 0 is alive at first: otherwise the K identical starting beams would fill the beam with copies.
    scores = torch.full((b, k), float("-inf"), device=device)
    scores[:, 0] = 0.0
    scores = scores.flatten()  # (R,) summed (joint) log-probabilities
    lengths = torch.zeros(b * k, dtype=torch.long, device=device)  # generated tokens, EOS included
    finished = torch.zeros(b * k, dtype=torch.bool, device=device)
    unpaid = torch.zeros(b * k, dtype=torch.bool, device=device)  # stopped as a loop: pays for EOS next step
    logprob = torch.zeros(b * k, device=device)  # (R,) the attention decoder's log-probs of each row's tokens, summed
    eos_col = eos_id if scorer is None else w - 1
    eos_only = torch.full((w,), float("-inf"), device=device)
    eos_only[eos_col] = 0.0  # the one continuation of a finished hypothesis
    row0 = torch.arange(b, device=device)[:, None] * k  # (B, 1) first row of each utterance
    tokens = torch.full((b * k, steps), eos_id, dtype=torch.long, device=device)
    for i in range(steps):
        if scorer is None:
            cand, step = None, logp  # every token is a candidate: column = token id
        else:
            cand, step, psi = joint_candidates(logp, scorer, eos_id, options.ctc_weight, options.ctc_candidates)
        if lm is not None:
            step = step + options.lm_weight * lm.scores(tokens, i, every_token if cand is None else cand).to(step.dtype)
        eos_cost = torch.where(unpaid, step[:, eos_col], 0.0)  # (R,)
        step = torch.where(finished[:, None], eos_only + eos_cost[:, None], step)
        cand_scores = scores[:, None] + step  # (R, W)
        cand_len = lengths + (~finished).long()
        ranked = cand_scores / length_penalty(cand_len, options.length_penalty)[:, None].to(cand_scores.dtype)
        _, idx = ranked.view(b, k * w).topk(k, dim=-1)  # (B, K) among each utterance's K*W candidates
        origin = (row0 + idx // w).flatten()  # (R,) the row each survivor extends
        choice = (idx % w).flatten()  # (R,) its candidate column
        token = choice if cand is None else cand[origin, choice]
        scores = cand_scores.view(b, k * w).gather(1, idx).flatten()
        lengths = cand_len[origin]
        tokens[:, :i] = tokens[origin, :i]
        tokens[:, i] = token
        was_finished = finished[origin]
        logprob = logprob[origin] + logp[origin, token].masked_fill(was_finished, 0.0)
        finished = was_finished | (token == eos_id) | (lengths >= limits)
        if options.max_repeats:
            finished |= ends_in_repeats(tokens, i + 1, options.max_repeats)
        # Stopped here by the loop guard, with steps of its budget left (a row its budget stops pays nothing,
        # alone or in a batch whose longer utterances keep the loop going).
        unpaid = finished & ~was_finished & (token != eos_id) & (lengths < limits)
        if scorer is not None:
            scorer.select(origin, choice, psi[origin, choice], token)
        if i + 1 == steps or ((i + 1) % SYNC_EVERY == 0 and bool((finished & ~unpaid).all())):
            break
        if k > 1:  # with one beam every row extends itself
            cache.reorder(origin)
        logp = F.log_softmax(model.decode_step(token[:, None], cache), dim=-1)

    best = (scores / length_penalty(lengths, options.length_penalty).to(scores.dtype)).view(b, k).argmax(dim=-1) + row0[:, 0]
    hyps = _strip(tokens[best], eos_id)
    return (hyps, logprob[best]) if with_logprobs else hyps
