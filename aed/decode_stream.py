"""Streaming recognition and translation: decode while the audio arrives.

    streamer = Streamer(loaded, StreamConfig(chunk=1.0, left=10.0, right=0.5, policy="alignatt"))
    stream = streamer.open(source_lang="en", target_lang="es")
    for piece in microphone():          # mono float samples at the model's rate, pieces of any size
        new = stream.feed(piece)        # the tokens committed after this piece (StreamToken: id, time)
        print(stream.text)
    stream.finish()                     # decodes what is left, to the end
    # a server: stream.push(piece) for each of many streams, then streamer.run(streams): one batch

The encoder is buffered, as NeMo streams Canary: the audio is cut into chunks of `chunk` seconds,
and a chunk is decoded once `right` seconds after it have arrived; the encoder then re-encodes the
current sentence (at most `left` seconds of it before the chunk), the chunk and the look-ahead. The
decoder attends to the audio up to the chunk's end, never to the look-ahead (except where a sentence
ends), so no token depends on audio it was not meant to hear yet. Every size is rounded to whole
encoder frames. `left` defaults to 10 s, less where the model was trained on shorter utterances:
the encoder never hears a longer window than it was trained on.

Sentences: a stream is a sequence of sentences, each decoded from a fresh prompt, so an hour of
captions is bounded in memory and compute, and no audio leaves the window untranscribed. Speech and
pauses are told apart as offline (`aed.data_speech`): by default by energy above the noise floor
around each frame, the floor looked for in the sentence's audio and FLOOR_SECONDS before it; with
`vad="silero"` by Silero VAD, scored as the audio arrives. A sentence starts as much silence before
its speech as the model's training utterances held; it ends
  - at the first pause of `endpoint` seconds after speech (the look-ahead counts: a pause heard is
    a pause), cut as much silence after its speech as the training utterances held; or
  - where it would outgrow the window (left + chunk) or, ended at its pause, run longer than the
    longest training utterance: at the longest gap in its speech (as offline segmentation splits a
    stretch too long for the model) that lies after its committed tokens' attention peaks, else, a
    full window, at its quietest 100 ms (`window_cuts` counts the full windows).
Either way the sentence's audio is decoded to EOS without the policy: what the policy held back is
committed now. Audio with no speech is passed over, never decoded (no text from silence).

Within a sentence, the committed tokens are a prefix that is never rewritten (but for the no-speech
check, below, which may withdraw a whole sentence). At each chunk the
prefix (prompt + the sentence's committed tokens) is fed again against the new encoder output, and
greedy steps extend it while the commit policy allows (`aed.decode_policy`: wait-k or AlignAtt, and
its stall guard; each stream's `Stream.policy` state). Each step reads where the cross-attention
that predicted its token peaks (mean over the heads of layer `alignatt_layer`: `CrossAttention`):
AlignAtt judges the token by it, and no sentence is cut before its committed tokens' peaks. The
first SINK_SECONDS of the window are not taken as a peak: a decoder with nothing to say looks there
(NeMo excludes the same 8 frames).
The steps stop at EOS (the decoder has heard all there is so far) and at the per-chunk cap of
max_tokens_per_second. The stream's end (`finish`) ends its last sentences: a stream with
`endpoint=0` whose chunk is longer than its audio is offline greedy decoding, token for token.

Guards: a token that would make the hypothesis repeat an n-gram more than max_repeats times is
not committed (it is held as the policy holds, so a decoder stuck on it is said to stall); the
sentence's committed tokens the decoder re-reads are cut to the newest that fit its positions.

The no-speech check (options.no_speech_threshold, on by default as offline): where a sentence ends,
it is judged as offline decoding judges a chunk: P(EOS) right after the prompt above the threshold
(and with options.logprob_threshold, Whisper's second condition: the attention decoder's mean
log-probability of the sentence at most that), read against the whole sentence's audio. A sentence judged
non-speech is emptied: the tokens it committed while it was heard are withdrawn from `Stream.tokens`
(a caption redraws from `text`), and it is counted with its seconds (`Stream.skipped_sentences`).

Times: a token's `time` is the audio it waited for: the end of its chunk's look-ahead (all that
was heard when its sentence ended), in seconds from the start of the stream (computation-unaware).
`compute` is the processing time this stream had waited for when the token was committed
(SimulEval's computation-aware delay adds it).
Several streams decode as one batch (`Streamer.run`), each row at its own decoder position
(`aed.model_decoder.KVCache` with per-row lengths), and each gets the tokens it gets alone.
Decoding is greedy, and joint with the CTC head as offline (a model with a head, options.ctc_weight >
0, the default): each token is the best of (1 - w) log P_att + w log P_ctc among the attention
decoder's `ctc_candidates` and EOS, the CTC prefix scored over the sentence's window. The window
starts where the sentence does, so every committed token the decoder re-reads is in its audio, and
a token is chosen on the audio heard so far, as the policy then judges it. Beams are offline only.
"""

import math
import time
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch
import torch.nn.functional as F

from aed.data_audio import AudioError, LogMel, load_audio
from aed.data_manifest import PROMPT_TASKS
from aed.data_speech import DETECTORS, FLOOR_SECONDS, FRAME, EnergyDetector, runs, speech_detector
from aed.decode_metrics import stream_latency
from aed.decode_policy import POLICIES, CommitPolicy, PolicyState
from aed.decode_search import CTCPrefixScorer, DecodingOptions, ends_in_repeats, joint_candidates, token_budget
from aed.decode_timing import PAUSE, frame_seconds, longest_segment, quietest, segment_edges, word_spans
from aed.decode_transcribe import Result
from aed.model_decoder import KVCache

DEFAULT_LEFT = 10.0  # seconds of left context, NeMo's recommended 10-1-0.5 s buffer
SINK_SECONDS = 0.64  # the first frames of a window AlignAtt does not take as a peak (NeMo's 8 frames)


@dataclass(frozen=True)
class StreamConfig:
    """The buffer and the policy. Defaults: NeMo's recommended 10-1-0.5 s buffer (a theoretical
    latency of chunk + right = 1.5 s); an AlignAtt threshold that adapts to the model (aed.decode_policy)."""

    chunk: float = 1.0  # seconds of new audio decoded per step
    left: float | None = None  # most seconds of the current sentence before the chunk that are re-encoded
    # with it; None: 10 s, less what the longest training utterance leaves after chunk and look-ahead
    right: float = 0.5  # look-ahead: seconds after the chunk that the encoder hears first
    endpoint: float = PAUSE  # a pause this long (s) after speech ends the sentence; 0: pauses are not looked
    # for (no sentence ends at one, silence is decoded as it comes): only a full window ends a sentence
    policy: str = "alignatt"  # aed.decode_policy.POLICIES
    waitk_lag: int = 2  # wait-k: chunks heard before the first token
    waitk_tokens: int = 1  # wait-k: tokens committed per chunk after the lag
    alignatt_threshold: float | None = None  # alignatt: seconds before the chunk's end the attention peak
    # must lie; None: the 90th percentile of the spacing of the stream's recent peaks, 0.16-0.64 s
    alignatt_layer: int | None = None  # alignatt: the decoder layer whose cross-attention is read;
    # None: the second-to-last (NeMo's -2), or the only one
    vad: str = "energy"  # the speech detector that finds the pauses (aed.data_speech.DETECTORS)

    def __post_init__(self):
        """ValueError naming the first setting out of its range."""
        if self.chunk <= 0 or (self.left is not None and self.left < 0) or self.right < 0 or self.endpoint < 0:
            raise ValueError(f"chunk ({self.chunk} s) must be > 0, left ({self.left} s) and right "
                             f"({self.right} s) context and the endpoint pause ({self.endpoint} s) >= 0")
        if self.policy not in POLICIES:
            raise ValueError(f"unknown streaming policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        if self.vad not in DETECTORS:
            raise ValueError(f"unknown speech detector {self.vad!r}; choose one of {', '.join(DETECTORS)}")
        if self.waitk_lag < 1 or self.waitk_tokens < 1 or (self.alignatt_threshold or 0) < 0:
            raise ValueError(f"wait-k lag ({self.waitk_lag}) and tokens ({self.waitk_tokens}) must be >= 1, "
                             f"the AlignAtt threshold ({self.alignatt_threshold} s) >= 0")


class Window(NamedTuple):
    """What a stream decodes in one step, in stream samples: audio [start, end), the decoder attending
    up to chunk_end; heard: the audio received that the step's decisions used."""

    start: int
    chunk_end: int
    end: int
    heard: int
    closing: bool = False  # the sentence ends at chunk_end: decoded to EOS, no policy; the next starts there
    full: bool = False  # ... because the window was full, not at a pause
    skip: bool = False  # no speech in it: nothing decoded, the sentence starts at chunk_end
    last: bool = False  # the stream's last step


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
    kept_from: int = 0  # stream sample index of audio[0]: the start of the current sentence
    received: int = 0  # samples received
    chunks: int = 0  # chunks decoded
    sentence_tokens: int = 0  # index in `tokens` of the current sentence's first token
    partial: list[int] = field(default_factory=list)  # with `Streamer(partials=True)`: what the decoder
    # predicts after the committed tokens, held back by the policy (shown, never final)
    sentences: int = 0  # sentences ended (at a pause, or where the window was full)
    window_cuts: int = 0  # ... of them ended because the window was full, not at a pause
    detector: EnergyDetector | None = None  # scores the audio as it arrives (`Streamer.open` makes it)
    levels: torch.Tensor = field(default_factory=lambda: torch.zeros(0))  # (frames,) the detector's scores
    # (energies in dB by default) of the 10 ms frames received, the last one the newest it scored (see
    # `push` for how far back)
    scored: int = 0  # frames scored so far: levels[-1] is frame scored - 1
    tokens: list[StreamToken] = field(default_factory=list)
    compute: float = 0.0  # seconds of processing so far
    chunk_compute: list[float] = field(default_factory=list)  # seconds per decoded chunk (its batch's)
    finished: bool = False
    policy: PolicyState = field(default_factory=PolicyState)  # its commit policy's: stalls, attention peaks
    sentence_seconds: float = 0.0  # audio inside ended sentences; the rest was passed over as silence
    # With options.no_speech_threshold: the lowest no-speech probability of its sentences, and those the
    # check emptied at their end (their committed tokens withdrawn from `tokens`), with their seconds.
    no_speech_prob: float | None = None
    skipped_sentences: int = 0
    skipped_seconds: float = 0.0

    def push(self, samples, sample_rate: int | None = None) -> None:
        """Append mono samples at the model's rate: a 1-D array or tensor of floats in [-1, 1]."""
        if self.finished:
            raise ValueError("this stream is finished; open a new one")
        piece = self.streamer.check_samples(samples, sample_rate)
        hop, streamer = round(self.streamer.rate * FRAME), self.streamer
        self.audio = torch.cat([self.audio, piece])
        self.received += piece.numel()
        new = self.detector.scores(piece)
        levels, self.scored = torch.cat([self.levels, new]), self.scored + new.numel()  # (frames,)
        # Kept: the sentence's frames, and FLOOR_SECONDS before any audio a later step hears.
        first = max(0, min(self.kept_from, self.chunks * streamer.chunk) // hop - round(FLOOR_SECONDS / FRAME))
        self.levels = levels[max(0, first - (self.scored - levels.numel())):]

    def feed(self, samples, sample_rate: int | None = None) -> list[StreamToken]:
        """`push`, then decode every chunk that is ready: the tokens committed by this piece (the no-speech
        check may withdraw them when their sentence ends: `tokens` is the text so far)."""
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

    def sentence_text(self, first: int = 0, last: int | None = None, partial: bool = False) -> str:
        """The text of the committed tokens [first, last) (default: to the newest), and with `partial`
        the uncommitted continuation after them."""
        ids = self.ids[first:last] + (self.partial if partial else [])
        return self.streamer.tokenizer.decode_hypothesis(ids)

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

    def __init__(self, loaded, config: StreamConfig = StreamConfig(), options: DecodingOptions = DecodingOptions(),
                 partials: bool = False):
        """loaded: an `aed.model_checkpoint.LoadedModel`. options: the search, greedy only: its CTC
        weight and limits (max_repeats, max_tokens_per_second, max_delta, max_new_tokens). partials: go on
        decoding what the policy holds back, up to the chunk's cap of tokens, into `Stream.partial`
        (for a caption's grey tail: more decoder steps, the same committed tokens)."""
        if options.beam_size != 1:
            raise ValueError("streaming decodes greedily (each token is committed as it is chosen): beam size must be 1")
        if options.fuses_lm:
            raise ValueError("streaming does not fuse a language model (--lm): decode offline to use one")
        self.loaded, self.config, self.model, self.tokenizer = loaded, config, loaded.model, loaded.tokenizer
        self.partials = partials
        self.joint = options.ctc_weight > 0 and self.model.ctc is not None  # joint CTC/attention scores
        self.rate = loaded.features.sample_rate
        self.frame_s = frame_seconds(loaded.features, self.model.cfg.subsampling_factor)
        self.options = replace(options, frame_seconds=self.frame_s)
        self.frame = frame = loaded.features.hop_length * self.model.cfg.subsampling_factor  # samples per encoder frame
        self.chunk = max(1, round(config.chunk / self.frame_s)) * frame  # sizes in samples, whole frames
        self.right = round(config.right / self.frame_s) * frame
        self.left = round(self.left_seconds(loaded.max_train_duration) / self.frame_s) * frame
        longest = longest_segment(loaded)
        self.longest = round(longest * self.rate) if longest else None  # a sentence with its edges
        self.sink = round(SINK_SECONDS / self.frame_s)
        self.edges = segment_edges(loaded)  # silence kept before and after a sentence's speech
        self.policy = CommitPolicy(config, self.frame_s)
        self.logmel = LogMel(loaded.features).to(loaded.device).eval()
        n_layers = len(self.model.decoder.layers)
        self.alignatt_layer = max(0, n_layers - 2) if config.alignatt_layer is None else config.alignatt_layer
        if not -n_layers <= self.alignatt_layer < n_layers:
            raise ValueError(f"alignatt layer {config.alignatt_layer} outside the decoder's {n_layers} layers")

    def left_seconds(self, trained: float | None) -> float:
        """The left context: as configured, else 10 s (NeMo's) but no more than the longest training
        utterance leaves after the chunk and its look-ahead: the encoder never hears a window longer
        than what it was trained on."""
        cfg = self.config
        if cfg.left is not None:
            return cfg.left
        return min(DEFAULT_LEFT, max(0.0, trained - cfg.chunk - cfg.right)) if trained else DEFAULT_LEFT

    def open(self, source_lang: str = "en", target_lang: str | None = None, pnc: bool = True,
             task: str | None = None) -> Stream:
        """A new stream with its Canary prompt (translation when target_lang differs)."""
        target_lang = target_lang or source_lang
        prompt = self.tokenizer.prompt_ids(source_lang, target_lang, pnc, task)
        return Stream(self, prompt, detector=speech_detector(self.config.vad, self.rate))

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
        while final and (batch := [i for i, s in enumerate(streams) if not s.finished]):
            for i, new in zip(batch, self.step([streams[i] for i in batch], final=True)):
                committed[i] += new
        return committed

    @torch.inference_mode()
    def step(self, streams: list[Stream], final: bool) -> list[list[StreamToken]]:
        """One step of each stream, as one batch: its next chunk under the policy, or the end of its
        sentence (to EOS, no policy) where it paused or its window is full, or with final the rest of
        its audio."""
        t0 = time.perf_counter()
        device = self.loaded.device
        windows = [self.window(s, final) for s in streams]
        live = [i for i, w in enumerate(windows) if w.end - w.start >= self.frame and not w.skip]
        new = [[] for _ in streams]
        if live:
            wavs = [streams[i].audio[windows[i].start - streams[i].kept_from: windows[i].end - streams[i].kept_from]
                    for i in live]
            lens = torch.tensor([w.numel() for w in wavs])
            wav = torch.zeros(len(wavs), int(lens.max()))  # (B, S) zero padded
            for b, w in enumerate(wavs):
                wav[b, : w.numel()] = w
            feats, feat_lens = self.logmel(wav.to(device), lens.to(device))
            memory, memory_lens, ctc_log_probs = (self.model.encode_with_ctc(feats, feat_lens) if self.joint
                                                  else (*self.model.encode(feats, feat_lens), None))  # (B, T', D), (B,)
            # The decoder attends up to the chunk's end: the look-ahead frames are heard by the encoder
            # only, unless the sentence ends here.
            heard = torch.tensor([max(1, (windows[i].chunk_end - windows[i].start) // self.frame) for i in live],
                                 device=device)
            closing = torch.tensor([windows[i].closing for i in live], device=device)
            attend = torch.where(closing, memory_lens, torch.minimum(memory_lens, heard))
            ids, judged = self.decode_chunk([streams[i] for i in live], [windows[i] for i in live], memory, attend,
                                            ctc_log_probs)
            for b, tokens, check in zip(live, ids, judged):
                new[b] = tokens if check is None else self.no_speech(streams[b], windows[b], tokens, *check)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the time of the work, not of queueing it
        elapsed = time.perf_counter() - t0  # each stream of the batch waited for all of it
        committed = []
        for s, w, ids in zip(streams, windows, new):
            s.compute += elapsed
            s.chunk_compute.append(elapsed)
            committed.append([StreamToken(t, w.heard / self.rate, s.compute) for t in ids])
            s.tokens += committed[-1]
            if w.closing or w.skip:  # the next sentence starts where this one was cut
                s.partial = []
                s.sentences += w.closing
                s.sentence_seconds += (w.chunk_end - w.start) / self.rate if w.closing else 0.0
                s.window_cuts += w.full
                s.sentence_tokens = len(s.tokens)
                self.policy.new_sentence(s.policy)
                s.audio, s.kept_from = s.audio[w.chunk_end - s.kept_from:], w.chunk_end
            else:  # the silence before the sentence's speech, beyond what training utterances hold, is dropped
                s.audio, s.kept_from = s.audio[w.start - s.kept_from:], w.start
            if not w.closing:  # the chunk is done; after a sentence's end the same chunk comes next, from the cut
                s.chunks += 1
            s.finished = w.last
        return committed

    def window(self, s: Stream, final: bool) -> "Window":
        """What `s` decodes in this step (`Window`), in stream samples. The sentence (the audio since
        `s.kept_from`, from as much silence before its speech as the training utterances held) ends at
        the first pause of `config.endpoint` s after speech in the audio heard (the look-ahead
        included); a sentence that would outgrow the window (left + chunk), or the longest training
        utterance, ends at a gap in its speech (`gap_cut`), a full window else at its quietest point;
        audio without speech is passed over, never decoded."""
        start, hop = s.kept_from, round(self.rate * FRAME)
        heard = s.received if final else min(s.received, (s.chunks + 1) * self.chunk + self.right)
        chunk_end = s.received if final else (s.chunks + 1) * self.chunk
        known = s.scored - s.levels.numel()  # stream frame of levels[0]
        context = min(start // hop - known, round(FLOOR_SECONDS / FRAME))  # frames before the sentence
        levels = s.levels[start // hop - known: heard // hop - known]  # (frames,) dB of the sentence so far
        speech = s.detector.speech(s.levels[start // hop - known - context: heard // hop - known])[context:]  # (frames,)
        spoken = speech.nonzero().flatten()
        lead, trail = (round(e / FRAME) for e in self.edges)
        if self.config.endpoint == 0:  # no pauses: one sentence, until the window is full
            spoken = torch.zeros(1, dtype=torch.long)
        elif spoken.numel() == 0:  # silence so far: the sentence starts `lead` before the newest audio
            cut = max(start, min(chunk_end, heard - lead * hop) // hop * hop)
            return Window(start, cut, cut, heard, skip=True, last=final)
        # The sentence starts `lead` before its speech and ends `trail` after, as `edge_silence` judged
        # the training utterances.
        shift = max(0, int(spoken[0]) - lead) if self.config.endpoint > 0 else 0
        start, levels, speech = start + shift * hop, levels[shift:], speech[shift:]
        own, first = speech.nonzero().flatten(), int(spoken[0]) - shift
        if self.config.endpoint > 0:
            for lo, hi in runs(~speech[first:]):  # pauses after the first frame of speech
                if hi - lo >= round(self.config.endpoint / FRAME):  # the first pause after speech
                    lo, hi = first + lo, first + hi
                    spoken_end = int(own[own < lo].max()) + 1 if (own < lo).any() else lo
                    cut = start + min(spoken_end + trail, (lo + hi) // 2) * hop
                    if self.longest and cut - start > self.longest:  # too long for the model: split at a gap
                        gap = self.gap_cut(s, start, speech, first, min(lo, self.longest // hop))
                        cut = cut if gap is None else gap
                    return Window(start, cut, cut, heard, closing=True)
        if final:
            return Window(start, heard, heard, heard, closing=True, last=True)
        if chunk_end - start < self.frame:  # a sentence that ended in the look-ahead: wait for the next chunk
            return Window(start, start, start, heard)
        if chunk_end - start > self.left + self.chunk:  # full: end the sentence at a gap, else its quietest point
            lo, hi = max(1, (self.left + self.chunk) // 2 // hop), (chunk_end - start) // hop
            cut = self.gap_cut(s, start, speech, lo, hi)
            cut = start + quietest(levels, lo, hi) * hop if cut is None else cut
            return Window(start, cut, cut, heard, closing=True, full=True)
        return Window(start, chunk_end, heard, heard)

    def no_speech(self, s: Stream, window: Window, ids: list[int], prob: float, avg_logprob: float) -> list[int]:
        """The no-speech check of the sentence `window` ends (Whisper's, as offline decoding checks each
        chunk), with its no-speech probability and mean log-probability: the tokens to commit, none
        where it is judged non-speech; then the tokens committed earlier are withdrawn from `s.tokens`
        too, and the sentence is counted with its seconds."""
        s.no_speech_prob = prob if s.no_speech_prob is None else min(prob, s.no_speech_prob)
        if not (ids or len(s.tokens) > s.sentence_tokens) or not self.options.no_speech(prob, avg_logprob):
            return ids
        del s.tokens[s.sentence_tokens:]
        s.skipped_sentences += 1
        s.skipped_seconds += (window.chunk_end - window.start) / self.rate
        return []

    def gap_cut(self, s: Stream, start: int, speech: torch.Tensor, lo: int, hi: int) -> int | None:
        """Where a sentence that cannot end at a pause ends: at the longest gap in its speech (`speech`
        (frames,) from `start`) within frames [lo, hi), as offline segmentation splits a stretch of
        speech too long for the model, and after the attention peak of the sentence's newest committed
        token (its tokens stay in its audio). The cut, in stream samples, as at a pause: `trail` after
        the speech, at most the gap's middle; None for no such gap."""
        hop, trail = round(self.rate * FRAME), round(self.edges[1] / FRAME)
        last_peak = s.policy.last_peak
        committed = -1 if last_peak is None else math.ceil((last_peak * self.rate - start) / hop)
        gaps = [(b - a, lo + a, lo + b) for a, b in runs(~speech[lo:hi]) if lo + a > committed]
        if not gaps:
            return None
        _, a, b = max(gaps)
        return start + min(a + trail, (a + b) // 2) * hop

    def context(self, s: Stream) -> list[int]:
        """The committed tokens the decoder re-reads: the current sentence's, cut to the newest that
        fit the decoder's positions."""
        room = self.model.cfg.dec_max_len - len(s.prompt) - self.chunk_cap()
        return [t.id for t in s.tokens[s.sentence_tokens:]][-room:] if room > 0 else []

    def chunk_cap(self) -> int:
        """Most tokens a chunk before the last may commit: max_tokens_per_second of its audio, at
        least one (without that bound: max_delta, offline decoding's allowance past the frames)."""
        per_second = self.options.max_tokens_per_second
        return max(1, math.floor(per_second * self.chunk / self.rate)) if per_second else self.options.max_delta

    def decode_chunk(self, streams, windows, memory, attend, ctc_log_probs=None) -> list[list[int]]:
        """Greedy steps for each row (a stream) from its prefix: under the policy, or to EOS where its
        sentence ends (`Window.closing`); memory (B, T', D), attend (B,) frames each row's decoder may
        attend to. With the CTC head's log-probs (B, T', V + 1), each step's token is the best joint
        score among the attention decoder's `ctc_candidates` and EOS, as offline greedy decoding picks
        it. Returns the ids each row commits, and per row (prob, avg_logprob) of the no-speech check
        where its sentence ends and options.no_speech_threshold is set, else None: P(EOS) right after
        the prompt, and the attention decoder's log-probability of the sentence (the committed tokens
        it re-reads, scored in the same pass, then the new ones and EOS) over its tokens + 1, as
        offline search scores its hypothesis."""
        b, device, eos = len(streams), memory.device, self.tokenizer.eos
        contexts = [self.context(s) for s in streams]
        prefixes = [s.prompt + c for s, c in zip(streams, contexts)]
        prefix_lens = torch.tensor([len(p) for p in prefixes], device=device)
        # A sentence's end: offline decoding's budget for this buffer, less what it re-reads.
        budget = [max(1, int(token_budget(self.model, attend[r: r + 1], len(p), self.options)[0]) - len(c))
                  if w.closing else self.chunk_cap() for r, (p, c, w) in enumerate(zip(prefixes, contexts, windows))]
        steps = max(budget)
        # Every row is stepped `steps` times (a finished row's tokens are never read): room for the longest prefix.
        cache = self.new_cache(memory, attend, int(prefix_lens.max()) + steps)
        padded = torch.full((b, int(prefix_lens.max())), eos, dtype=torch.long, device=device)
        for r, p in enumerate(prefixes):
            padded[r, : len(p)] = torch.tensor(p)
        scorer = None if ctc_log_probs is None else self.ctc_scorer(ctc_log_probs, attend, contexts)
        rows = torch.arange(b, device=device)
        with CrossAttention(self.model, self.alignatt_layer) as attention:
            hidden = self.model.decoder.forward_cached(padded, cache)  # (B, P, D)
            # Each row goes on from its own prefix: positions past it hold padding, overwritten next.
            cache.length.copy_(prefix_lens)
            last = prefix_lens - 1
            logits = self.model.decoder.output_proj(hidden[torch.arange(b, device=device), last]).float()  # (B, V)
            peaks = attention.peaks(last, attend, self.sink)  # (B,) frame each row's last query attends most
            scores = {}  # rows checked at their sentence's end: [P(EOS) after the prompt, summed log-probs]
            for r, (s, c, w) in enumerate(zip(streams, contexts, windows)):
                if w.closing and self.options.no_speech_threshold is not None:
                    p = len(s.prompt)
                    logp = F.log_softmax(self.model.decoder.output_proj(hidden[r, p - 1: p + len(c)]).float(), dim=-1)
                    said = torch.tensor(c, dtype=torch.long, device=device)
                    scores[r] = [float(logp[0, eos].exp()), float(logp[torch.arange(len(c), device=device), said].sum())]
            out = [[] for _ in streams]
            hyps = [list(c) for c in contexts]  # what the repetition guard reads, as offline: no prompt
            state = ["commit"] * b  # then "partial" (held back, with partials) or "done"
            partial = [[] for _ in streams]
            for _ in range(steps):
                logp = F.log_softmax(logits, dim=-1)  # (B, V)
                if scorer is None:
                    token = logits.argmax(dim=-1)
                else:
                    cand, joint, psi = joint_candidates(logp, scorer, eos, self.options.ctc_weight,
                                                        self.options.ctc_candidates)
                    choice = joint.argmax(dim=-1)  # (B,)
                    token = cand[rows, choice]
                    scorer.select(rows, choice, psi[rows, choice], token)
                tokens, picked = token.tolist(), logp[rows, token].tolist()
                for r, s in enumerate(streams):
                    if state[r] == "commit" and r in scores:  # a sentence's end: every token is committed, or EOS
                        scores[r][1] += picked[r]
                    if state[r] == "commit":
                        verdict = self.commit(s, hyps[r], out[r], tokens[r], int(peaks[r]), int(attend[r]),
                                              windows[r], budget[r])
                        if verdict == "held" and self.partials:
                            state[r], partial[r] = "partial", [tokens[r]]
                        elif verdict != "more":
                            state[r] = "done"
                    elif state[r] == "partial":
                        if tokens[r] == eos or len(partial[r]) >= budget[r]:
                            state[r] = "done"
                        else:
                            partial[r].append(tokens[r])
                if all(st == "done" for st in state):
                    break
                feed = torch.tensor([[t] for t in tokens], device=device)  # finished rows' tokens are never read
                logits = self.model.decode_step(feed, cache)
                peaks = attention.peaks(torch.zeros(b, dtype=torch.long, device=device), attend, self.sink)
        for s, p in zip(streams, partial):
            s.partial = p
        return out, [None if r not in scores else (scores[r][0], scores[r][1] / (len(hyps[r]) + 1)) for r in range(b)]

    def ctc_scorer(self, ctc_log_probs, attend, contexts: list[list[int]]) -> CTCPrefixScorer:
        """A CTC prefix scorer over each row's `attend` frames, advanced through the committed tokens its
        decoder re-reads: the window starts where the sentence does, so they are all in its audio."""
        scorer, device = CTCPrefixScorer(ctc_log_probs, attend), ctc_log_probs.device
        rows, past = torch.arange(len(contexts), device=device), torch.ones(len(contexts), dtype=torch.long, device=device)
        for i in range(max(map(len, contexts), default=0)):
            has = torch.tensor([i < len(c) for c in contexts], device=device)
            token = torch.tensor([c[i] if i < len(c) else 0 for c in contexts], device=device)
            psi = scorer.score(token[:, None])[:, 0]
            # A row whose context has ended picks the column past the scored one: its variables stay.
            scorer.select(rows, torch.where(has, 0, past), torch.where(has, psi, scorer.psi),
                          torch.where(has, token, scorer.last))
        return scorer

    def commit(self, s: Stream, hyp: list[int], out: list[int], token: int, peak: int, attend: int, window,
               budget: int) -> str:
        """Row `s`'s next token, committed (appended to hyp and out) or not as the policy and the
        repetition guard decide. "more": committed, and the row may take another token in this chunk;
        "stop": EOS, or the last token it may take; "held": held back by the policy or the repetition guard."""
        if token == self.tokenizer.eos:
            self.policy.eos(s.policy)
            return "stop"
        repeats = bool(self.options.max_repeats) and bool(
            ends_in_repeats(torch.tensor([hyp + [token]]), len(hyp) + 1, self.options.max_repeats))
        if not self.policy.decide(s.policy, window.chunk_end / self.rate, s.chunks, len(out), peak, attend,
                                  window.closing, repeats):
            return "held"
        hyp.append(token)
        out.append(token)
        self.policy.committed(s.policy, window.start / self.rate + peak * self.frame_s)
        return "more" if len(out) < budget and not repeats else "stop"  # as offline search stops after it

    def new_cache(self, memory, attend, max_len: int) -> KVCache:
        """An empty decoder cache whose rows each keep their own position (per-row lengths)."""
        c = self.model.new_cache(memory, attend, max_len)
        return KVCache(c.keys, c.values, c.cross_kv, c.memory_mask,
                       torch.zeros(memory.size(0), dtype=torch.long, device=memory.device))


class CrossAttention:
    """Captures one decoder layer's cross-attention weights while active (a forward hook on its
    attention module: scaled dot-product attention returns no weights, so the query's scores are
    recomputed from the same inputs): where each token's attention peaks, for the policy and the cuts."""

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

    def peaks(self, query, attend, sink: int = 0):
        """(R,) the frame each row's query position `query` (R,) attends most, among its `attend`
        frames less the first `sink` (where a decoder with nothing to say looks: NeMo's attention
        sink), unless that leaves none."""
        rows = torch.arange(query.numel(), device=query.device)
        w = self.weights[rows, query]  # (R, T')
        frames = torch.arange(w.size(1), device=w.device)
        valid = (frames < attend[:, None]) & (frames >= torch.clamp(attend[:, None] - 1, max=sink))
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
                res.undecoded_seconds = max(0.0, res.duration - s.sentence_seconds)
                if streamer.options.no_speech_threshold is not None:
                    res.no_speech_prob, res.skipped_segments = s.no_speech_prob, s.skipped_sentences
                    res.skipped_seconds = s.skipped_seconds
                latency = stream_latency(s, res.duration, res.request.text, wav)
            out.append((res, s, latency))
    return out
