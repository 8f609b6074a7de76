"""An example -> an item -> a padded batch: what the DataLoader workers and the training step see.

- `encodable` / `encode_utterance`: an utterance's decoder ids (prompt + text + EOS), counted once
  when the data is read and carried with it, so the workers do not tokenise again; `fit_decoder`
  drops those longer than the decoder's positions.
- `decode_audio` / `file_audio`: the audio of a streamed member or of a file, decoded whole (or
  the segment its offset names) and checked against the metadata's duration: one rule for both.
- `ExampleDataset`: the one dataset, for utterances read from manifests and for streamed example
  dicts alike; `make_item` gives its items (features, token ids), `Collate` pads them into a `Batch`.
- `duration_batches`: batches by padded duration, for validation and inference.
"""

import logging
import signal
import zlib
from array import array
from collections import Counter
from dataclasses import dataclass, replace

import torch
import torchaudio
from torch.utils.data import Dataset

from aed.data_audio import AudioError, LogMel, load_audio
from aed.data_manifest import AUDIO_LENGTH, DURATION_TOLERANCE, PROMPT_TASKS, Faults, ManifestError, Utterance

log = logging.getLogger(__name__)


def encode_utterance(tokenizer, utt: Utterance) -> tuple[list[int], int]:
    """Prompt + target text + EOS token ids, and the prompt length: the ids `encodable` (or
    aed.data_sources.CountTokens) carried when it counted them, else encoded now."""
    if utt.token_ids is not None:
        return array("i", utt.token_ids).tolist(), utt.prompt_len
    return tokenizer.encode_example(utt.text, utt.source_lang, utt.target_lang, utt.pnc,
                                    task=PROMPT_TASKS[utt.taskname])


def with_tokens(utt: Utterance, ids: list[int], prompt_len: int) -> Utterance:
    """`utt` carrying its token ids, so the DataLoader worker does not tokenize it again; kept as
    bytes, which costs 4 bytes a token and nothing per token to fork or pickle."""
    return replace(utt, token_ids=array("i", ids).tobytes(), prompt_len=prompt_len)


def encodable(utts: list[Utterance], tokenizer, skip_invalid: bool,
              faults: Faults | None = None) -> tuple[list[Utterance], list[int]]:
    """The utterances `tokenizer` can encode, carrying their token ids, and their token counts
    (prompt + text + EOS): each utterance is tokenized once, here.

    The manifest checks cannot know the tokenizer: a language it lacks (or a task its prompt
    format cannot express) shows up here. That raises ManifestError naming the manifest line,
    or with `skip_invalid` is counted in `faults` (kind not_encodable, logged per line) and
    summed per manifest in one line."""
    own = Faults() if faults is None else faults
    kept, num_tokens, skipped = [], [], Counter()
    for u in utts:
        try:
            ids, prompt_len = encode_utterance(tokenizer, u)
        except (ValueError, KeyError) as e:
            if not skip_invalid:
                raise ManifestError(f"{u.where}: {e}") from None
            if own.skip("not_encodable", u.where, str(e), "skipping manifest line"):
                skipped[u.where.rsplit(":", 1)[0]] += 1
            continue
        kept.append(with_tokens(u, ids, prompt_len))
        num_tokens.append(len(ids))
    for path, n in skipped.items():
        log.warning("%s: skipped %d line(s) the tokenizer cannot encode", path, n)
    return kept, num_tokens


def fit_decoder(utts: list[Utterance], num_tokens: list[int], max_tokens: int,
                purpose: str) -> tuple[list[Utterance], list[int]]:
    """The utterances whose prompt + text + EOS fit the decoder's `max_tokens`
    positions (model.dec_max_len), and their token counts. The others are dropped and counted in one
    warning: a single one would stop the step or the validation that met it."""
    keep = [i for i, n in enumerate(num_tokens) if n <= max_tokens]
    if len(keep) < len(utts):
        first = next(i for i, n in enumerate(num_tokens) if n > max_tokens)
        log.warning("%s: dropping %d utterances whose prompt+text exceed dec_max_len=%d tokens, e.g. %s",
                    purpose, len(utts) - len(keep), max_tokens, utts[first].where)
    return [utts[i] for i in keep], [num_tokens[i] for i in keep]


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
    # A generator of its own: seeding torch's global one (torch.manual_seed) also queues a seed, with a
    # formatted stack trace, for every accelerator torch knows, for every utterance.
    dither = torch.Generator().manual_seed(seed * 1_000_003 + index)
    with torch.no_grad():
        feats, feat_lens = logmel(wav[None], torch.tensor([wav.numel()]), dither)
    if feat_lens[0] == 0:
        return {"error": f"{utt.where}: audio shorter than one frame", "audio_filepath": utt.audio_filepath}
    tokens, prompt_len = encode_utterance(tokenizer, utt) if tokenizer is not None else ([], 0)
    return {"feats": feats[0, : feat_lens[0]], "tokens": tokens, "prompt_len": prompt_len,
            "transcribed": utt.taskname == "asr", "audio_filepath": utt.audio_filepath, "index": index}


def perturb_speed(wav: torch.Tensor, factor: float) -> torch.Tensor:
    """(S,) -> (~S / factor,): the recording played `factor` times faster, tempo and pitch together
    (Ko et al., 2015), by resampling it as if it had been recorded at factor x the sample rate."""
    return torchaudio.functional.resample(wav, round(100 * factor), 100)


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
    where: list[str]           # each row's location, for messages: its file, or its shard member / row
    indices: list[int]
    errors: list[str]          # items dropped from this batch (unreadable audio), with reasons
    transcribed: torch.Tensor | None = None  # (B,) bool: the text is the spoken words (ASR, not AST); None: every row

    def __len__(self):
        return len(self.where)

    def to(self, device, non_blocking: bool = False) -> "Batch":
        kw = {"device": device, "non_blocking": non_blocking}
        return Batch(self.feats.to(**kw), self.feat_lens.to(**kw), self.tokens.to(**kw),
                     self.token_lens.to(**kw), self.prompt_lens.to(**kw), self.where,
                     self.indices, self.errors, None if self.transcribed is None else self.transcribed.to(**kw))

    def pin_memory(self) -> "Batch":  # called by DataLoader(pin_memory=True)
        return Batch(self.feats.pin_memory(), self.feat_lens, self.tokens.pin_memory(),
                     self.token_lens, self.prompt_lens, self.where, self.indices, self.errors, self.transcribed)


class Collate:
    """Pads a list of dataset items into a `Batch`; items that failed to load are reported.

    `buckets`: (frames, tokens) bounds of the sampler's buckets (`bucket_padding`). A batch is then
    padded to the first bucket that holds it rather than to its own longest item, so a compiled model
    sees one shape per bucket instead of a new one almost every batch (train.compile); a batch that no
    bucket holds keeps its own."""

    def __init__(self, pad_id: int, buckets: list | None = None):
        self.pad_id = pad_id
        self.buckets = buckets or []

    def padded_shape(self, max_t: int, max_u: int) -> tuple[int, int]:
        return next(((t, u) for t, u in self.buckets if t >= max_t and u >= max_u), (max_t, max_u))

    def __call__(self, items: list[dict]) -> Batch:
        errors = [it["error"] for it in items if "error" in it]
        items = [it for it in items if "error" not in it]
        n_mels = items[0]["feats"].shape[1] if items else 0
        feat_lens = torch.tensor([it["feats"].shape[0] for it in items], dtype=torch.long)
        token_lens = torch.tensor([len(it["tokens"]) for it in items], dtype=torch.long)
        max_t, max_u = self.padded_shape(int(feat_lens.max()), int(token_lens.max())) if items else (0, 0)
        feats = torch.zeros(len(items), max_t, n_mels)  # (B, T, F)
        tokens = torch.full((len(items), max_u), self.pad_id, dtype=torch.long)  # (B, U)
        for b, it in enumerate(items):
            feats[b, : feat_lens[b]] = it["feats"]
            tokens[b, : token_lens[b]] = torch.tensor(it["tokens"], dtype=torch.long)
        prompt_lens = torch.tensor([it["prompt_len"] for it in items], dtype=torch.long)
        transcribed = torch.tensor([it["transcribed"] for it in items], dtype=torch.bool)
        return Batch(feats, feat_lens, tokens, token_lens, prompt_lens,
                     [it["audio_filepath"] for it in items], [it["index"] for it in items], errors, transcribed)


def ignore_stop_signals(worker_id: int) -> None:
    """DataLoader worker_init_fn. Cluster schedulers signal every process of the job, workers
    included; the trainer must outlive its workers long enough to save a checkpoint, and it
    shuts them down itself (train.py, stop_workers)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)


ROUNDING_SLACK = 0.01  # seconds: metadata durations are rounded, NeMo's to 2-3 decimals; one 10 ms feature frame


def fit_duration(data, rate: int, duration: float, segment: bool | None, where: str, tolerance: float,
                 offset: float = 0.0):
    """Samples (S, ...) of an utterance checked against its `duration`, then cut to at most it.

    The check, one rule for files and streamed members: a whole one (`segment` False: the line
    gave no offset) must last `duration` to within `tolerance` (a fraction of its length); a
    segment (True: read from its offset) must not end more than that short of it; None (aed shards
    written before members were cut to their utterance) only must not be short. A mismatch is an
    AudioError whose reason starts with `AUDIO_LENGTH`: skipped and counted, never a silent cut.
    Audio that checks out is kept whole up to ROUNDING_SLACK past `duration` (manifests round
    durations: those samples are the utterance's), and cut beyond it: bucketing placed the item by
    its duration, and the batch sizes (oom.py's included) were measured at that bound."""
    real = len(data) / rate
    too_short = duration - real > tolerance * duration
    wrong = abs(duration - real) > tolerance * real if segment is False else too_short
    if wrong:
        raise AudioError(where, f"{AUDIO_LENGTH}: duration {duration:.3f} s, but the audio "
                                f"{'from its offset ' if offset else ''}lasts {real:.3f} s")
    return data[: round((duration + ROUNDING_SLACK) * rate)]


def decode_audio(example: dict, sample_rate: int = 16000, tolerance: float = DURATION_TOLERANCE) -> torch.Tensor:
    """An example's audio bytes -> mono float32 (S,) at `sample_rate`, by the one reader
    (`aed.data_audio.load_audio`, ffmpeg's fallback included): a whole member decoded whole, a
    segment (NeMo's members shared by the rows of one file) for its duration from its offset, then
    checked and cut by `fit_duration`."""
    where = example.get("where", "example")
    duration, offset = example["duration"], example.get("offset", 0.0)
    segment = example.get("segment", offset > 0)
    wav = load_audio(example.get("audio"), offset, duration if segment else None, sample_rate, name=where)
    return fit_duration(wav, sample_rate, duration, segment, where, tolerance, offset)


def file_audio(utt: Utterance, sample_rate: int, tolerance: float) -> torch.Tensor:
    """A manifest utterance's samples by the same rule: a whole file decoded whole, a segment (a
    line with an offset) for its duration from its offset, then checked and cut by `fit_duration`
    (the start-of-run header check, when on, has already left out most mismatches)."""
    wav = load_audio(utt.audio_filepath, offset=utt.offset, duration=utt.duration if utt.segment else None,
                     sample_rate=sample_rate)
    return fit_duration(wav, sample_rate, utt.duration, utt.segment, utt.audio_filepath, tolerance, utt.offset)


class ExampleDataset(Dataset):
    """The one dataset: an example -> `aed.data_batch.make_item`'s item, made in DataLoader
    workers and padded by `aed.data_batch.Collate`. An example is a manifest `Utterance` (audio
    read from its file) or a streamed example dict (its audio bytes decoded); either way the audio
    is checked against the duration by one rule (`decode_audio`), and audio that cannot be read
    or disagrees comes back as {"error": ...}, which `Collate` reports.

    - ExampleDataset(utterances or example dicts, ...): index i -> examples[i]; dither seeded by
      (seed, i). `utterances[i]` is each example as an Utterance (for metrics and durations).
    - ExampleDataset(None, ...): the index is the example dict itself, as a streamed sampler's
      batches hand it (`DataLoader(..., batch_sampler=BucketingSampler(source, ...))`); dither
      seeded by (seed, its location), stable across processes and resumes.

    A key may also be (index or example dict, draw), as `aed.train_data.BatchCounter` hands them:
    `augment` (aed.data_augment.Augment, training only) degrades the waveform after speed
    perturbation and before the features, its random choices seeded by (seed, index, draw), so each
    pass over the data draws new degradations (a plain key is draw 0). `trim` (wav (S,) -> wav,
    train.trim_silence's cut: aed.train_data) comes first, on the audio as read.
    """

    def __init__(self, examples: list | None, tokenizer, logmel, seed: int = 0,
                 tolerance: float = DURATION_TOLERANCE, augment=None, trim=None):
        self.examples, self.tokenizer, self.logmel = examples, tokenizer, logmel
        self.seed, self.tolerance, self.augment, self.trim = seed, tolerance, augment, trim
        self.utterances = None if examples is None else [
            ex if isinstance(ex, Utterance) else as_utterance(ex) for ex in examples]

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, key) -> dict:
        key, draw = key if isinstance(key, tuple) else (key, 0)
        if isinstance(key, dict):
            ex, utt, index = key, as_utterance(key), zlib.crc32(key["where"].encode())  # crc32: unlike hash(), stable
        else:
            ex, utt, index = self.examples[key], self.utterances[key], key
        rate = self.logmel.cfg.sample_rate
        try:
            if isinstance(ex, Utterance):
                wav = file_audio(ex, rate, self.tolerance)
            else:
                wav = decode_audio(ex, rate, self.tolerance)
        except AudioError as e:
            return {"error": f"{utt.where}: {e}" if isinstance(ex, Utterance) else str(e),
                    "audio_filepath": utt.audio_filepath}
        if self.trim is not None:
            wav = self.trim(wav)
        if utt.speed != 1.0:
            wav = perturb_speed(wav, utt.speed)
        if self.augment is not None:
            wav = self.augment(wav, self.seed, index, draw)
        return make_item(wav, utt, index, self.tokenizer, self.logmel, self.seed)


def as_utterance(ex: dict) -> Utterance:
    """A streamed example as the Utterance that tokenizing and `make_item` read, with the token ids
    `aed.data_sources.CountTokens` carried (if any). Its location (`where`) names it in batches and
    messages: its original file may not exist where training runs. Fields were validated by the
    reader (or when the shard was made)."""
    where = ex["where"]
    return Utterance(where, ex["duration"], ex["text"], ex["source_lang"], ex["target_lang"], ex["pnc"],
                     ex["taskname"], ex.get("offset", 0.0), where=where, segment=bool(ex.get("segment")),
                     token_ids=ex.get("token_ids"), prompt_len=ex.get("prompt_len", 0))
