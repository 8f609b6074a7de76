"""Streaming recognition and translation: decode while the audio arrives.

    streamer = Streamer(loaded, StreamConfig(chunk=1.0, left=10.0, right=0.5, policy="alignatt"))
    stream = streamer.open(source_lang="en", target_lang="es")
    for piece in microphone():          # mono float samples at the model's rate, pieces of any size
        new = stream.feed(piece)        # the tokens committed after this piece (StreamToken: id, time)
        print(stream.text)
    stream.finish()                     # decodes what is left, to the end
    # a server: stream.push(piece) for each of many streams, then streamer.run(streams): one batch

The encoder is buffered, as NeMo streams Canary: the audio is cut into chunks of `chunk` seconds,
and a chunk is decoded once `right` seconds after it have arrived; the encoder then re-encodes
`left` seconds before the chunk, the chunk and the look-ahead. The FastConformer was trained on
whole utterances, and a bounded buffer keeps each step's cost constant however long the stream.
The decoder attends to the audio up to the chunk's end, never to the look-ahead (except in the
last chunk), so no token depends on audio it was not meant to hear yet. Every size is rounded to
whole encoder frames.

The decoder: the committed tokens are a prefix that is never rewritten. At each chunk the prefix
(prompt + the committed tokens whose audio is still in the buffer) is fed again against the new
encoder output, and greedy steps extend it while the policy allows:
  - waitk: after `waitk_lag` chunks, `waitk_tokens` tokens per chunk (Ma et al. 2019's wait-k).
  - alignatt: a token is committed while the cross-attention that predicted it (mean over the heads
    of layer `alignatt_layer`) peaks at least `alignatt_frames` seconds before the chunk's end
    (Papi et al. 2023, "AlignAtt"); a token looking at the newest audio waits for the next chunk.
Both stop at EOS (the decoder has heard all there is so far) and at the per-chunk cap of
max_tokens_per_second. The last chunk (`finish`) decodes to EOS with no policy: a stream whose
chunk is longer than its audio is offline greedy decoding, token for token.

Guards: a token that would make the hypothesis repeat an n-gram more than max_repeats times is
not committed; a stream whose decoder keeps predicting tokens that the policy holds back for
STALL_SECONDS of audio logs that it stalls (`Stream.stalls` counts them); the committed tokens
the decoder re-reads are cut to the newest that fit its positions.

Times: a token's `time` is the audio it waited for: the end of its chunk's look-ahead, in seconds
from the start of the stream (computation-unaware). `compute` is the processing time this stream
had waited for when the token was committed (SimulEval's computation-aware delay adds it).
Several streams decode as one batch (`Streamer.run`), each row at its own decoder position
(`aed.model_decoder.KVCache` with per-row lengths), and each gets the tokens it gets alone.
Decoding is greedy over the attention decoder: joint CTC scores and beams are offline only.
"""

import logging
import math
import time
from dataclasses import dataclass, field, replace

import torch

from aed.data_audio import AudioError, LogMel, load_audio
from aed.data_manifest import PROMPT_TASKS
from aed.decode_search import DecodingOptions, ends_in_repeats, token_budget
from aed.decode_timestamps import align, feasible, frame_seconds, to_words, word_spans
from aed.decode_transcribe import Result
from aed.model_decoder import KVCache

log = logging.getLogger(__name__)

POLICIES = ("alignatt", "waitk")
STALL_SECONDS = 4.0  # audio during which the decoder has more to say but nothing is committed


@dataclass(frozen=True)
class StreamConfig:
    """The buffer and the policy. Defaults: NeMo's recommended 10-1-0.5 s buffer (a theoretical
    latency of chunk + right = 1.5 s) and its AlignAtt threshold of 8 frames at 80 ms."""

    chunk: float = 1.0  # seconds of new audio decoded per step
    left: float = 10.0  # seconds before the chunk that are re-encoded with it (context only)
    right: float = 0.5  # look-ahead: seconds after the chunk that the encoder hears first
    policy: str = "alignatt"
    waitk_lag: int = 2  # wait-k: chunks heard before the first token
    waitk_tokens: int = 1  # wait-k: tokens committed per chunk after the lag
    alignatt_frames: float = 0.64  # alignatt: seconds before the chunk's end the attention peak must lie
    alignatt_layer: int | None = None  # alignatt: the decoder layer whose cross-attention is read;
    # None: the second-to-last (NeMo's -2), or the only one

    def __post_init__(self):
        """ValueError naming the first setting out of its range."""
        if self.chunk <= 0 or self.left < 0 or self.right < 0:
            raise ValueError(f"chunk ({self.chunk} s) must be > 0, left ({self.left} s) and right "
                             f"({self.right} s) context >= 0")
        if self.policy not in POLICIES:
            raise ValueError(f"unknown streaming policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        if self.waitk_lag < 1 or self.waitk_tokens < 1 or self.alignatt_frames < 0:
            raise ValueError(f"wait-k lag ({self.waitk_lag}) and tokens ({self.waitk_tokens}) must be >= 1, "
                             f"the AlignAtt threshold ({self.alignatt_frames} s) >= 0")


@dataclass(frozen=True)
class StreamToken:
    id: int
    time: float  # seconds of audio received when it was committed (computation-unaware)
    compute: float  # seconds of processing the stream had waited for by then


@dataclass
class Stream:
    """One stream's audio and committed tokens; made by `Streamer.open`."""

    streamer: "Streamer"
    prompt: list[int]
    audio: torch.Tensor = field(default_factory=lambda: torch.zeros(0))  # (S,) samples from `kept_from` on
    kept_from: int = 0  # stream sample index of audio[0]
    received: int = 0  # samples received
    chunks: int = 0  # chunks decoded
    tokens: list[StreamToken] = field(default_factory=list)
    compute: float = 0.0  # seconds of processing so far
    chunk_compute: list[float] = field(default_factory=list)  # seconds per decoded chunk (its batch's)
    finished: bool = False
    stalls: int = 0  # times the stream stalled (see STALL_SECONDS)
    holding: float | None = None  # stream time since which the policy holds back tokens, None: it does not

    def push(self, samples, sample_rate: int | None = None) -> None:
        """Append mono samples at the model's rate: a 1-D array or tensor of floats in [-1, 1]."""
        if self.finished:
            raise ValueError("this stream is finished; open a new one")
        piece = self.streamer.check_samples(samples, sample_rate)
        self.audio = torch.cat([self.audio, piece])
        self.received += piece.numel()

    def feed(self, samples, sample_rate: int | None = None) -> list[StreamToken]:
        """`push`, then decode every chunk that is ready: the tokens committed by this piece."""
        self.push(samples, sample_rate)
        return self.streamer.run([self])[0]

    def finish(self) -> list[StreamToken]:
        """Decode the rest of the audio to the end (EOS); the stream takes no more audio."""
        return self.streamer.run([self], final=True)[0] if not self.finished else []

    @property
    def ids(self) -> list[int]:
        return [t.id for t in self.tokens]

    @property
    def text(self) -> str:
        return self.streamer.tokenizer.decode_hypothesis(self.ids)

    def words(self) -> list[tuple[str, float, float]]:
        """(text, time, compute) per committed word: those of its last token, when it was complete."""
        ids, out = self.ids, []
        for a, b in word_spans(self.streamer.tokenizer, ids):
            text = self.streamer.tokenizer.decode_hypothesis(ids[a:b]).strip()
            if text:
                out.append((text, self.tokens[b - 1].time, self.tokens[b - 1].compute))
        return out


class Streamer:
    """The model, its features and the streaming settings; opens streams and decodes them in batches."""

    def __init__(self, loaded, config: StreamConfig = StreamConfig(), options: DecodingOptions = DecodingOptions()):
        """loaded: an `aed.decode_transcribe.LoadedModel`. options: the limits of the search
        (max_repeats, max_tokens_per_second, max_delta, max_new_tokens); greedy only."""
        if options.beam_size != 1:
            raise ValueError("streaming decodes greedily (each token is committed as it is chosen): beam size must be 1")
        self.loaded, self.config, self.model, self.tokenizer = loaded, config, loaded.model, loaded.tokenizer
        self.rate = loaded.features.sample_rate
        self.frame_s = frame_seconds(loaded.features, self.model.cfg.subsampling_factor)
        self.options = replace(options, frame_seconds=self.frame_s)
        self.frame = frame = loaded.features.hop_length * self.model.cfg.subsampling_factor  # samples per encoder frame
        self.chunk = max(1, round(config.chunk / self.frame_s)) * frame  # sizes in samples, whole frames
        self.left = round(config.left / self.frame_s) * frame
        self.right = round(config.right / self.frame_s) * frame
        self.alignatt_frames = round(config.alignatt_frames / self.frame_s)
        self.logmel = LogMel(loaded.features).to(loaded.device).eval()
        n_layers = len(self.model.decoder.layers)
        self.alignatt_layer = max(0, n_layers - 2) if config.alignatt_layer is None else config.alignatt_layer
        if not -n_layers <= self.alignatt_layer < n_layers:
            raise ValueError(f"alignatt layer {config.alignatt_layer} outside the decoder's {n_layers} layers")

    def open(self, source_lang: str = "en", target_lang: str | None = None, pnc: bool = True,
             task: str | None = None) -> Stream:
        """A new stream with its Canary prompt (translation when target_lang differs)."""
        target_lang = target_lang or source_lang
        prompt = self.tokenizer.prompt_ids(source_lang, target_lang, pnc, task)
        return Stream(self, prompt)

    def check_samples(self, samples, sample_rate: int | None = None) -> torch.Tensor:
        """A piece of audio -> (S,) float32; a clear ValueError for what a stream cannot take."""
        if sample_rate is not None and sample_rate != self.rate:
            raise ValueError(f"the model takes {self.rate} Hz audio, got {sample_rate} Hz: resample the stream "
                             f"first (e.g. torchaudio.functional.resample, or arecord -r {self.rate})")
        x = torch.as_tensor(samples)
        if x.dim() != 1:
            raise ValueError(f"a stream takes mono audio, a 1-D array of samples; got shape {tuple(x.shape)} "
                             f"(average the channels first)")
        if not x.is_floating_point():
            raise ValueError(f"a stream takes float samples in [-1, 1] at {self.rate} Hz; got {x.dtype} "
                             f"(divide 16-bit PCM by 32768)")
        return x.float().cpu()

    # --- one decoding step of many streams --------------------------------------------------

    def ready(self, stream: Stream) -> bool:
        """Whether `stream` has a chunk to decode now: the chunk and its look-ahead have arrived."""
        return not stream.finished and stream.received >= (stream.chunks + 1) * self.chunk + self.right

    def run(self, streams: list[Stream], final: bool = False) -> list[list[StreamToken]]:
        """Decode every ready chunk of `streams`, one batch per round; final: then their last chunks.
        Returns the tokens each stream committed."""
        committed = [[] for _ in streams]
        while True:
            batch = [i for i, s in enumerate(streams) if self.ready(s)]
            if not batch:
                break
            for i, new in zip(batch, self.step([streams[i] for i in batch], final=False)):
                committed[i] += new
        if final:
            batch = [i for i, s in enumerate(streams) if not s.finished]
            if batch:
                for i, new in zip(batch, self.step([streams[i] for i in batch], final=True)):
                    committed[i] += new
        return committed

    @torch.inference_mode()
    def step(self, streams: list[Stream], final: bool) -> list[list[StreamToken]]:
        """One chunk of each stream (their next one, or with final the rest of their audio), as one batch."""
        t0 = time.perf_counter()
        device = self.loaded.device
        spans = [self.window(s, final) for s in streams]  # (start, chunk end, end) in stream samples
        live = [i for i, (start, _, end) in enumerate(spans) if end - start >= self.frame]  # less: nothing to decode
        new = [[] for _ in streams]
        if live:
            wavs = [streams[i].audio[spans[i][0] - streams[i].kept_from: spans[i][2] - streams[i].kept_from]
                    for i in live]
            lens = torch.tensor([w.numel() for w in wavs])
            wav = torch.zeros(len(wavs), int(lens.max()))  # (B, S) zero padded
            for b, w in enumerate(wavs):
                wav[b, : w.numel()] = w
            feats, feat_lens = self.logmel(wav.to(device), lens.to(device))
            memory, memory_lens = self.model.encode(feats, feat_lens)  # (B, T', D), (B,)
            # The decoder attends up to the chunk's end: the look-ahead frames are heard by the encoder only.
            heard = torch.tensor([(spans[i][1] - spans[i][0]) // self.frame for i in live], device=device)
            attend = memory_lens if final else torch.minimum(memory_lens, heard.clamp(min=1))
            for b, tokens in zip(live, self.decode_chunk([streams[i] for i in live], [spans[i] for i in live],
                                                          memory, attend, final)):
                new[b] = tokens
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the time of the work, not of queueing it
        elapsed = time.perf_counter() - t0  # each stream of the batch waited for all of it
        committed = []
        for s, (start, chunk_end, end), ids in zip(streams, spans, new):
            s.compute += elapsed
            s.chunk_compute.append(elapsed)
            committed.append([StreamToken(t, end / self.rate, s.compute) for t in ids])
            s.tokens += committed[-1]
            s.chunks += 1
            s.finished = final
            keep = max(0, chunk_end - self.left) - s.kept_from  # the next window starts at or after it
            s.audio, s.kept_from = s.audio[keep:], s.kept_from + keep
        return committed

    def window(self, s: Stream, final: bool) -> tuple[int, int, int]:
        """Stream samples of the buffer to encode: start, the chunk's end, end (past it: the look-ahead)."""
        chunk_end = s.received if final else (s.chunks + 1) * self.chunk
        start = max(0, min(s.chunks * self.chunk, chunk_end) - self.left)
        end = s.received if final else chunk_end + self.right
        return start, chunk_end, end

    def context(self, s: Stream, start: int) -> list[int]:
        """The committed tokens the decoder re-reads: those committed after the buffer's start (the
        audio of older ones has left it), cut to the newest that fit the decoder's positions."""
        since = next((i for i, t in enumerate(s.tokens) if round(t.time * self.rate) > start), len(s.tokens))
        room = self.model.cfg.dec_max_len - len(s.prompt) - self.chunk_cap()
        return [t.id for t in s.tokens[since:]][-room:] if room > 0 else []

    def chunk_cap(self) -> int:
        """Most tokens a chunk before the last may commit: max_tokens_per_second of its audio, at
        least one (without that bound: max_delta, offline decoding's allowance past the frames)."""
        per_second = self.options.max_tokens_per_second
        return max(1, math.floor(per_second * self.chunk / self.rate)) if per_second else self.options.max_delta

    def decode_chunk(self, streams, spans, memory, attend, final: bool) -> list[list[int]]:
        """Greedy steps under the policy for each row (a stream), from its prefix; memory (B, T', D),
        attend (B,) frames each row's decoder may attend to. Returns the ids each row commits."""
        b, device, eos = len(streams), memory.device, self.tokenizer.eos
        contexts = [self.context(s, start) for s, (start, _, _) in zip(streams, spans)]
        prefixes = [s.prompt + c for s, c in zip(streams, contexts)]
        prefix_lens = torch.tensor([len(p) for p in prefixes], device=device)
        if final:  # the rest of the stream: offline decoding's budget for this buffer, less what it re-reads
            budget = [max(1, int(token_budget(self.model, attend[r: r + 1], len(p), self.options)[0]) - len(c))
                      for r, (p, c) in enumerate(zip(prefixes, contexts))]
        else:
            budget = [self.chunk_cap()] * b
        steps = max(budget)
        cache = self.new_cache(memory, attend, max(len(p) + n for p, n in zip(prefixes, budget)))
        padded = torch.full((b, int(prefix_lens.max())), eos, dtype=torch.long, device=device)
        for r, p in enumerate(prefixes):
            padded[r, : len(p)] = torch.tensor(p)
        with CrossAttention(self.model, self.alignatt_layer) as attention:
            hidden = self.model.decoder.forward_cached(padded, cache)  # (B, P, D)
            # Each row goes on from its own prefix: positions past it hold padding, overwritten next.
            cache.length.copy_(prefix_lens)
            last = prefix_lens - 1
            logits = self.model.decoder.output_proj(hidden[torch.arange(b, device=device), last]).float()  # (B, V)
            peaks = attention.peaks(last, attend)  # (B,) frame each row's last query attends most
            out = [[] for _ in streams]
            hyps = [list(c) for c in contexts]  # what the repetition guard reads, as offline: no prompt
            active = [True] * b
            for _ in range(steps):
                tokens = logits.argmax(dim=-1).tolist()
                for r, s in enumerate(streams):
                    if active[r]:
                        active[r] = self.commit(s, hyps[r], out[r], tokens[r], int(peaks[r]), int(attend[r]),
                                                spans[r], budget[r], final)
                if not any(active):
                    break
                feed = torch.tensor([[t] for t in tokens], device=device)  # inactive rows' tokens are never read
                logits = self.model.decode_step(feed, cache)
                peaks = attention.peaks(torch.zeros(b, dtype=torch.long, device=device), attend)
        return out

    def commit(self, s: Stream, hyp: list[int], out: list[int], token: int, peak: int, attend: int, span,
               budget: int, final: bool) -> bool:
        """The policy's decision on row `s`'s next token: commit it (append to hyp and out) or not.
        True while the row may take another token in this chunk."""
        cfg, eos = self.config, self.tokenizer.eos
        if token == eos:
            s.holding = None
            return False
        repeats = self.options.max_repeats and bool(
            ends_in_repeats(torch.tensor([hyp + [token]]), len(hyp) + 1, self.options.max_repeats))
        if repeats and not final:  # never committed while more audio may change the decoder's mind
            self.hold(s, span[1])
            return False
        if not final:
            if cfg.policy == "waitk":
                allowed = s.chunks + 1 >= cfg.waitk_lag and len(out) < cfg.waitk_tokens
            else:
                allowed = attend - (peak + 1) >= self.alignatt_frames
            if not allowed:
                self.hold(s, span[1])
                return False
        hyp.append(token)
        out.append(token)
        s.holding = None
        return len(out) < budget and not repeats  # the last chunk stops after it, as offline search does

    def hold(self, s: Stream, now: int) -> None:
        """The policy held back a token at stream sample `now`: log once when that has lasted STALL_SECONDS."""
        if s.holding is None:
            s.holding = now / self.rate
        elif now / self.rate - s.holding >= STALL_SECONDS:
            s.stalls += 1
            log.warning("stream stalls: the decoder has had more to say for %.1f s of audio (%.1f-%.1f s) and "
                        "the %s policy committed nothing", now / self.rate - s.holding, s.holding, now / self.rate,
                        self.config.policy)
            s.holding = math.inf  # said once per stall; the next commit resets it

    def new_cache(self, memory, attend, max_len: int) -> KVCache:
        """An empty decoder cache whose rows each keep their own position (per-row lengths)."""
        c = self.model.new_cache(memory, attend, max_len)
        return KVCache(c.keys, c.values, c.cross_kv, c.memory_mask,
                       torch.zeros(memory.size(0), dtype=torch.long, device=memory.device))


class CrossAttention:
    """Captures one decoder layer's cross-attention weights while active (a forward hook on its
    attention module: scaled dot-product attention returns no weights, so the query's scores are
    recomputed from the same inputs), for AlignAtt."""

    def __init__(self, model, layer: int):
        self.module = model.decoder.layers[layer].cross_attn
        self.weights = None  # (R, U, T') mean over heads of the last forward's attention probabilities

    def __enter__(self):
        self.handle = self.module.register_forward_hook(self.capture, with_kwargs=True)
        return self

    def __exit__(self, *exc):
        self.handle.remove()

    def capture(self, module, args, kwargs, output):
        x, k, _ = args[:3]
        mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)  # (R, 1, 1, T') True = valid
        q = module._heads(module.query_net(x))  # (R, H, U, d_k)
        scores = q @ k.transpose(-1, -2) / math.sqrt(module.d_k)  # (R, H, U, T')
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        self.weights = scores.softmax(dim=-1).mean(dim=1)  # (R, U, T')

    def peaks(self, query, attend):
        """(R,) the frame each row's query position `query` (R,) attends most, among its `attend` frames."""
        rows = torch.arange(query.numel(), device=query.device)
        w = self.weights[rows, query]  # (R, T')
        valid = torch.arange(w.size(1), device=w.device) < attend[:, None]
        return w.masked_fill(~valid, -1.0).argmax(dim=-1)


# --- files as streams (infer.py --stream) -----------------------------------------------------


def stream_requests(streamer: Streamer, requests: list, batch: int = 16, realtime: bool = False,
                    show=None) -> list[tuple]:
    """Decode `requests` (aed.decode_transcribe.Request) as streams, `batch` at a time as one batch of
    streams, their audio fed a chunk per round as it would arrive (realtime: no faster than that);
    show(pairs) is called after every round with the batch's (Result, Stream) pairs. Returns
    (Result, Stream, `stream_latency`) per request; Stream and latency are None where it failed."""
    out = []
    for first in range(0, len(requests), batch):
        group = [(Result(r), None, None) for r in requests[first: first + batch]]
        for k, (res, _, _) in enumerate(group):
            r = res.request
            try:
                wav = load_audio(r.audio_filepath, r.offset, r.duration, streamer.rate)
                group[k] = (res, streamer.open(r.source_lang, r.target_lang, r.pnc, PROMPT_TASKS[r.taskname]), wav)
            except (AudioError, ValueError) as e:
                res.error = e.reason if isinstance(e, AudioError) else str(e)
        live = [(s, wav) for _, s, wav in group if s is not None]
        start, fed = time.perf_counter(), 0
        while live:
            for s, wav in live:
                s.push(wav[fed: fed + streamer.chunk])
            fed += streamer.chunk
            ending = [s for s, wav in live if fed >= wav.numel()]
            live = [(s, wav) for s, wav in live if fed < wav.numel()]
            streamer.run([s for s, _ in live])
            streamer.run(ending, final=True)
            if show:
                show([(res, s) for res, s, _ in group if s is not None])
            if realtime:
                time.sleep(max(0.0, start + fed / streamer.rate - time.perf_counter()))
        for res, s, wav in group:
            latency = None
            if s is not None:
                res.pred_text, res.tokens = s.text, s.ids
                res.duration, res.decode_time = wav.numel() / streamer.rate, s.compute
                latency = stream_latency(s, res.duration, res.request.text, wav)
            out.append((res, s, latency))
    return out


# --- latency, as simultaneous speech translation measures it ----------------------------------


def average_lagging(delays: list[float], source: float, reference_len: int | None = None,
                    length_adaptive: bool = True) -> float:
    """SimulEval's AL (STACL, Ma et al. 2019) and LAAL (Papi et al. 2022) of one output: delays[i] of
    its i-th word and `source` in the same unit (ms of audio):

        AL = 1/tau sum_{i=1..tau} (d_i - (i-1) |X| / |Y|),  tau = the first i with d_i >= |X|

    |Y| is the reference's word count (the output's where there is none); LAAL uses
    max(|Y|, output words), so output longer than the reference cannot lower its latency.
    An output whose first word comes after the source ends gets that delay; an empty one, nan."""
    if not delays:
        return math.nan
    if delays[0] > source:
        return delays[0]
    words = reference_len or len(delays)
    rate = (max(words, len(delays)) if length_adaptive else words) / source  # words per unit of source
    total = 0.0
    for i, d in enumerate(delays):
        total += d - i / rate
        if d >= source:
            return total / (i + 1)
    return total / len(delays)


@torch.inference_mode()
def spoken_ends(stream: Stream, wav: torch.Tensor) -> list[float] | None:
    """When each committed word was spoken: the end of its span in the CTC head's forced alignment of
    the stream's text to the whole audio `wav` (S,) (aed/decode_timestamps.py), in seconds; None
    without a CTC head, or where no CTC path through the audio fits the text."""
    streamer, model = stream.streamer, stream.streamer.model
    ids = streamer.tokenizer.text_ids(stream.ids)
    if model.ctc is None or not ids or wav.numel() < streamer.frame:
        return None
    feats, lens = streamer.logmel(wav[None].to(streamer.loaded.device), torch.tensor([wav.numel()]))
    _, enc_lens, log_probs = model.encode_with_ctc(feats, lens)
    frames = log_probs[0, : int(enc_lens[0])].cpu()
    if not feasible(frames.size(0), ids):
        return None
    words = to_words(streamer.tokenizer, ids, align(frames, ids, model.ctc.blank), streamer.frame_s)
    return [w.end for w in words] if len(words) == len(stream.words()) else None


def stream_latency(stream: Stream, seconds: float, reference: str | None = None,
                   wav: torch.Tensor | None = None) -> dict:
    """A finished stream's latency in ms of audio: AL and LAAL over its words (each word timed by its
    last token), computation-unaware and -aware (`_ca`: SimulEval's, the processing time the
    stream had waited for added); the first word's delay; with the stream's audio `wav` and a CTC
    head, `spoken_lag`: the mean time from the end of each word in the audio (`spoken_ends`) to its
    commit; and the real-time factor of its chunks (processing seconds per second of chunk audio:
    mean and max, the last chunk excluded)."""
    words = stream.words()
    ref_len = len(reference.split()) if reference else None
    source = seconds * 1000
    unaware = [t * 1000 for _, t, _ in words]
    aware = [(t + c) * 1000 for _, t, c in words]
    chunk_s = stream.streamer.chunk / stream.streamer.rate
    rtf = [c / chunk_s for c in stream.chunk_compute[:-1]]
    ends = spoken_ends(stream, wav) if wav is not None else None
    lag = sum(t - end for (_, t, _), end in zip(words, ends)) / len(ends) * 1000 if ends else math.nan
    return {"al": average_lagging(unaware, source, ref_len, False), "laal": average_lagging(unaware, source, ref_len),
            "al_ca": average_lagging(aware, source, ref_len, False), "laal_ca": average_lagging(aware, source, ref_len),
            "first_word": unaware[0] if unaware else math.nan, "spoken_lag": lag,
            "rtf_mean": sum(rtf) / len(rtf) if rtf else math.nan, "rtf_max": max(rtf, default=math.nan)}
