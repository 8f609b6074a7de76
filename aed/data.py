"""Manifests, the utterance dataset and the padded batch.

A manifest is NeMo-style JSONL, one utterance per line:

    {"audio_filepath": "audio/en_0001.flac", "duration": 2.41, "text": "Hello there.",
     "source_lang": "en", "target_lang": "en", "pnc": "yes", "taskname": "asr"}

- `audio_filepath`: absolute, or relative to the manifest's folder.
- `duration` (s); optional `offset` (s) when the utterance is a segment of a longer file.
- `text`: the target (transcript for ASR, translation for AST); `answer` is accepted as an alias
  because NeMo's Canary manifests use it.
- `source_lang`, `target_lang` (`lang` sets both when they are absent); `pnc` yes/no (default yes);
  `taskname` asr/ast, derived from the languages when absent.

Bad lines raise `ManifestError` naming file, line and field; with `skip_invalid=True` they are
skipped with a warning per line and a count, never silently.
"""

import json
import logging
import os
import signal
from dataclasses import dataclass
from typing import Iterator

import torch
from torch.utils.data import Dataset

from aed.audio import AudioError, LogMel, load_audio

log = logging.getLogger(__name__)

TASK_ALIASES = {"asr": "asr", "transcribe": "asr", "ast": "ast", "s2t_translation": "ast",
                "translate": "ast"}
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


def json_object(line: str, where: str) -> dict:
    try:
        d = json.loads(line)
    except json.JSONDecodeError as e:
        raise ManifestError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(d, dict):
        raise ManifestError(f"{where}: expected a JSON object, got {type(d).__name__}")
    return d


def parse_line(line: str, where: str, base_dir: str) -> Utterance:
    """One manifest line -> Utterance; ManifestError names `where` and the field on bad input."""
    def fail(field, why):
        raise ManifestError(f"{where}: field '{field}': {why}")

    d = json_object(line, where)
    path = d.get("audio_filepath")
    if not isinstance(path, str) or not path:
        fail("audio_filepath", "missing or not a non-empty string")
    if not os.path.isabs(path):
        path = os.path.join(base_dir, path)

    duration = d.get("duration")
    if isinstance(duration, bool) or not isinstance(duration, (int, float)) or not duration > 0:
        fail("duration", f"must be a positive number of seconds, got {duration!r}")
    offset = d.get("offset", 0.0)
    if isinstance(offset, bool) or not isinstance(offset, (int, float)) or offset < 0:
        fail("offset", f"must be a non-negative number of seconds, got {offset!r}")

    text = d["text"] if "text" in d else d.get("answer")
    if not isinstance(text, str):
        fail("text", "missing (neither 'text' nor 'answer') or not a string")
    if not text.strip():
        fail("text", "empty transcript")

    src = d.get("source_lang", d.get("lang"))
    tgt = d.get("target_lang", d.get("lang"))
    for field, value in (("source_lang", src), ("target_lang", tgt)):
        if not isinstance(value, str) or not value:
            fail(field, f"missing or not a language code, got {value!r}")

    pnc = d.get("pnc", "yes")
    pnc = pnc.lower() if isinstance(pnc, str) else pnc
    if pnc not in PNC_VALUES:
        fail("pnc", f"must be yes/no, got {d.get('pnc')!r}")

    task = d.get("taskname")
    if task is None:
        task = "asr" if src == tgt else "ast"
    elif task not in TASK_ALIASES:
        fail("taskname", f"must be one of {sorted(TASK_ALIASES)}, got {task!r}")
    task = TASK_ALIASES[task]
    if task == "asr" and src != tgt:
        fail("taskname", f"'asr' needs source_lang == target_lang, got {src} -> {tgt}")

    return Utterance(path, float(duration), text, src, tgt, PNC_VALUES[pnc], task,
                     float(offset), where)


def iter_manifest(path: str, skip_invalid: bool = False) -> Iterator[Utterance]:
    """Stream a manifest line by line (it may be larger than memory). Blank lines are ignored."""
    base_dir = os.path.dirname(os.path.abspath(path))
    skipped = 0
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield parse_line(line, f"{path}:{lineno}", base_dir)
            except ManifestError as e:
                if not skip_invalid:
                    raise
                skipped += 1
                log.warning("skipping invalid manifest line: %s", e)
    if skipped:
        log.warning("%s: skipped %d invalid line(s)", path, skipped)


def read_manifest(path: str, skip_invalid: bool = False) -> list[Utterance]:
    return list(iter_manifest(path, skip_invalid))


def encode_utterance(tokenizer, utt: Utterance) -> tuple[list[int], int]:
    """Prompt + target text + EOS token ids, and the prompt length."""
    return tokenizer.encode_example(utt.text, utt.source_lang, utt.target_lang, utt.pnc,
                                    task="transcribe" if utt.taskname == "asr" else "translate")


class UtteranceDataset(Dataset):
    """Map-style dataset: index -> features and token ids, computed in DataLoader workers.

    Features are per utterance (normalisation uses only that utterance's frames), so computing
    them here gives exactly what the batched `LogMel` gives. An unreadable audio file does not
    crash the epoch: the item comes back as `{"error": ...}` and `Collate` reports it.
    Dither noise is seeded by (seed, index), so a resumed run sees the same features whichever
    DataLoader worker loads an utterance.
    """

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
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed * 1_000_003 + i)
            feats, feat_lens = self.logmel(wav[None], torch.tensor([wav.numel()]))
        if feat_lens[0] == 0:
            return {"error": f"{utt.where}: audio shorter than one frame",
                    "audio_filepath": utt.audio_filepath}
        tokens, prompt_len = encode_utterance(self.tokenizer, utt)
        return {"feats": feats[0, : feat_lens[0]], "tokens": tokens, "prompt_len": prompt_len,
                "audio_filepath": utt.audio_filepath, "index": i}


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

    def __len__(self):
        return len(self.paths)

    def to(self, device, non_blocking: bool = False) -> "Batch":
        kw = {"device": device, "non_blocking": non_blocking}
        return Batch(self.feats.to(**kw), self.feat_lens.to(**kw), self.tokens.to(**kw),
                     self.token_lens.to(**kw), self.prompt_lens.to(**kw), self.paths,
                     self.indices, self.errors)

    def pin_memory(self) -> "Batch":  # called by DataLoader(pin_memory=True)
        return Batch(self.feats.pin_memory(), self.feat_lens, self.tokens.pin_memory(),
                     self.token_lens, self.prompt_lens, self.paths, self.indices, self.errors)


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
        return Batch(feats, feat_lens, tokens, token_lens, prompt_lens,
                     [it["audio_filepath"] for it in items], [it["index"] for it in items], errors)



def ignore_stop_signals(worker_id: int) -> None:
    """DataLoader worker_init_fn. Cluster schedulers signal every process of the job, workers
    included; the trainer must outlive its workers long enough to save a checkpoint, and it
    shuts them down itself (train.py, stop_workers)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
