"""Batched transcription and translation of audio files: the Python API behind infer.py.

    from aed.inference import load_checkpoint, transcribe, read_requests, score
    asr = load_checkpoint("runs/tiny")                       # a checkpoint file, or a run dir (newest)
    results, timings = transcribe(asr, ["a.wav", "clips/"], source_lang="en")
    results, timings = transcribe(asr, read_requests("test.jsonl"), beam_size=4)
    print(results[0].pred_text, timings.rtfx, score(results))

Inputs are files (any rate and channel count soundfile reads), directories, glob patterns, or
`Request`s (one per manifest line, with per-line task fields). Every input gets one `Result`, in
input order; an unreadable file gets `error` set instead of a transcript, never dropped.

How the work is cut:
1. Plan: each input's duration (manifest, else the file header). Inputs longer than `chunk_seconds`
   are cut, without overlap, at the quietest 100 ms within the last quarter of each chunk, so a cut
   rarely splits a word and nothing needs de-duplicating. The chunks' texts are joined with spaces.
2. Batch: segments sorted by duration, longest first, and cut into batches of at most
   `batch_duration` padded seconds (batch size x longest segment).
3. Per batch: load + log-mel features, encoder, then greedy or beam search; each phase is timed
   separately (the device is synchronised between phases) for the RTFx report.
"""

import glob
import logging
import math
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import soundfile as sf
import torch
import torch.nn.functional as F

from aed.audio import AudioError, FeatureConfig, LogMel, load_audio, num_frames
from aed.checkpoint import list_checkpoints, load_model
from aed.data import PNC_VALUES, TASK_ALIASES, json_object
from aed.decoding import beam_search, greedy_search
from aed.metrics import bleu, wer
from aed.model import AED
from aed.tokenizer import Tokenizer

log = logging.getLogger(__name__)

CUT_SEARCH = 0.25  # search the last quarter of a chunk for a pause: speech pauses every few seconds,
# and every chunk but the last keeps >= 75% of chunk_seconds, so long files are not over-fragmented
QUIET_WINDOW = 0.1  # seconds of audio whose mean energy is compared when looking for a pause


# --- the model --------------------------------------------------------------------------------


@dataclass
class LoadedModel:
    model: AED  # eval mode, on its device
    tokenizer: Tokenizer
    features: FeatureConfig
    path: str  # the checkpoint file that was loaded

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device


def load_checkpoint(path: str, device="cpu") -> LoadedModel:
    """A train.py checkpoint file, or a run directory (its newest `ckpt-*.pt`), ready for inference."""
    if os.path.isdir(path):
        ckpts = list_checkpoints(path)
        if not ckpts:
            raise FileNotFoundError(f"{path}: a directory without ckpt-*.pt checkpoints")
        path = ckpts[-1]
    elif not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such checkpoint file or run directory")
    model, tokenizer, features = load_model(path, device)
    return LoadedModel(model, tokenizer, features, path)


# --- inputs -----------------------------------------------------------------------------------


@dataclass
class Request:
    """One input: a file (or a segment of one, via offset/duration) and the task to run on it."""

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
    target_lang = target_lang or source_lang
    where = where or audio_filepath
    if task is None:
        task = "asr" if source_lang == target_lang else "ast"
    if task not in TASK_ALIASES:
        raise ValueError(f"{where}: field 'taskname': must be one of {sorted(TASK_ALIASES)}, got {task!r}")
    task = TASK_ALIASES[task]
    if task == "asr" and source_lang != target_lang:
        raise ValueError(f"{where}: field 'taskname': 'asr' needs source_lang == target_lang, "
                         f"got {source_lang} -> {target_lang}")
    return Request(audio_filepath, source_lang, target_lang, pnc, task, where=where, **kw)


def read_requests(manifest: str, source_lang: str = "en", target_lang: str | None = None,
                  task: str | None = None, pnc: bool = True) -> list[Request]:
    """NeMo-style JSONL (aed/data.py) -> Requests. Only `audio_filepath` is required: the task fields
    default to the arguments, per-line values win; `duration` defaults to the whole file; `text`
    (or `answer`) is a reference when present. Bad lines raise ValueError naming file, line and field."""
    base = os.path.dirname(os.path.abspath(manifest))
    out = []
    with open(manifest, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{manifest}:{lineno}"
            d = json_object(line, where)
            path = d.get("audio_filepath")
            if not isinstance(path, str) or not path:
                raise ValueError(f"{where}: field 'audio_filepath': missing or not a non-empty string")
            for key, lowest in (("offset", 0.0), ("duration", 1e-9)):
                v = d.get(key)
                if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v < lowest):
                    raise ValueError(f"{where}: field '{key}': must be a {'positive' if lowest else 'non-negative'} "
                                     f"number of seconds, got {v!r}")
            line_pnc = d.get("pnc", pnc)
            line_pnc = line_pnc.lower() if isinstance(line_pnc, str) else line_pnc
            if line_pnc not in PNC_VALUES:
                raise ValueError(f"{where}: field 'pnc': must be yes/no, got {d['pnc']!r}")
            text = d.get("text", d.get("answer"))
            out.append(make_request(
                path if os.path.isabs(path) else os.path.join(base, path),
                source_lang=d.get("source_lang", d.get("lang", source_lang)),
                target_lang=d.get("target_lang", d.get("lang", target_lang)),
                task=d.get("taskname", task), pnc=PNC_VALUES[line_pnc], where=where,
                offset=float(d.get("offset") or 0.0),
                duration=float(d["duration"]) if d.get("duration") is not None else None,
                text=text if isinstance(text, str) else None, fields=d))
    return out


def expand_inputs(specs: list[str]) -> list[str]:
    """Paths, directories (searched recursively for files with an audio extension soundfile knows)
    and glob patterns -> file paths. A pattern matching nothing is kept as is, so it is reported as
    "file not found" like any other missing path instead of vanishing."""
    audio_ext = {"." + ext.lower() for ext in sf.available_formats()} | {".opus"}
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

    def to_json(self) -> dict:
        """One --out JSONL line: the manifest's own fields, then ours."""
        r = self.request
        return {**r.fields, "audio_filepath": r.audio_filepath, "duration": round(self.duration, 3),
                "pred_text": self.pred_text if self.error is None else "", "source_lang": r.source_lang,
                "target_lang": r.target_lang, "pnc": "yes" if r.pnc else "no", "taskname": r.taskname,
                "decode_time": round(self.decode_time, 4), **({"error": self.error} if self.error else {})}


@dataclass
class Timings:
    audio: float = 0.0  # seconds of audio transcribed
    wall: float = 0.0  # seconds from the call to its return (model loading is not included)
    load_features: float = 0.0  # planning (headers, pause search), audio decoding, resampling, log-mel
    encoder: float = 0.0
    decoder: float = 0.0  # greedy or beam search, including the cross-attention K/V projection

    @property
    def rtfx(self) -> float:
        """Inverse real-time factor: seconds of audio per second of wall time."""
        return self.audio / self.wall if self.wall > 0 else math.nan


def score(results: list[Result]) -> dict:
    """Corpus WER (normalised and with punctuation/case) per ASR language and BLEU per AST pair,
    over the results that have a reference and did not fail: {"asr en": {"wer": .., "wer_pnc": .., "n": ..}}."""
    groups = {}
    for res in results:
        r = res.request
        if res.error is None and r.text is not None:
            key = f"asr {r.source_lang}" if r.taskname == "asr" else f"ast {r.source_lang}-{r.target_lang}"
            groups.setdefault(key, []).append((r.text, res.pred_text))
    out = {}
    for key, pairs in sorted(groups.items()):
        refs, hyps = [p[0] for p in pairs], [p[1] for p in pairs]
        if key.startswith("asr"):
            out[key] = {"wer": wer(refs, hyps), "wer_pnc": wer(refs, hyps, normalize=False), "n": len(pairs)}
        else:
            out[key] = {"bleu": bleu(refs, hyps), "n": len(pairs)}
    return out


# --- planning: durations and chunks -----------------------------------------------------------


def quiet_point(path: str, start: float, end: float, sample_rate: int) -> float:
    """Time (s) of the middle of the quietest QUIET_WINDOW of [start, end): a cut there rarely splits a word."""
    wav = load_audio(path, offset=start, duration=end - start, sample_rate=sample_rate)
    hop = sample_rate // 100  # 10 ms energy frames
    window = round(QUIET_WINDOW * 100)  # in frames
    if wav.numel() < hop * window:
        return end
    energy = wav[: wav.numel() // hop * hop].view(-1, hop).pow(2).mean(dim=1)  # (frames,)
    smooth = F.avg_pool1d(energy[None, None], window, stride=1)[0, 0]  # (frames - window + 1,)
    first = int(smooth.argmin())
    last = first  # digital silence ties over a stretch: cut in its middle, not at its edge
    while last + 1 < smooth.numel() and smooth[last + 1] == smooth[first]:
        last += 1
    return start + ((first + last) // 2 + window // 2) * hop / sample_rate


def plan_segments(req: Request, chunk_seconds: float, sample_rate: int) -> list[tuple[float, float | None, float]]:
    """(offset, duration or None = to the end, estimated seconds) pieces of one request."""
    if req.duration is not None:
        total = req.duration
    else:
        if not os.path.isfile(req.audio_filepath):
            raise AudioError(req.audio_filepath, "file not found")
        try:
            info = sf.info(req.audio_filepath)
        except (RuntimeError, ValueError) as e:  # sf.LibsndfileError is a RuntimeError
            raise AudioError(req.audio_filepath, f"cannot decode ({e})") from e
        total = info.frames / info.samplerate - req.offset
        if total <= 0:
            raise AudioError(req.audio_filepath, f"no audio after offset {req.offset}s ({info.frames} samples)")
    if total <= chunk_seconds:
        return [(req.offset, req.duration, total)]
    pieces, start, end = [], req.offset, req.offset + total
    while end - start > chunk_seconds:
        search_from = start + (1 - CUT_SEARCH) * chunk_seconds
        cut = quiet_point(req.audio_filepath, search_from, start + chunk_seconds, sample_rate)
        pieces.append((start, cut - start, cut - start))
        start = cut
    pieces.append((start, end - start if req.duration is not None else None, end - start))
    return pieces


# --- transcription ----------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # so each phase's wall time is its own, not queued work


@torch.inference_mode()
def transcribe(asr: LoadedModel, inputs: list, *, source_lang: str = "en", target_lang: str | None = None,
               task: str | None = None, pnc: bool = True, beam_size: int = 1, length_penalty: float = 0.0,
               max_delta: int = 50, max_new_tokens: int | None = None, batch_duration: float = 300.0,
               chunk_seconds: float = 40.0, dtype: torch.dtype | None = None,
               progress=None) -> tuple[list[Result], Timings]:
    """Transcribe/translate `inputs` (paths, directories, globs, or Requests) -> one Result each, in order.

    source_lang/target_lang/task/pnc apply to plain paths (Requests carry their own). beam_size 1 is
    greedy search; length_penalty is GNMT's alpha (0 ranks by log-probability); at most encoder
    frames + max_delta and `max_new_tokens` tokens are generated. batch_duration: padded seconds of
    audio per batch. chunk_seconds: longer inputs are cut at pauses (see the module docstring).
    dtype: torch.bfloat16 for bf16 autocast, None for fp32. progress(done_s, total_s) is called
    after every batch with seconds of audio.
    """
    t_start = time.perf_counter()
    model, tokenizer, device = asr.model, asr.tokenizer, asr.device
    sr = asr.features.sample_rate
    requests = []
    for item in inputs:
        if isinstance(item, Request):
            requests.append(item)
        else:
            requests += [make_request(p, source_lang, target_lang, task, pnc) for p in expand_inputs([os.fspath(item)])]
    results = [Result(r) for r in requests]
    prompts = []
    for r in requests:  # an unknown language is the caller's mistake: fail before any work
        try:
            prompts.append(tokenizer.prompt_ids(r.source_lang, r.target_lang, r.pnc,
                                                "transcribe" if r.taskname == "asr" else "translate"))
        except ValueError as e:
            raise ValueError(f"{r.where}: {e}") from None

    # Plan: (request index, offset, duration, estimated seconds) per segment.
    segments = []
    for i, r in enumerate(requests):
        try:
            segments += [(i, off, dur, est) for off, dur, est in plan_segments(r, chunk_seconds, sr)]
        except AudioError as e:
            results[i].error = e.reason
    # Sorted, not sampler.py's buckets: inference visits every segment once, in any order, so a global
    # sort gives the least padding there is; the sampler's shuffling, buffer and bins serve training.
    # Longest first: an out-of-memory batch shows up at once, not at the end of a long job.
    order = sorted(range(len(segments)), key=lambda k: -segments[k][3])
    batches, batch = [], []
    for k in order:  # padded seconds = batch size x longest (first) segment
        if batch and (len(batch) + 1) * segments[batch[0]][3] > batch_duration:
            batches.append(batch)
            batch = []
        batch.append(k)
    batches += [batch] if batch else []
    timings = Timings(load_features=time.perf_counter() - t_start)

    logmel = LogMel(asr.features).to(device).eval()
    amp = torch.autocast(device.type, dtype=dtype) if dtype is not None else nullcontext()
    pieces = [{} for _ in requests]  # per request: {segment index: (text, ids)}, joined in order at the end
    total_s, done_s = sum(s[3] for s in segments), 0.0
    for batch in batches:
        t0 = time.perf_counter()
        wavs, keep = [], []
        for k in batch:
            i, off, dur, _ = segments[k]
            if results[i].error is not None:  # another chunk of this file already failed
                continue
            try:
                wav = load_audio(requests[i].audio_filepath, off, dur, sr)
            except AudioError as e:
                results[i].error = e.reason
                continue
            if num_frames(wav.numel(), asr.features.hop_length) == 0:
                results[i].error = f"audio shorter than one feature frame ({wav.numel()} samples)"
                continue
            wavs.append(wav)
            keep.append(k)
        done_s += sum(segments[k][3] for k in batch)
        if not keep:
            timings.load_features += time.perf_counter() - t0
            if progress:
                progress(done_s, total_s)
            continue
        wav_lens = torch.tensor([w.numel() for w in wavs])
        wav = torch.zeros(len(wavs), int(wav_lens.max()))  # (B, S) zero padded
        for b, w in enumerate(wavs):
            wav[b, : w.numel()] = w
        feats, feat_lens = logmel(wav.to(device), wav_lens.to(device))  # (B, T, F), (B,)
        prompt = [prompts[segments[k][0]] for k in keep]
        if len({len(p) for p in prompt}) > 1:
            raise ValueError(f"prompts of different lengths {sorted({len(p) for p in prompt})} in one batch; "
                             f"prompt format {tokenizer.prompt_format!r} must give equal-length prompts")
        prompt = torch.tensor(prompt, dtype=torch.long, device=device)  # (B, P)
        _sync(device)
        t1 = time.perf_counter()
        with amp:
            memory, memory_lens = model.encode(feats, feat_lens)  # (B, T', D), (B,)
        _sync(device)
        t2 = time.perf_counter()
        with amp:
            if beam_size == 1:
                hyps = greedy_search(model, memory, memory_lens, prompt, tokenizer.eos, max_delta, max_new_tokens)
            else:
                hyps = beam_search(model, memory, memory_lens, prompt, tokenizer.eos, beam_size,
                                   length_penalty, max_delta, max_new_tokens)
        _sync(device)
        t3 = time.perf_counter()
        timings.load_features += t1 - t0
        timings.encoder += t2 - t1
        timings.decoder += t3 - t2
        for b, (k, ids) in enumerate(zip(keep, hyps)):
            i = segments[k][0]
            # The model's vocabulary is padded to a multiple of 8; ids past the tokenizer's are not text.
            pieces[i][k] = (tokenizer.decode([t for t in ids if t < tokenizer.vocab_size]), ids)
            results[i].duration += wavs[b].numel() / sr
            results[i].decode_time += (t3 - t0) * wavs[b].numel() / int(wav_lens.sum())
        if progress:
            progress(done_s, total_s)

    for i, res in enumerate(results):
        if res.error is None:
            ordered = [pieces[i][k] for k in sorted(pieces[i])]
            res.pred_text = " ".join(text for text, _ in ordered if text)
            res.tokens = [t for _, ids in ordered for t in ids]
            timings.audio += res.duration
    timings.wall = time.perf_counter() - t_start
    return results, timings
