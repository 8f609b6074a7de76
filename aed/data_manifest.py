"""Manifests: JSONL lines -> checked Utterances, and the count of everything skipped (`Faults`).

A manifest is NeMo-style JSONL, one utterance per line:

    {"audio_filepath": "audio/en_0001.flac", "duration": 2.41, "text": "Hello there.",
     "source_lang": "en", "target_lang": "en", "pnc": "yes", "taskname": "asr"}

- `audio_filepath`: absolute, or relative to the manifest's folder.
- `duration` (s); optional `offset` (s) when the utterance is a segment of a longer file.
- `text`: the target (transcript for ASR, translation for AST); `answer` is accepted as an alias
  because NeMo's Canary manifests use it.
- `source_lang`, `target_lang` (`lang` sets both when they are absent); `pnc` yes/no (default yes);
  `taskname` asr/ast, derived from the languages when absent.

Every manifest is read by `read_rows` (plain or .gz; training, validation, bin estimation,
tokenizer training, inference), which hands each line's object to a parser: `parse_fields`
(training: the fields above), `request_fields` (inference: only `audio_filepath` is required),
`text_and_task` (tokenizer training: the text and its languages).

Bad lines (malformed JSON or fields, bytes that are not UTF-8) raise `ManifestError` naming file,
line and field; with `skip_invalid=True` they are skipped with a warning per line and counted in a
`Faults` (the one count of everything skipped, by kind), never silently. Two checks need more than
the line: `aed.data_batch.encodable` (a language the tokenizer lacks) and `check_audio`
(unreadable audio, a duration the file's header contradicts; every audio is checked by the same
rule again when decoded, `aed.data_batch.decode_audio`).
"""

import gzip
import json
import logging
import os
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterator, NoReturn

from aed.data_audio import AudioError, audio_seconds

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
    weight: float = 1.0  # training: expected copies per pass, drawn anew each pass (aed/data_mixing.py)
    token_ids: bytes | None = None  # prompt + text + EOS ids as array("i") bytes, once `encodable` counted them
    prompt_len: int = 0  # of token_ids

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


def parse_line(line: str | bytes, where: str, base_dir: str, needs_text: bool = True) -> Utterance:
    """A training manifest line -> Utterance (`parse_fields` of its JSON object)."""
    return parse_fields(json_object(line, where), where, base_dir, needs_text)


def parse_fields(d: dict, where: str, base_dir: str, needs_text: bool = True) -> Utterance:
    """A training manifest line's object -> Utterance: every field but `offset` is required.
    needs_text=False (self-supervised training) reads audio-only lines: audio_filepath and duration;
    text and task fields become empty defaults and are not checked."""
    path = audio_path(d, where, base_dir)
    duration = seconds(d, "duration", where, positive=True, required=True)
    offset = seconds(d, "offset", where, positive=False)
    if not needs_text:
        return Utterance(path, duration, "", "", "", True, "asr", offset or 0.0, where, segment=offset is not None)
    text, *task = text_and_task(d, where)
    return Utterance(path, duration, text, *task, offset or 0.0, where, segment=offset is not None)


def nonspeech_fields(d: dict, where: str, base_dir: str) -> Utterance:
    """A non-speech manifest line's object (noise, music, silence: `train.manifests` entries with
    nonspeech: true) -> Utterance with an empty text. audio_filepath, duration and offset follow the
    training rules; a `text` (or `answer`) must be empty or absent, as the model learns to say nothing.
    The prompt's fields (source_lang / target_lang or lang, pnc, taskname) are checked when the line
    names a language, else left empty ("") for the caller to choose (aed/data_mixing.py)."""
    path = audio_path(d, where, base_dir)
    duration = seconds(d, "duration", where, positive=True, required=True)
    offset = seconds(d, "offset", where, positive=False)
    text = reference_text(d)
    if text is not None and (not isinstance(text, str) or text.strip()):
        fail(where, "text", f"a non-speech line has no transcript (empty or absent), got {text!r}")
    source_lang, target_lang = languages(d)
    task = ("", "", True, "asr") if source_lang is None and target_lang is None else \
        check_task(where, source_lang, target_lang, d.get("pnc", "yes"), d.get("taskname"))
    return Utterance(path, duration, "", *task, offset or 0.0, where, segment=offset is not None)


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
    """duration, offset, segment, text, source_lang, target_lang, pnc, taskname of a row with manifest
    keys (`answer` and `lang` accepted as in NeMo's manifests; segment: the row gave an offset, so its
    audio may hold more than this utterance). Raises ManifestError naming `where`."""
    duration = seconds(d, "duration", where, positive=True, required=True)
    offset = seconds(d, "offset", where, positive=False)
    text, source_lang, target_lang, pnc, taskname = text_and_task(d, where)
    return {"duration": duration, "offset": offset or 0.0, "segment": offset is not None, "text": text,
            "source_lang": source_lang, "target_lang": target_lang, "pnc": pnc, "taskname": taskname}


DURATION_TOLERANCE = 0.1  # the default of train.duration_tolerance: a duration further than this fraction is wrong
AUDIO_LENGTH = "audio length disagrees with the duration"  # starts the reason of such an AudioError


class Faults:
    """What a reader skipped, counted by kind; each (kind, where) is counted and logged once, however
    many passes meet it again (an infinite run rereads a bad shard every pass, validation its sets).
    One object per reader (a manifest, a streamed source, the batches of a run); `summary` is the
    one line that says what was skipped, and `merged` adds several up for a report."""

    KINDS = ("bad_shard", "bad_example", "undecodable", "unreadable_audio", "audio_length", "member_without_row",
             "row_without_member", "invalid_row", "not_encodable")

    def __init__(self):
        self.counts = Counter()
        self.seen = {}  # (kind, where) -> why, in the order met

    def skip(self, kind: str, where: str, why: str, context: str = "", quiet: bool = False) -> bool:
        """Count and log (unless `quiet`: the caller logs) a skipped `where`; False (and nothing done)
        when it was met before."""
        assert kind in self.KINDS, kind
        if (kind, where) in self.seen:
            return False
        self.seen[(kind, where)] = why
        self.counts[kind] += 1
        if not quiet:
            log.warning("%sskipped %s: %s (%s)", f"{context}: " if context else "", where, why, kind.replace("_", " "))
        return True

    def fields(self, d: dict, where: str) -> dict | None:
        """example_fields(d, where), or None after counting the row as invalid."""
        try:
            return example_fields(d, where)
        except ManifestError as e:
            self.skip("invalid_row", where, str(e).removeprefix(f"{where}: "))
            return None

    def report(self, errors: list[str], context: str) -> None:
        """Count the items a batch dropped (`Batch.errors`, "where: why"), each logged once;
        context: training or validation."""
        for err in errors:
            kind = "audio_length" if AUDIO_LENGTH in err else "unreadable_audio"
            if self.skip(kind, err, err, quiet=True):
                log.warning("%s: skipped %s (logged once per run): %s", context,
                            "audio whose length disagrees with its duration" if kind == "audio_length"
                            else "unreadable audio", err)

    def summary(self) -> str:
        """"2 invalid row, 1 audio length", or "" when nothing was skipped."""
        return ", ".join(f"{n:,} {kind.replace('_', ' ')}" for kind, n in sorted(self.counts.items()) if n)

    @staticmethod
    def merged(*faults) -> Counter:
        """The counts of several Faults (None entries ignored) added up by kind."""
        total = Counter()
        for f in faults:
            if f is not None:
                total.update(f.counts)
        return total


def read_rows(path: str, parse, skip_invalid: bool = False, faults: Faults | None = None) -> Iterator:
    """The one manifest-line reader: parse(d, where, base_dir) of every non-blank line's JSON object
    (d) in order, gzip-compressed when the name ends in .gz, streamed. A line that is not UTF-8 or
    JSON, or whose parse raises ManifestError (naming file:line and field), raises, or with
    `skip_invalid` is counted in `faults` (kind invalid_row, each line logged) and left out; the
    count is logged in one line at the end. Training, validation, bin estimation, tokenizer
    training and inference all read manifests through it."""
    base_dir = os.path.dirname(os.path.abspath(path))
    own = Faults() if faults is None else faults
    before = own.counts["invalid_row"]
    for where, line in manifest_lines(path):
        try:
            yield parse(json_object(line, where), where, base_dir)
        except ManifestError as e:
            if not skip_invalid:
                raise
            own.skip("invalid_row", where, str(e).removeprefix(f"{where}: "), "skipping invalid manifest line")
    if skipped := own.counts["invalid_row"] - before:
        log.warning("%s: skipped %d invalid line(s)", path, skipped)


def request_fields(d: dict, where: str, base_dir: str, source_lang=None, target_lang=None, task=None,
                   pnc=None) -> dict:
    """The lenient reading of a line, for inference: only `audio_filepath` is required. Returns
    {audio_filepath (resolved), offset (0.0 when absent), duration (None: the whole file), source_lang,
    target_lang (`lang` alias, then the arguments), taskname, pnc (the line's, else the arguments;
    unchecked: `check_task` checks them), text (`text` or `answer` when a string, else None), segment}."""
    path = audio_path(d, where, base_dir)
    offset = seconds(d, "offset", where, positive=False)
    src, tgt = languages(d, source_lang, target_lang)
    text = reference_text(d)
    return {"audio_filepath": path, "offset": offset or 0.0, "segment": offset is not None,
            "duration": seconds(d, "duration", where, positive=True), "source_lang": src, "target_lang": tgt,
            "taskname": d.get("taskname", task), "pnc": d.get("pnc", pnc),
            "text": text if isinstance(text, str) else None}


def iter_texts(paths: list[str], skip_invalid: bool = False, faults: Faults | None = None) -> Iterator[tuple]:
    """(text, source_lang, target_lang) of every line of every manifest, checked by training's rules
    for those fields (`text_and_task`): what a tokenizer is trained on. Lines need no audio fields.
    A line with an empty transcript has nothing to learn from: left out (counted as invalid_row)."""
    own = Faults() if faults is None else faults

    def parse(d, where, _):
        text = reference_text(d)
        if isinstance(text, str) and not text.strip():
            own.skip("invalid_row", where, "empty transcript", quiet=True)
            return None
        return text_and_task(d, where)[:3]

    for path in paths:
        yield from (t for t in read_rows(path, parse, skip_invalid, own) if t is not None)


def iter_manifest(path: str, skip_invalid: bool = False, needs_text: bool = True,
                  faults: Faults | None = None) -> Iterator[Utterance]:
    """Stream a manifest's utterances (`read_rows` + `parse_line`). A bad line raises ManifestError,
    or with `skip_invalid` is logged and counted in `faults`. A manifest where no line has a
    transcript is an audio-only one: with needs_text it raises ManifestError naming its first line
    and `text` even with `skip_invalid`, as skipping every line would leave nothing to train on."""
    kept = 0
    first_text_error = None

    def parse(d, where, base_dir):
        nonlocal first_text_error
        try:
            return parse_fields(d, where, base_dir, needs_text)
        except ManifestError as e:
            if first_text_error is None and "field 'text'" in str(e):
                first_text_error = e
            raise

    for utt in read_rows(path, parse, skip_invalid, faults):
        kept += 1
        yield utt
    if not kept and first_text_error is not None:
        raise ManifestError(f"{first_text_error}; no line of {path} has a transcript: an audio-only manifest "
                            "trains objective=ssl only") from None


def read_manifest(path: str, skip_invalid: bool = False, needs_text: bool = True,
                  faults: Faults | None = None) -> list[Utterance]:
    return list(iter_manifest(path, skip_invalid, needs_text, faults))


# --- audio headers ------------------------------------------------------------------------------


def header_seconds(path: str) -> float | str:
    """A file's duration from its header (`aed.data_audio.audio_seconds`: soundfile, else ffprobe),
    or why it has none."""
    try:
        return audio_seconds(path)
    except AudioError as e:
        return f"unreadable audio ({e.reason[:160]})"
    except Exception as e:  # noqa: BLE001 - missing, unreadable, not audio: all mean "skip this file"
        return f"unreadable audio ({type(e).__name__}: {str(e)[:120]})"


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


