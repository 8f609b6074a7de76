"""Manifests, dataset items, batching by duration and the padded batch.

A manifest is NeMo-style JSONL, one utterance per line:

    {"audio_filepath": "audio/en_0001.flac", "duration": 2.41, "text": "Hello there.",
     "source_lang": "en", "target_lang": "en", "pnc": "yes", "taskname": "asr"}

- `audio_filepath`: absolute, or relative to the manifest's folder.
- `duration` (s); optional `offset` (s) when the utterance is a segment of a longer file.
- `text`: the target (transcript for ASR, translation for AST); `answer` is accepted as an alias
  because NeMo's Canary manifests use it.
- `source_lang`, `target_lang` (`lang` sets both when they are absent); `pnc` yes/no (default yes);
  `taskname` asr/ast, derived from the languages when absent.

Bad lines (malformed JSON or fields, bytes that are not UTF-8) raise `ManifestError` naming file,
line and field; with `skip_invalid=True` they are skipped with a warning per line and a count,
never silently. Two checks need more than the line: `encodable` (a language the tokenizer lacks)
and `check_audio` (unreadable audio, a duration the file's header contradicts). Inference
(aed/decode_transcribe.py) reads the same fields with the same checks, but needs only `audio_filepath`.
"""

import gzip
import json
import logging
import os
import signal
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterator, NoReturn

import soundfile as sf
import torch
import torchaudio
from torch.utils.data import Dataset

from aed.data_audio import AudioError, LogMel, load_audio

log = logging.getLogger(__name__)

TASK_ALIASES = {"asr": "asr", "transcribe": "asr", "ast": "ast", "s2t_translation": "ast",
                "translate": "ast"}
PROMPT_TASKS = {"asr": "transcribe", "ast": "translate"}  # our taskname -> the tokenizer's prompt task
PNC_VALUES = {"yes": True, "true": True, True: True, "no": False, "false": False, False: False}


class ManifestError(ValueError):
    pass


@dataclass(frozen=True)
class Utterance:
    audio_filepath: str  # resolved: absolute, or as given when the manifest used an absolute path
    duration: float
    text: str
    source_lang: str
    target_lang: str
    pnc: bool
    taskname: str  # "asr" or "ast"
    offset: float = 0.0
    where: str = ""  # "manifest.jsonl:17", for error messages
    segment: bool = False  # the line gave an offset: a part of the file, so its duration may be shorter
    speed: float = 1.0  # speed perturbation (training): played this many times faster, and shorter

    @property
    def perturbed_duration(self) -> float:
        """Seconds of audio the model sees: what bucketing and batch sizes are measured on."""
        return self.duration / self.speed


# --- manifest fields: one set of rules for training (strict) and inference (lenient) ---------


def fail(where: str, field: str, why: str) -> NoReturn:
    raise ManifestError(f"{where}: field '{field}': {why}")


def json_object(line: bytes | str, where: str) -> dict:
    if isinstance(line, bytes):  # decoded per line, so one bad byte costs one line, not the file
        try:
            line = line.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ManifestError(f"{where}: not UTF-8 (byte {line[e.start]:#04x} at column {e.start + 1})") from None
    try:
        d = json.loads(line)
    except json.JSONDecodeError as e:
        raise ManifestError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(d, dict):
        raise ManifestError(f"{where}: expected a JSON object, got {type(d).__name__}")
    return d


def manifest_lines(path: str) -> Iterator[tuple[str, bytes]]:
    """("path:lineno", line) per non-blank line, streamed: a manifest may be larger than memory
    (gzip-compressed when the name ends in .gz). Lines stay bytes until `json_object` decodes them,
    which names a line that is not UTF-8."""
    with (gzip.open if path.endswith(".gz") else open)(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                yield f"{path}:{lineno}", line


def audio_path(d: dict, where: str, base_dir: str) -> str:
    """`audio_filepath`, resolved against the manifest's folder when relative."""
    path = d.get("audio_filepath")
    if not isinstance(path, str) or not path:
        fail(where, "audio_filepath", "missing or not a non-empty string")
    return path if os.path.isabs(path) else os.path.join(base_dir, path)


def seconds(d: dict, key: str, where: str, positive: bool, required: bool = False) -> float | None:
    """d[key] as seconds (`duration` > 0, `offset` >= 0); None when absent and not required."""
    value = d.get(key)
    if value is None and not required:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value > 0 if positive else value >= 0):
        fail(where, key, f"must be a {'positive' if positive else 'non-negative'} number of seconds, got {value!r}")
    return float(value)


def reference_text(d: dict):
    """`text`, or NeMo Canary's `answer` when there is no `text`; unchecked."""
    return d["text"] if "text" in d else d.get("answer")


def languages(d: dict, source_lang=None, target_lang=None) -> tuple:
    """(source_lang, target_lang) of a line; `lang` sets both when they are absent, then the defaults."""
    return d.get("source_lang", d.get("lang", source_lang)), d.get("target_lang", d.get("lang", target_lang))


def check_task(where: str, source_lang, target_lang, pnc, taskname) -> tuple[str, str, bool, str]:
    """Validated task fields: language codes, pnc yes/no -> bool, taskname asr/ast (an alias is mapped;
    None means asr iff the languages agree). ManifestError names `where` and the field."""
    for field, value in (("source_lang", source_lang), ("target_lang", target_lang)):
        if not isinstance(value, str) or not value:
            fail(where, field, f"missing or not a language code, got {value!r}")
    flag = pnc.lower() if isinstance(pnc, str) else pnc
    if flag not in PNC_VALUES:
        fail(where, "pnc", f"must be yes/no, got {pnc!r}")
    if taskname is None:
        taskname = "asr" if source_lang == target_lang else "ast"
    elif taskname not in TASK_ALIASES:
        fail(where, "taskname", f"must be one of {sorted(TASK_ALIASES)}, got {taskname!r}")
    taskname = TASK_ALIASES[taskname]
    if taskname == "asr" and source_lang != target_lang:
        fail(where, "taskname", f"'asr' needs source_lang == target_lang, got {source_lang} -> {target_lang}")
    return source_lang, target_lang, PNC_VALUES[flag], taskname


def parse_line(line: str, where: str, base_dir: str, needs_text: bool = True) -> Utterance:
    """A training manifest line -> Utterance: every field but `offset` is required. needs_text=False
    (self-supervised training) reads audio-only lines: audio_filepath and duration; text and task
    fields become empty defaults and are not checked."""
    d = json_object(line, where)
    path = audio_path(d, where, base_dir)
    duration = seconds(d, "duration", where, positive=True, required=True)
    offset = seconds(d, "offset", where, positive=False)
    if not needs_text:
        return Utterance(path, duration, "", "", "", True, "asr", offset or 0.0, where, segment=offset is not None)
    text, *task = text_and_task(d, where)
    return Utterance(path, duration, text, *task, offset or 0.0, where, segment=offset is not None)


def text_and_task(d: dict, where: str) -> tuple[str, str, str, bool, str]:
    """(text, source_lang, target_lang, pnc, taskname) of a line, checked; shared with the readers
    of other formats (aed/data_sources.py), so every format follows the manifest's rules."""
    text = reference_text(d)
    if not isinstance(text, str):
        fail(where, "text", "missing (neither 'text' nor 'answer') or not a string")
    if not text.strip():
        fail(where, "text", "empty transcript")
    return (text, *check_task(where, *languages(d), d.get("pnc", "yes"), d.get("taskname")))


def example_fields(d: dict, where: str) -> dict:
    """duration, offset, text, source_lang, target_lang, pnc, taskname of a row with manifest keys
    (`answer` and `lang` accepted as in NeMo's manifests). Raises ManifestError naming `where`."""
    duration = seconds(d, "duration", where, positive=True, required=True)
    offset = seconds(d, "offset", where, positive=False) or 0.0
    text, source_lang, target_lang, pnc, taskname = text_and_task(d, where)
    return {"duration": duration, "offset": offset, "text": text, "source_lang": source_lang,
            "target_lang": target_lang, "pnc": pnc, "taskname": taskname}


class Faults:
    """Skipped data of one source, counted by kind; each (kind, where) is counted and logged once,
    however many passes meet it again (an infinite run rereads a bad shard every pass)."""

    KINDS = ("bad_shard", "undecodable", "member_without_row", "row_without_member", "invalid_row")

    def __init__(self):
        self.counts = Counter()
        self.seen = {}  # (kind, where) -> why, in the order met

    def skip(self, kind: str, where: str, why: str) -> None:
        assert kind in self.KINDS, kind
        if (kind, where) in self.seen:
            return
        self.seen[(kind, where)] = why
        self.counts[kind] += 1
        log.warning("skipped %s (%s): %s", where, kind.replace("_", " "), why)

    def fields(self, d: dict, where: str) -> dict | None:
        """example_fields(d, where), or None after counting the row as invalid."""
        try:
            return example_fields(d, where)
        except ManifestError as e:
            self.skip("invalid_row", where, str(e).removeprefix(f"{where}: "))
            return None


def iter_manifest(path: str, skip_invalid: bool = False, needs_text: bool = True) -> Iterator[Utterance]:
    """Stream a manifest's utterances. A bad line raises ManifestError, or with `skip_invalid` is
    logged and counted. Blank lines are ignored. A manifest where no line has a transcript is an
    audio-only one: with needs_text it raises ManifestError naming its first line and `text` even
    with `skip_invalid`, as skipping every line would leave nothing to train on."""
    base_dir = os.path.dirname(os.path.abspath(path))
    skipped = kept = 0
    first_text_error = None
    for where, line in manifest_lines(path):
        try:
            yield parse_line(line, where, base_dir, needs_text)
            kept += 1
        except ManifestError as e:
            if first_text_error is None and "field 'text'" in str(e):
                first_text_error = e
            if not skip_invalid:
                raise
            skipped += 1
            log.warning("skipping invalid manifest line: %s", e)
    if not kept and first_text_error is not None:
        raise ManifestError(f"{first_text_error}; no line of {path} has a transcript: an audio-only manifest "
                            "trains objective=ssl only") from None
    if skipped:
        log.warning("%s: skipped %d invalid line(s)", path, skipped)


def read_manifest(path: str, skip_invalid: bool = False, needs_text: bool = True) -> list[Utterance]:
    return list(iter_manifest(path, skip_invalid, needs_text))


# --- dataset items ------------------------------------------------------------------------------


def encode_utterance(tokenizer, utt: Utterance) -> tuple[list[int], int]:
    """Prompt + target text + EOS token ids, and the prompt length."""
    return tokenizer.encode_example(utt.text, utt.source_lang, utt.target_lang, utt.pnc,
                                    task=PROMPT_TASKS[utt.taskname])


def encodable(utts: list[Utterance], tokenizer, skip_invalid: bool) -> tuple[list[Utterance], list[int]]:
    """The utterances `tokenizer` can encode, and their token counts (prompt + text + EOS).

    The manifest checks cannot know the tokenizer: a language it lacks (or a task its prompt
    format cannot express) shows up here. That raises ManifestError naming the manifest line,
    or with `skip_invalid` is logged per line and counted per manifest."""
    kept, num_tokens, skipped = [], [], Counter()
    for u in utts:
        try:
            num_tokens.append(len(encode_utterance(tokenizer, u)[0]))
        except (ValueError, KeyError) as e:
            if not skip_invalid:
                raise ManifestError(f"{u.where}: {e}") from None
            log.warning("skipping manifest line: %s: %s", u.where, e)
            skipped[u.where.rsplit(":", 1)[0]] += 1
            continue
        kept.append(u)
    for path, n in skipped.items():
        log.warning("%s: skipped %d line(s) the tokenizer cannot encode", path, n)
    return kept, num_tokens


# --- audio headers ------------------------------------------------------------------------------


def header_seconds(path: str) -> float | str:
    """A file's duration from its header (no decoding), or why it has none. sf.SoundFile, not
    sf.info: info also formats a description of the file and takes 1.7x as long."""
    try:
        with sf.SoundFile(path) as f:
            frames, rate = f.frames, f.samplerate
    except Exception as e:  # noqa: BLE001 - missing, unreadable, not audio: all mean "skip this file"
        return f"unreadable audio ({type(e).__name__}: {str(e)[:120]})"
    if frames <= 0 or rate <= 0:
        return "unreadable audio (no samples in the header)"
    return frames / rate


def check_audio(utts: list[Utterance], tolerance: float, part: int = 0, parts: int = 1,
                threads: int = 16) -> list[tuple[int, str]]:
    """(index, reason) for each utterance whose audio is unreadable or whose manifest duration
    disagrees with the file's header by more than `tolerance` (a fraction): a whole file must
    last `duration`, a segment (a line with an offset) must end inside the file. A wrong duration
    would silently cut the audio under a full transcript, or give the sampler a wrong bucket.

    Only headers are read, each file once, in `threads` threads (the time is file-system latency,
    not CPU). `part` of `parts`: this caller checks only every parts-th file, so DDP ranks can
    share the work and exchange their (short) lists of problems."""
    by_path = {}
    for i, u in enumerate(utts):
        by_path.setdefault(u.audio_filepath, []).append(i)
    paths = sorted(by_path)[part::parts]
    with ThreadPoolExecutor(threads) as pool:
        headers = pool.map(header_seconds, paths, chunksize=64)
        problems = []
        for path, header in zip(paths, headers):
            for i in by_path[path]:
                u = utts[i]
                if isinstance(header, str):
                    problems.append((i, header))
                elif u.segment and u.offset + u.duration > header + tolerance * u.duration:
                    problems.append((i, f"segment {u.offset:.2f}+{u.duration:.2f} s ends past the audio's "
                                        f"{header:.2f} s"))
                elif not u.segment and abs(u.duration - header) > tolerance * header:
                    problems.append((i, f"duration {u.duration:.2f} s, but the audio lasts {header:.2f} s"))
    return problems


def make_item(wav: torch.Tensor, utt: Utterance, index: int, tokenizer, logmel: LogMel, seed: int = 0) -> dict:
    """One utterance's audio (S,) -> the item every dataset returns, which `Collate` pads:

        {"feats": (T, F), "tokens": prompt + text + EOS ids, "prompt_len", "transcribed", "audio_filepath", "index"}

    (tokenizer None: no tokens and prompt_len 0, for training on audio alone; transcribed: the text
    is the spoken words, not a translation), or
    {"error", "audio_filepath"} when the audio is shorter than one frame. Features are per
    utterance (normalisation uses only its frames), so this is exactly what the batched `LogMel`
    gives. Dither noise is seeded by (seed, index): a resumed run sees the same features whichever
    DataLoader worker loads the utterance.
    """
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed * 1_000_003 + index)
        feats, feat_lens = logmel(wav[None], torch.tensor([wav.numel()]))
    if feat_lens[0] == 0:
        return {"error": f"{utt.where}: audio shorter than one frame", "audio_filepath": utt.audio_filepath}
    tokens, prompt_len = encode_utterance(tokenizer, utt) if tokenizer is not None else ([], 0)
    return {"feats": feats[0, : feat_lens[0]], "tokens": tokens, "prompt_len": prompt_len,
            "transcribed": utt.taskname == "asr", "audio_filepath": utt.audio_filepath, "index": index}


class UtteranceDataset(Dataset):
    """Map-style dataset over manifest utterances: index -> `make_item`, computed in DataLoader
    workers. An unreadable audio file does not crash the epoch: the item comes back as
    `{"error": ...}` and `Collate` reports it."""

    def __init__(self, utterances: list[Utterance], tokenizer, logmel: LogMel, seed: int = 0):
        self.utterances = utterances
        self.tokenizer = tokenizer
        self.logmel = logmel
        self.seed = seed

    def __len__(self):
        return len(self.utterances)

    def __getitem__(self, i: int) -> dict:
        utt = self.utterances[i]
        try:
            wav = load_audio(utt.audio_filepath, offset=utt.offset, duration=utt.duration,
                             sample_rate=self.logmel.cfg.sample_rate)
        except AudioError as e:
            return {"error": f"{utt.where}: {e}", "audio_filepath": utt.audio_filepath}
        if utt.speed != 1.0:
            wav = perturb_speed(wav, utt.speed)
        return make_item(wav, utt, i, self.tokenizer, self.logmel, self.seed)


def perturb_speed(wav: torch.Tensor, factor: float) -> torch.Tensor:
    """(S,) -> (~S / factor,): the recording played `factor` times faster, tempo and pitch together
    (Ko et al., 2015), by resampling it as if it had been recorded at factor x the sample rate."""
    return torchaudio.functional.resample(wav, round(100 * factor), 100)


# --- batches ------------------------------------------------------------------------------------


def duration_batches(durations: list[float], max_padded_seconds: float) -> list[list[int]]:
    """Indices of `durations` cut into batches of at most `max_padded_seconds` padded seconds
    (batch size x longest member); every index lands in exactly one batch, and one longer than
    the budget gets a batch of its own.

    For passes that visit every utterance once in any order (inference, validation): a global sort
    gives the least padding there is, where training needs sampler.py's shuffled buckets. Longest
    first, so an out-of-memory batch shows up at once, not at the end of a long job.
    """
    batches, batch = [], []
    for i in sorted(range(len(durations)), key=lambda i: -durations[i]):
        if batch and (len(batch) + 1) * durations[batch[0]] > max_padded_seconds:
            batches.append(batch)
            batch = []
        batch.append(i)
    return (batches + [batch]) if batch else batches


@dataclass
class Batch:
    feats: torch.Tensor        # (B, T, F) zero padded
    feat_lens: torch.Tensor    # (B,)
    tokens: torch.Tensor       # (B, U) prompt + text + EOS, right padded with pad_id
    token_lens: torch.Tensor   # (B,)
    prompt_lens: torch.Tensor  # (B,)
    paths: list[str]
    indices: list[int]
    errors: list[str]          # items dropped from this batch (unreadable audio), with reasons
    transcribed: torch.Tensor | None = None  # (B,) bool: the text is the spoken words (ASR, not AST); None: every row

    def __len__(self):
        return len(self.paths)

    def to(self, device, non_blocking: bool = False) -> "Batch":
        kw = {"device": device, "non_blocking": non_blocking}
        return Batch(self.feats.to(**kw), self.feat_lens.to(**kw), self.tokens.to(**kw),
                     self.token_lens.to(**kw), self.prompt_lens.to(**kw), self.paths,
                     self.indices, self.errors, None if self.transcribed is None else self.transcribed.to(**kw))

    def pin_memory(self) -> "Batch":  # called by DataLoader(pin_memory=True)
        return Batch(self.feats.pin_memory(), self.feat_lens, self.tokens.pin_memory(),
                     self.token_lens, self.prompt_lens, self.paths, self.indices, self.errors, self.transcribed)


class Collate:
    """Pads a list of dataset items into a `Batch`; items that failed to load are reported."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, items: list[dict]) -> Batch:
        errors = [it["error"] for it in items if "error" in it]
        items = [it for it in items if "error" not in it]
        n_mels = items[0]["feats"].shape[1] if items else 0
        feat_lens = torch.tensor([it["feats"].shape[0] for it in items], dtype=torch.long)
        token_lens = torch.tensor([len(it["tokens"]) for it in items], dtype=torch.long)
        max_t, max_u = (int(feat_lens.max()), int(token_lens.max())) if items else (0, 0)
        feats = torch.zeros(len(items), max_t, n_mels)  # (B, T, F)
        tokens = torch.full((len(items), max_u), self.pad_id, dtype=torch.long)  # (B, U)
        for b, it in enumerate(items):
            feats[b, : feat_lens[b]] = it["feats"]
            tokens[b, : token_lens[b]] = torch.tensor(it["tokens"], dtype=torch.long)
        prompt_lens = torch.tensor([it["prompt_len"] for it in items], dtype=torch.long)
        transcribed = torch.tensor([it["transcribed"] for it in items], dtype=torch.bool)
        return Batch(feats, feat_lens, tokens, token_lens, prompt_lens,
                     [it["audio_filepath"] for it in items], [it["index"] for it in items], errors, transcribed)


class UnreadableAudio:
    """The unreadable audio files a run has met, each logged once: the sampler draws a bad file
    again every pass, and validation reads its manifests again every time."""

    def __init__(self):
        self.seen = set()

    def report(self, errors: list[str], where: str) -> None:
        """Log the errors of a batch (`Batch.errors`) not logged before; `where`: training or validation."""
        for err in sorted(set(errors) - self.seen):
            log.warning("%s: skipped unreadable audio (logged once per run): %s", where, err)
            self.seen.add(err)


def ignore_stop_signals(worker_id: int) -> None:
    """DataLoader worker_init_fn. Cluster schedulers signal every process of the job, workers
    included; the trainer must outlive its workers long enough to save a checkpoint, and it
    shuts them down itself (train.py, stop_workers)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
