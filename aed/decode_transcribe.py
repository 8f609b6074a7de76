"""Batched transcription and translation of audio files: the Python API behind infer.py.

    from aed.decode_search import DecodingOptions
    from aed.decode_transcribe import transcribe, read_requests, score
    from aed.model_checkpoint import load_model
    loaded = load_model("runs/tiny")                         # a checkpoint file, or a run dir (newest)
    results, timings = transcribe(loaded, ["a.wav", "clips/"], source_lang="en")
    results, timings = transcribe(loaded, read_requests("test.jsonl"), DecodingOptions(beam_size=4))
    print(results[0].pred_text, timings.rtfx, score(results))

Inputs are files (any rate and channel count soundfile reads, or the ffmpeg command where it is
installed: m4a, mp4, webm, ...), directories, glob patterns, or
`Request`s (one per manifest line, with per-line task fields). Every input gets one `Result`, in
input order; an unreadable file gets `error` set instead of a transcript, never dropped.

A *chunk* is a stretch of one input that is decoded on its own (`AudioChunk`; `aed.decode_timing.Chunk`
once decoded); a *segment* is a subtitle cue (`aed.decode_timing.Segment`).

How the work is cut:
1. Plan: each input's duration (manifest, else the file header). Inputs longer than `chunk_seconds`
   (the longest utterance the model was trained on, `chunk_length`) are cut at their pauses into segments of at most
   that (`aed.decode_timing`: speech found by energy, every pause of 0.25 s ends a segment, each
   segment with the silence at its edges that the training utterances held, the rest not decoded).
   Where continuous speech must be cut, with `chunk_overlap` > 0 (off by default: docs/inference.md,
   "Long audio", says why) the next segment starts that many seconds before the previous one ends,
   so the words around the cut are heard whole by one of the two, and the two hypotheses are merged.
2. Batch: chunks sorted by duration, longest first, and cut into batches of at most
   `batch_duration` padded seconds (batch size x longest chunk): `aed.data_batch.duration_batches`.
3. Per batch: load + log-mel features, then `decode_features`: encoder, then greedy or beam search
   (`aed.decode_search.search`), joint with the CTC head when the model has one; each phase is timed
   separately (the device is synchronised between phases) for the RTFx report; then the no-speech
   check judges each chunk (`aed.decode_search.DecodingOptions.no_speech`), and what it empties is
   counted on its file's Result. Validation during training decodes its batches with the same
   `decode_features`.
4. With timestamps, or to merge overlapping chunks with a CTC head: each hypothesis is force-aligned
   to the CTC head's posteriors of its own chunk (`aed.decode_timing`), and the chunk's start is added,
   so times count from the start of the file.
5. Join: overlapping chunks' words are merged (`aed.decode_timing.merge_chunks`: by time when aligned,
   else by the words both chunks heard); chunks that do not overlap are joined with spaces.
"""

import glob
import logging
import math
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import soundfile as sf
import torch

from aed.data_audio import FFMPEG_EXTENSIONS, AudioError, LogMel, audio_seconds, load_audio, num_frames
from aed.data_batch import duration_batches
from aed.data_manifest import PROMPT_TASKS, check_task, read_rows, request_fields
from aed.data_tokenizer import Tokenizer
from aed.decode_metrics import corpus_scores
from aed.decode_search import DecodingOptions, decode_features
from aed.data_speech import EnergyDetector, speech_detector, speech_frames, trimmed_span
from aed.decode_timing import (EDGE, Chunk, MergeStats, Word, align, feasible, frame_seconds, longest_segment, merge_chunks,
                               plan_segments, segment_edges, snap_to_speech, to_segments, to_words)
from aed.model_checkpoint import LoadedModel

log = logging.getLogger(__name__)

DEFAULT_CHUNK = 40.0  # seconds per chunk for a checkpoint that does not record its training maximum


# --- inputs -----------------------------------------------------------------------------------


@dataclass
class Request:
    """One input: a file (or a stretch of one, via offset/duration) and the task to run on it."""

    audio_filepath: str
    source_lang: str
    target_lang: str
    pnc: bool
    taskname: str  # "asr" or "ast"
    offset: float = 0.0  # seconds into the file
    duration: float | None = None  # seconds from offset; None: to the end of the file
    text: str | None = None  # reference transcript/translation, for WER/BLEU
    fields: dict = field(default_factory=dict)  # the manifest line as read, echoed in the output
    where: str = ""  # "test.jsonl:17" or the path, for error messages


def make_request(audio_filepath: str, source_lang: str = "en", target_lang: str | None = None,
                 task: str | None = None, pnc: bool = True, where: str = "", **kw) -> Request:
    """Fill the defaults (target = source; task = asr iff source == target) and validate the task."""
    where = where or audio_filepath
    task_fields = check_task(where, source_lang, target_lang or source_lang, pnc, task)
    return Request(audio_filepath, *task_fields, where=where, **kw)


def read_requests(manifest: str, source_lang: str = "en", target_lang: str | None = None,
                  task: str | None = None, pnc: bool = True, skip_invalid: bool = False) -> list[Request]:
    """NeMo-style JSONL -> Requests, read as every manifest is (`aed.data_manifest.read_rows`, the
    lenient `request_fields`): only `audio_filepath` is required; the task fields default to the
    arguments, per-line values win; `duration` defaults to the whole file; `text` (or `answer`) is
    a reference when present. Bad lines raise ManifestError naming file, line and field, or with
    `skip_invalid` are logged and counted, as training's manifests are."""
    def request(d: dict, where: str, base_dir: str) -> Request:
        f = request_fields(d, where, base_dir, source_lang, target_lang, task, pnc)
        return make_request(f["audio_filepath"], f["source_lang"], f["target_lang"], f["taskname"], f["pnc"], where,
                            offset=f["offset"], duration=f["duration"], text=f["text"], fields=d)

    return list(read_rows(manifest, request, skip_invalid))


def known_languages(requests: list[Request], tokenizer: Tokenizer) -> list[Request]:
    """The requests whose languages `tokenizer` knows; the others are logged by line and counted
    (a manifest cannot be checked for that before the model is loaded)."""
    known = set(tokenizer.languages)
    out = [r for r in requests if {r.source_lang, r.target_lang} <= known]
    for r in requests:
        if not {r.source_lang, r.target_lang} <= known:
            log.warning("skipping %s: language %s -> %s, the model's tokenizer has %s", r.where, r.source_lang,
                        r.target_lang, sorted(known))
    if len(out) < len(requests):
        log.warning("skipped %d input(s) in a language the model does not know", len(requests) - len(out))
    return out


def expand_inputs(specs: list[str]) -> list[str]:
    """Paths, directories (searched recursively for files with an audio extension soundfile knows)
    and glob patterns -> file paths. A pattern matching nothing is kept as is, so it is reported as
    "file not found" like any other missing path instead of vanishing."""
    audio_ext = {"." + ext.lower() for ext in sf.available_formats()} | {".opus"} | FFMPEG_EXTENSIONS
    paths = []
    for spec in specs:
        if os.path.isdir(spec):
            found, other = [], 0
            for root, _, files in os.walk(spec):
                for name in files:
                    if os.path.splitext(name)[1].lower() in audio_ext:
                        found.append(os.path.join(root, name))
                    else:
                        other += 1
            if other:
                log.info("%s: ignored %d file(s) without an audio extension", spec, other)
            paths += sorted(found)
        elif glob.has_magic(spec):
            paths += sorted(glob.glob(spec, recursive=True)) or [spec]
        else:
            paths.append(spec)
    return paths


# --- results ----------------------------------------------------------------------------------


@dataclass
class Result:
    request: Request
    pred_text: str | None = None  # None when the file failed
    tokens: list[int] = field(default_factory=list)  # generated ids (no prompt, no EOS), all chunks in order
    duration: float = 0.0  # seconds of audio decoded
    decode_time: float = 0.0  # this file's share of its batches' wall time (split by audio duration)
    error: str | None = None  # why the file could not be transcribed
    words: list[Word] | None = None  # with timestamps: every word with its start and end in the file
    # with DecodingOptions.no_speech_threshold: the lowest no-speech probability of the file's chunks
    # (a file holds speech where any of its chunks does), and the chunks (a stream's sentences) the
    # check judged non-speech and emptied, with their seconds: nothing is dropped unsaid
    no_speech_prob: float | None = None
    skipped_segments: int | None = None
    skipped_seconds: float = 0.0
    undecoded_seconds: float | None = None  # of the file's audio, the seconds in no decoded chunk (pauses)

    def add_no_speech(self, prob: float, emptied: bool, seconds: float) -> None:
        """Count the no-speech check of one of the file's chunks, of `seconds` (skipped_segments set)."""
        self.no_speech_prob = prob if self.no_speech_prob is None else min(prob, self.no_speech_prob)
        self.skipped_segments += emptied
        self.skipped_seconds += seconds if emptied else 0.0

    def to_json(self, timestamps: str | None = None) -> dict:
        """One --out JSONL line: the manifest's own fields, then ours; with timestamps "segment" or
        "word", also `segments` (text, start, end; with "word" each segment's `words` too)."""
        r = self.request
        times = {} if timestamps is None or self.words is None else {
            "segments": [s.to_json(with_words=timestamps == "word") for s in to_segments(self.words)]}
        return {**r.fields, "audio_filepath": r.audio_filepath, "duration": round(self.duration, 3),
                "pred_text": self.pred_text if self.error is None else "", "source_lang": r.source_lang,
                "target_lang": r.target_lang, "pnc": "yes" if r.pnc else "no", "taskname": r.taskname,
                "decode_time": round(self.decode_time, 4), **times,
                # 3 significant digits: a model never trained on non-speech gives ~1e-5, one that was up to ~1
                **({} if self.no_speech_prob is None else {"no_speech_prob": float(f"{self.no_speech_prob:.3g}")}),
                **({} if self.skipped_segments is None else
                   {"skipped": {"segments": self.skipped_segments, "seconds": round(self.skipped_seconds, 3)}}),
                **({} if self.undecoded_seconds is None else {"undecoded_seconds": round(self.undecoded_seconds, 3)}),
                **({"error": self.error} if self.error else {})}


@dataclass
class Timings:
    audio: float = 0.0  # seconds of audio transcribed
    wall: float = 0.0  # seconds from the call to its return (model loading is not included)
    load_features: float = 0.0  # planning (headers, pause search), audio decoding, resampling, log-mel
    encoder: float = 0.0
    decoder: float = 0.0  # greedy or beam search, including the cross-attention K/V projection
    align: float = 0.0  # timestamps: forced alignment (the CTC head's projection counts as encoder time)

    @property
    def rtfx(self) -> float:
        """Inverse real-time factor: seconds of audio per second of wall time."""
        return self.audio / self.wall if self.wall > 0 else math.nan


def score(results: list[Result], normalizer: str = "simple") -> dict:
    """`aed.decode_metrics.corpus_scores` of the results that have a reference and did not fail:
    {"asr en": {"wer": .., "wer_pnc": .., "n": ..}, "ast es-en": {"bleu": .., "n": ..}}; `wer` after
    `normalizer` ("simple" or "whisper": aed/decode_metrics.py), `wer_pnc` on the raw text."""
    rows = [(res.request.taskname, res.request.source_lang, res.request.target_lang, res.request.text, res.pred_text)
            for res in results if res.error is None and res.request.text is not None]
    return corpus_scores(rows, normalizer)[0]


# --- planning: durations and chunks -----------------------------------------------------------


def chunk_length(loaded: LoadedModel, chunk_seconds: float | None) -> float:
    """Seconds per chunk of a long input: `chunk_seconds` when given, else the longest utterance
    the model was trained on (an attention model trained on short utterances drops most of the
    words of much longer ones) with the edges a segment gets (`longest_segment`), else 40 s
    (Canary's training maximum). A chunk longer than that gets a warning."""
    trained = longest_segment(loaded)
    if chunk_seconds is None:
        return trained if trained is not None else DEFAULT_CHUNK
    if trained is not None and chunk_seconds > trained:
        log.warning("chunks of up to %.1f s, but %s was trained on utterances of at most %.1f s (%.1f s with a "
                    "segment's edges): expect dropped words; leave the chunk length unset to use the training "
                    "maximum", chunk_seconds, loaded.path, loaded.max_train_duration, trained)
    return chunk_seconds


BLOCK_SECONDS = 60.0  # a long file's energies are read this much at a time: memory bounded by the block


def file_scores(path: str, offset: float, total: float, detector: EnergyDetector) -> torch.Tensor:
    """The `detector`'s scores (frames,) of the 10 ms frames of `total` seconds of `path` from `offset`
    (energies in dB for the energy rule)."""
    blocks, done = [], 0.0
    while done < total:
        seconds = min(BLOCK_SECONDS, total - done)
        blocks.append(detector.scores(load_audio(path, offset + done, seconds, detector.rate)))
        done += seconds
    return torch.cat(blocks + [detector.scores(torch.zeros(0), final=True)])


def plan_chunks(req: Request, chunk_seconds: float, sample_rate: int, overlap: float = 0.0,
                edges: tuple[float, float] = (EDGE, EDGE), trim: float | None = None,
                vad: str = "energy", merge: bool = False) -> tuple[float, list[tuple[float, float | None, float]]]:
    """A request's length (s) and the (offset, duration or None = to the end, seconds) of each of its
    chunks: the whole of an input up to `chunk_seconds` (with `trim`, the model's train.trim_silence,
    cut as training cut its utterances, by energy: to `trim` s of silence around its speech); a longer
    one cut at its pauses into segments of at most `chunk_seconds` (`aed.decode_timing.plan_segments`,
    speech judged by the `vad` detector: aed.data_speech.DETECTORS; with `merge`, stretches of speech
    joined up to chunk_seconds across pauses of at most the two edges) with `edges` s of silence before
    and after their speech, the rest of the silence between them not decoded; with `overlap`, a
    segment that follows a cut inside continuous speech starts that many seconds before the previous
    one ends (the words around the cut are then merged: `aed.decode_timing.merge_chunks`; `transcribe`
    checks that overlap is at most half of chunk_seconds)."""
    if req.duration is not None:
        total = req.duration
    else:
        seconds = audio_seconds(req.audio_filepath)
        total = seconds - req.offset
        if total <= 0:
            raise AudioError(req.audio_filepath, f"no audio after offset {req.offset}s ({seconds:.3f} s)")
    if total <= chunk_seconds and trim is None:
        return total, [(req.offset, req.duration, total)]
    if total <= chunk_seconds:
        start, end = trimmed_span(load_audio(req.audio_filepath, req.offset, total, sample_rate), sample_rate, trim)
        return total, [(req.offset + start / sample_rate, (end - start) / sample_rate, (end - start) / sample_rate)]
    chunks, previous = [], None
    detector = speech_detector(vad, sample_rate)
    for cut in plan_segments(file_scores(req.audio_filepath, req.offset, total, detector), chunk_seconds,
                             edges=edges, detector=detector, merge=merge):
        joined = overlap > 0 and previous is not None and not previous.pause_after
        # ... by at most half the previous chunk (`aed.decode_timing.merge_chunks` joins two chunks, never three)
        start = max((chunks[-1][0] - req.offset + previous.end) / 2, previous.end - overlap) if joined else cut.start
        end = min(cut.end, total)
        chunks.append((req.offset + start, end - start, end - start))
        previous = cut
    return total, chunks


# --- transcription ----------------------------------------------------------------------------


def check_settings(batch_duration: float = 300.0, chunk_seconds: float | None = None, chunk_overlap: float = 0.0) -> None:
    """ValueError naming the first setting of `transcribe` out of its range (DecodingOptions checks its
    own when made); infer.py calls it before any work. chunk_overlap's upper bound, half the chunk
    length, is checked once that is known."""
    if batch_duration <= 0 or (chunk_seconds is not None and chunk_seconds <= 0):
        raise ValueError(f"batch duration ({batch_duration}) and chunk seconds ({chunk_seconds}) must be positive")
    if chunk_overlap < 0:
        raise ValueError(f"chunk overlap ({chunk_overlap}) must be >= 0")



class AudioChunk(NamedTuple):
    """A stretch of one request's audio, decoded on its own (`plan_chunks`)."""

    request: int  # index of its Request
    offset: float  # seconds into the file
    duration: float | None  # seconds from offset; None: to the end of the file
    seconds: float  # estimated length, for batching and progress


def to_requests(inputs: list, **task_defaults) -> list[Request]:
    """Requests as given; paths, directories and globs expanded into Requests with `task_defaults`."""
    requests = []
    for item in inputs:
        if isinstance(item, Request):
            requests.append(item)
        else:
            requests += [make_request(p, **task_defaults) for p in expand_inputs([os.fspath(item)])]
    return requests


def request_prompts(requests: list[Request], tokenizer: Tokenizer) -> list[list[int]]:
    """Each request's decoder prompt. An unknown language is the caller's mistake: it fails here,
    before any work, naming the request."""
    prompts = []
    for r in requests:
        try:
            prompts.append(tokenizer.prompt_ids(r.source_lang, r.target_lang, r.pnc, PROMPT_TASKS[r.taskname]))
        except ValueError as e:
            raise ValueError(f"{r.where}: {e}") from None
    return prompts


def plan(requests: list[Request], results: list[Result], chunk_seconds: float, overlap: float,
         sample_rate: int, edges: tuple[float, float], trim: float | None = None,
         vad: str = "energy", merge: bool = False) -> list[AudioChunk]:
    """Every request's chunks, in file order, and its length on its Result; a file whose length cannot
    be read fails its Result. A file without speech has no chunks: its text is empty."""
    chunks = []
    for i, r in enumerate(requests):
        try:
            results[i].duration, planned = plan_chunks(r, chunk_seconds, sample_rate, overlap, edges, trim, vad,
                                                      merge)
            chunks += [AudioChunk(i, *chunk) for chunk in planned]
        except AudioError as e:
            results[i].error = e.reason
    return chunks


def load_chunks(loaded: LoadedModel, requests: list[Request], chunks: list[AudioChunk], batch: list[int],
                results: list[Result]) -> tuple[list[int], list[torch.Tensor]]:
    """The chunks of `batch` that load, and their waveforms (S,). A failure is recorded on its
    file's Result, and the file's remaining chunks are skipped."""
    kept, wavs = [], []
    for k in batch:
        chunk = chunks[k]
        res = results[chunk.request]
        if res.error is not None:  # another chunk of this file already failed
            continue
        try:
            wav = load_audio(requests[chunk.request].audio_filepath, chunk.offset, chunk.duration,
                             loaded.features.sample_rate)
        except AudioError as e:
            res.error = e.reason
            continue
        if num_frames(wav.numel(), loaded.features.hop_length) == 0:
            res.error = f"audio shorter than one feature frame ({wav.numel()} samples)"
            continue
        kept.append(k)
        wavs.append(wav)
    return kept, wavs


def decode_batch(loaded: LoadedModel, logmel: LogMel, wavs: list[torch.Tensor], prompts: list[list[int]],
                 options: DecodingOptions, dtype: torch.dtype | None, with_ctc: bool = False):
    """Waveforms (S,) and their prompts -> `decode_features` of their log-mel features."""
    device = loaded.device
    wav_lens = torch.tensor([w.numel() for w in wavs])
    wav = torch.zeros(len(wavs), int(wav_lens.max()))  # (B, S) zero padded
    for b, w in enumerate(wavs):
        wav[b, : w.numel()] = w
    feats, feat_lens = logmel(wav.to(device), wav_lens.to(device))  # (B, T, F), (B,)
    if len({len(p) for p in prompts}) > 1:
        raise ValueError(f"prompts of different lengths {sorted({len(p) for p in prompts})} in one batch; prompt "
                         f"format {loaded.tokenizer.prompt_format!r} must give equal-length prompts")
    prompt = torch.tensor(prompts, dtype=torch.long, device=device)  # (B, P)
    amp = torch.autocast(device.type, dtype=dtype) if dtype is not None else nullcontext()
    return decode_features(loaded.model, feats, feat_lens, prompt, loaded.tokenizer.eos, options, amp,
                           loaded.compiled, with_ctc)


def chunk_words(loaded: LoadedModel, ids: list[int], log_probs: torch.Tensor | None, wav: torch.Tensor,
                offset: float, where: str) -> list[Word]:
    """One chunk's hypothesis -> its words; with its CTC log-probs (T', V), force-aligned, with times
    in the file (the chunk's audio `wav` (S,) starts at `offset` s) narrowed to the speech inside
    each word's span (`snap_to_speech`), else untimed. Special and padding ids carry
    no text and no time. The last encoder frame reaches past the chunk's end (up to 80 ms of
    padding): times are clipped to the chunk."""
    text_ids = loaded.tokenizer.text_ids(ids)
    if log_probs is None:
        return to_words(loaded.tokenizer, text_ids, None, 0.0)
    if not feasible(log_probs.shape[0], text_ids):
        log.warning("%s at %.2f s: %d tokens do not fit a CTC path through %d frames; their times are "
                    "spread evenly over the chunk", where, offset, len(text_ids), log_probs.shape[0])
    spans = align(log_probs, text_ids, loaded.model.ctc.blank)
    encoder_frame_s = frame_seconds(loaded.features, loaded.model.cfg.subsampling_factor)
    words = to_words(loaded.tokenizer, text_ids, spans, encoder_frame_s, offset)
    words = snap_to_speech(words, speech_frames(wav, loaded.features.sample_rate), offset)
    end = offset + wav.numel() / loaded.features.sample_rate
    return [Word(w.text, min(w.start, end), min(w.end, end), w.ids) for w in words]


def covered(spans: list[tuple[float, float]]) -> float:
    """Seconds inside any of the (start, end) spans: overlapping chunks count once."""
    total, reached = 0.0, float("-inf")
    for start, end in sorted(spans):
        total += max(0.0, end - max(start, reached))
        reached = max(reached, end)
    return total


def join_chunks(results: list[Result], generated: list[dict], tokenizer: Tokenizer,
                words: list[dict] | None) -> None:
    """Each transcribed file's text and ids (and words, when timed) from chunks that do not overlap:
    its chunks' in file order, texts joined with spaces."""
    for i, (res, by_chunk) in enumerate(zip(results, generated)):
        if res.error is None:
            if words is not None:
                res.words = [w for k in sorted(words[i]) for w in words[i][k]]
            ordered = [by_chunk[k] for k in sorted(by_chunk)]
            texts = [tokenizer.decode_hypothesis(ids) for ids in ordered]
            res.pred_text = " ".join(text for text in texts if text)
            res.tokens = [t for ids in ordered for t in ids]


def merge_overlapping_chunks(results: list[Result], chunks: list[AudioChunk], words: list[dict], timed: bool,
                             keep_words: bool) -> None:
    """Each transcribed file's words from overlapping chunks (`aed.decode_timing.merge_chunks`): every
    word once, its text the words joined with spaces, its ids the kept words' (special tokens are not kept)."""
    stats = MergeStats()
    for i, res in enumerate(results):
        if res.error is None:
            decoded = [Chunk(chunks[k].offset, chunks[k].offset + chunks[k].seconds, words[i][k], timed)
                       for k in sorted(words[i])]
            merged = merge_chunks(decoded, stats)
            res.pred_text = " ".join(w.text for w in merged)
            res.tokens = [t for w in merged for t in w.ids]
            res.words = merged if keep_words else None
    if stats.estimated:
        log.warning("%d of %d chunk joins found no common word in the overlap (a model without a CTC head "
                    "hears the two sides differently): joined where the words were estimated to be",
                    stats.estimated, stats.joins)


@torch.inference_mode()
def transcribe(loaded: LoadedModel, inputs: list, options: DecodingOptions = DecodingOptions(), *,
               source_lang: str = "en", target_lang: str | None = None, task: str | None = None, pnc: bool = True,
               batch_duration: float = 300.0, chunk_seconds: float | None = None, chunk_overlap: float = 0.0,
               dtype: torch.dtype | None = None, timestamps: bool = False, vad: str = "energy",
               merge_segments: bool = False, progress=None) -> tuple[list[Result], Timings]:
    """Transcribe/translate `inputs` (paths, directories, globs, or Requests) -> one Result each, in order.

    options: the search (`aed.decode_search.DecodingOptions`); its frame_seconds is the model's own, not the
    caller's, as it converts max_tokens_per_second into encoder frames.
    source_lang/target_lang/task/pnc apply to plain paths (Requests carry their own).
    batch_duration: padded seconds of audio per batch (`aed.data_batch.duration_batches`). chunk_seconds:
    longer inputs are cut at pauses (see the module docstring); None: `chunk_length` picks it.
    chunk_overlap: seconds by which a chunk starts before the previous one ends where their cut is not
    a pause, the hypotheses merged (`aed.decode_timing.merge_chunks`); 0: never.
    dtype: torch.bfloat16 for bf16 autocast, None for fp32. timestamps: set every Result's `words`
    (`aed.decode_timing`); a model without a CTC head raises ValueError, before any work. vad: the
    speech detector that finds the pauses of long inputs (aed.data_speech.DETECTORS; "silero" needs
    `pip install silero-vad`). merge_segments: a long input's stretches of speech separated by pauses
    no longer than the silence the model heard around an utterance are decoded together, up to the
    chunk length (`aed.decode_timing.plan_segments`); False: every pause of PAUSE ends a segment.
    progress(done_s, total_s) is called after every batch with seconds of audio.
    A beam search (options.beam_size > 1) with no options.lm fuses the model's own n-gram of its
    training transcripts (`LoadedModel.lm`) at options.lm_weight; lm_weight 0: none.
    """
    if timestamps and loaded.model.ctc is None:
        raise ValueError(f"{loaded.path} has no CTC head (trained with model.ctc_loss_weight=0), and timestamps are "
                         f"forced alignments to its frame posteriors; train with model.ctc_loss_weight > 0 for them")
    check_settings(batch_duration, chunk_seconds, chunk_overlap)
    t_start = time.perf_counter()
    options = replace(options, frame_seconds=frame_seconds(loaded.features, loaded.model.cfg.subsampling_factor))
    if options.lm is None and options.beam_size > 1 and loaded.lm and options.lm_weight > 0:
        options = replace(options, lm=loaded.lm)
        log.info("the beam search fuses the run's n-gram of its training transcripts, %s, at weight %g "
                 "(--lm-weight 0: without)", loaded.lm, options.lm_weight)
    requests = to_requests(inputs, source_lang=source_lang, target_lang=target_lang, task=task, pnc=pnc)
    results = [Result(r, skipped_segments=None if options.no_speech_threshold is None else 0) for r in requests]
    prompts = request_prompts(requests, loaded.tokenizer)
    chunk_s = chunk_length(loaded, chunk_seconds)
    if chunk_overlap > chunk_s / 2:
        raise ValueError(f"chunk overlap {chunk_overlap} s must lie in [0, half the chunk length {chunk_s} s]")
    # A model trained on varied edges takes a short input as it comes; one trained on trimmed utterances, trimmed.
    trim = loaded.trim_silence if loaded.varied_edges is None else None
    if vad != "energy":
        speech_detector(vad, loaded.features.sample_rate)  # an unknown or missing detector fails before any work
    chunks = plan(requests, results, chunk_s, chunk_overlap, loaded.features.sample_rate, segment_edges(loaded), trim,
                  vad, merge_segments)
    overlapping = any(a.request == b.request for a, b in zip(chunks, chunks[1:])) and chunk_overlap > 0
    aligned = timestamps or (overlapping and loaded.model.ctc is not None)  # merging by time needs alignments
    timings = Timings(load_features=time.perf_counter() - t_start)

    logmel = LogMel(loaded.features).to(loaded.device).eval()
    generated = [{} for _ in requests]  # per request: {chunk index: generated ids}
    decoded = [[] for _ in requests]  # per request: the (start, end) seconds of its decoded chunks
    words = [{} for _ in requests] if aligned or overlapping else None  # per request: {chunk index: its words}
    total_s, done_s = sum(c.seconds for c in chunks), 0.0
    for batch in duration_batches([c.seconds for c in chunks], batch_duration):
        t0 = time.perf_counter()
        kept, wavs = load_chunks(loaded, requests, chunks, batch, results)
        hyps, ctc, encoder_s, decoder_s, align_s, no_speech = [], None, 0.0, 0.0, 0.0, None
        if kept:
            batch_prompts = [prompts[chunks[k].request] for k in kept]
            hyps, ctc, encoder_s, decoder_s, no_speech = decode_batch(loaded, logmel, wavs, batch_prompts, options,
                                                                      dtype, with_ctc=aligned)
        if words is not None:
            t_align = time.perf_counter()
            log_probs, lens = (ctc[0].cpu(), ctc[1].tolist()) if ctc is not None else (None, None)
            for b, (k, ids) in enumerate(zip(kept, hyps)):
                chunk = chunks[k]
                frames = log_probs[b, : lens[b]] if log_probs is not None else None
                words[chunk.request][k] = chunk_words(loaded, ids, frames, wavs[b], chunk.offset,
                                                      requests[chunk.request].where)
            align_s = time.perf_counter() - t_align
        batch_s = time.perf_counter() - t0
        timings.load_features += batch_s - encoder_s - decoder_s - align_s
        timings.encoder += encoder_s
        timings.decoder += decoder_s
        timings.align += align_s
        samples = sum(w.numel() for w in wavs)
        for j, (k, wav, ids) in enumerate(zip(kept, wavs, hyps)):
            i = chunks[k].request
            generated[i][k] = ids
            seconds = wav.numel() / loaded.features.sample_rate
            if no_speech is not None:
                results[i].add_no_speech(no_speech.probs[j], no_speech.emptied[j], seconds)
            start = chunks[k].offset - requests[i].offset
            decoded[i].append((start, start + seconds))
            results[i].duration = max(results[i].duration, start + seconds)  # overlapping chunks count once
            results[i].decode_time += batch_s * wav.numel() / samples  # its share of the batch, by audio length
        done_s += sum(chunks[k].seconds for k in batch)
        if progress:
            progress(done_s, total_s)

    if overlapping:
        merge_overlapping_chunks(results, chunks, words, timed=aligned, keep_words=timestamps)
    else:
        join_chunks(results, generated, loaded.tokenizer, words if timestamps else None)
    for res, spans in zip(results, decoded):
        if res.error is None:
            res.undecoded_seconds = max(0.0, res.duration - covered(spans))
    timings.audio = sum(res.duration for res in results if res.error is None)
    timings.wall = time.perf_counter() - t_start
    return results, timings
