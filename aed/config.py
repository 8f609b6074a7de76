"""The run configuration: typed dataclasses, then YAML files, then `key=value` overrides.

    cfg = load_train_config("configs/tiny.yaml", ["optim.lr=1e-3", "train.manifests=[a.jsonl]"])
    cfg = load_train_config(["configs/canary-1b.yaml", "buckets.yaml"])   # later files win (oom.py --out)

Nested dataclass fields are YAML sections and dotted keys on the command line. Override values
are parsed as YAML, so lists and mappings work (`train.manifests=[{path: a.jsonl, weight: 2}]`).
Unknown keys and values of the wrong type are errors that name the key. Each field's trailing
comment is its description: `train.py --help` prints it (`describe`), so the comment next to the
default is the one place a key is documented.

The model section describes the architecture only. Three of its fields have another source:
`n_mels` is `features.n_mels`, and `vocab_size` / `pad_id` come from the tokenizer
(`resolve_model`); a config that sets them is rejected, so they can never disagree.
"""

import dataclasses
import inspect
import io
import os
import re
import tokenize
import types
import typing
from dataclasses import dataclass, field
from typing import Any

import yaml

from aed.audio import FeatureConfig, SpecAugmentConfig
from aed.decoding import DecodingOptions
from aed.model import AEDConfig
from aed.normalize import NORMALIZERS
from aed.ssl import SSLConfig


class ConfigError(ValueError):
    pass


FREEZE = ("none", "encoder", "all_but_new_tokens")  # TrainConfig.freeze (aed/training.py: build_model)


# --- the training run ---------------------------------------------------------------------------


@dataclass
class DataConfig:
    manifests: list[dict | str] = field(default_factory=lambda: ["data/mini/train.jsonl"])  # paths, {path, weight} or {shards: DIR, weight}
    tokenizer: str = "data/mini/tokenizer"  # directory written by tools/train_tokenizer.py; sets the model's vocabulary
    skip_invalid: bool = True  # bad manifest lines are skipped with a warning and counted, not fatal
    check_audio: bool = True  # read every audio header at start (~2-4k files/s per rank, cold cache): unreadable files and wrong durations are skipped
    duration_tolerance: float = 0.1  # check_audio: a manifest duration further than this fraction from the header's is wrong
    bins: str | None = None  # bins.json from tools/estimate_bins.py; None: estimated at start
    num_buckets: int = 30  # duration buckets when estimating bins (the paper: 30)
    sub_buckets: int = 2  # token sub-buckets per duration bucket, on average (2 = the paper's 2D; 1 = 1D)
    bin_method: str = "optimised"  # 2D bins: optimised (least padded compute) | equal (the paper's equal-count)
    batch_size: int | None = None  # fixed batch size (the padding-heavy baseline)
    max_duration: float | None = 360.0  # padded seconds of audio per batch (Canary: 360)
    batch_sizes: str | None = None  # per-bucket batch sizes from oom.py (replaces the two above)
    allocation: str = "flexible"  # flexible: smallest bucket that fits | strict: drop what its sub-bucket can't hold
    min_tps: float | None = None  # drop examples below this many output tokens per second
    max_tps: float | list[float] | None = None  # ... and above this (the paper filters at 25); a list: one per duration bin (oom.py --out writes the bins' own)
    buffer_size: int = 20000  # examples held by the bucketing buffer
    buffer_overfill: float = 4.0  # read on up to this x the buffer for the bucket all ranks drew (1: the paper's)
    sync_buckets: bool = True  # same bucket on every rank each step (removes the tail-worker effect)
    num_workers: int = 2  # DataLoader workers decoding audio and computing features

    def __post_init__(self):
        if self.allocation not in ("flexible", "strict"):
            raise ConfigError(f"train.allocation: expected flexible or strict, got {self.allocation!r}")
        if self.bin_method not in ("optimised", "equal"):
            raise ConfigError(f"train.bin_method: expected optimised or equal, got {self.bin_method!r}")


@dataclass
class ValConfig:
    manifests: list[str] = field(default_factory=lambda: ["data/mini/dev.jsonl"])  # validation manifests, scored separately
    every: int = 500  # validate every N steps (and before step 1 and at the end); 0: never
    batch_duration: float = 300.0  # padded seconds of audio per decoding batch (batch size x longest)
    max_utterances: int | None = None  # validate on the first N utterances of each manifest only
    num_examples: int = 4  # transcripts shown in the log and TensorBoard
    ctc_weight: float = DecodingOptions.ctc_weight  # joint CTC/attention decoding weight for models with a CTC head (infer.py's default too); 0: attention only
    normalizer: str = "simple"  # WER text normaliser: simple (case, punctuation) | whisper (the leaderboards', aed/normalize.py)

    def __post_init__(self):
        if self.normalizer not in NORMALIZERS:
            raise ConfigError(f"val.normalizer: expected one of {NORMALIZERS}, got {self.normalizer!r}")


@dataclass
class OptimConfig:
    lr: float = 3e-4  # peak learning rate (Canary)
    betas: tuple[float, float] = (0.9, 0.98)  # AdamW's moment decay rates
    weight_decay: float = 1e-3  # AdamW weight decay on matrices (not on norms, biases, position biases)
    warmup_steps: int = 2500  # linear warmup, then the decay of `schedule`
    schedule: str = "inverse_sqrt"  # decay after warmup: inverse_sqrt (Noam, Canary's) | cosine (half a cosine down to min_lr at max_steps; raising max_steps on resume raises the lr again, and a run stopped by budget_flops never anneals)
    min_lr: float = 1e-6  # floor of the decay
    clip_grad: float = 1.0  # max gradient norm
    grad_accum: int = 1  # micro-batches per optimizer step

    def __post_init__(self):
        if self.schedule not in ("inverse_sqrt", "cosine"):
            raise ConfigError(f"optim.schedule: expected inverse_sqrt or cosine, got {self.schedule!r}")


@dataclass
class TrainConfig:
    run_dir: str = "runs/tiny"  # checkpoints, metrics.jsonl, TensorBoard events, resolved config
    seed: int = 0  # data order, initialisation, dropout and SpecAugment
    objective: str = "aed"  # aed: encoder-decoder cross-entropy | rnnt: encoder + transducer (encoder pretraining) | ssl: BEST-RQ on audio alone (encoder pretraining, section ssl)
    rnnt_chunk_size: int = 4  # rnnt: samples per joint tensor (1 = least memory, B = batched speed)
    rnnt_pred_dim: int = 640  # rnnt: predictor width (NeMo's default)
    rnnt_joint_dim: int = 640  # rnnt: joint width; the (B, T', U+1, H) joint dominates a small model's step
    max_steps: int = 100000  # optimizer steps of the whole run
    budget_flops: float | None = None  # stop (and checkpoint) once training has spent this many FLOPs, all ranks together (aed/flops.py)
    log_every: int = 10  # steps between progress lines
    ckpt_every: int = 1000  # steps between checkpoints (and at the end, and on SIGTERM/SIGUSR1)
    keep_last: int = 3  # checkpoints kept in run_dir
    precision: str = "auto"  # auto (bf16 on GPU, fp32 on CPU) | fp32 | bf16 | fp16
    compile: bool = False  # torch.compile the model (checkpoints still save the raw module)
    activation_checkpointing: bool = False  # recompute encoder layers in backward: less memory, ~30% slower
    init_from: str | None = None  # initialise weights from this checkpoint (a fresh run, new optimizer)
    init_encoder_only: bool = False  # with init_from: only encoder weights; extra layers stay random
    freeze: str = "none"  # none | encoder: it runs as at inference (fixed weights and BatchNorm statistics, no dropout); decoder and CTC head train | all_but_new_tokens: only the rows tools/add_language.py added to init_from (embedding/output/CTC) train
    max_bad_steps: int = 5  # abort after this many consecutive non-finite steps
    memory_budget: str | None = None  # e.g. "75GB": before step 0 run every bucket's worst batch once (oom.py)
    cpu_threads: int | None = None  # CPU training: torch threads; None = cores - DataLoader workers
    model: AEDConfig = field(default_factory=AEDConfig)  # architecture (aed/model.py)
    features: FeatureConfig = field(default_factory=FeatureConfig)  # log-mel features (aed/audio.py)
    spec_augment: SpecAugmentConfig = field(default_factory=SpecAugmentConfig)  # masking in training
    train: DataConfig = field(default_factory=DataConfig)  # training data and batching
    val: ValConfig = field(default_factory=ValConfig)  # validation
    optim: OptimConfig = field(default_factory=OptimConfig)  # optimizer and schedule
    ssl: SSLConfig = field(default_factory=SSLConfig)  # objective=ssl: masking and random-projection targets (aed/ssl.py)

    def __post_init__(self):
        if self.objective not in ("aed", "rnnt", "ssl"):
            raise ConfigError(f"objective: expected aed, rnnt or ssl, got {self.objective!r}")
        if self.freeze not in FREEZE:
            raise ConfigError(f"freeze: expected one of {FREEZE}, got {self.freeze!r}")
        if self.freeze == "all_but_new_tokens" and (self.objective != "aed" or not self.init_from
                                                    or self.init_encoder_only):
            raise ConfigError("freeze=all_but_new_tokens needs objective=aed, init_from=<the checkpoint "
                              "tools/add_language.py wrote> and init_encoder_only=false: it trains the token rows "
                              "add_language.py added to that checkpoint")
        if self.precision not in ("auto", "fp32", "bf16", "fp16"):
            raise ConfigError(f"precision: expected auto, fp32, bf16 or fp16, got {self.precision!r}")


# Model fields whose value comes from elsewhere, and where.
DERIVED = {"model.n_mels": "features.n_mels", "model.vocab_size": "the tokenizer (train.tokenizer)",
           "model.pad_id": "the tokenizer (train.tokenizer)"}


def load_train_config(yaml_path: str | list[str] | None = None, overrides: list[str] = ()) -> TrainConfig:
    """A train.py run's config: TrainConfig defaults < YAML file(s), in order < overrides;
    model.n_mels follows the features (vocab_size and pad_id follow the tokenizer once it is
    loaded: `resolve_model`)."""
    d = merged_dict(TrainConfig, yaml_path, overrides)
    given = _dotted_keys(_user_dict(yaml_path, overrides))
    for key, source in DERIVED.items():
        if key in given:
            raise ConfigError(f"{key} is set from {source}; remove it from the config")
    cfg = from_dict(TrainConfig, d)
    cfg.model = dataclasses.replace(cfg.model, n_mels=cfg.features.n_mels)
    return cfg


def resolve_model(cfg: TrainConfig, tokenizer) -> TrainConfig:
    """The config with the model's vocabulary taken from `tokenizer` (aed.tokenizer.Tokenizer)."""
    model = dataclasses.replace(cfg.model, vocab_size=tokenizer.padded_vocab_size, pad_id=tokenizer.pad)
    return dataclasses.replace(cfg, model=model)


# --- loading and checking -----------------------------------------------------------------------


def _check(value: Any, hint: Any, key: str) -> Any:
    """Return `value` converted to `hint` (int -> float only), or raise ConfigError naming `key`."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _check(value, arg, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0])
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return from_dict(hint, value, prefix=f"{key}.")
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        item = args[0] if args else Any
        out = [_check(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(out) if origin is tuple else out
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return value
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is float and isinstance(value, str):  # YAML 1.1 reads "3e-4" as a string
        try:
            return float(value)
        except ValueError:
            raise ConfigError(f"{key}: expected float, got {value!r}") from None
    if hint is bool and not isinstance(value, bool):
        raise ConfigError(f"{key}: expected true/false, got {value!r}")
    if isinstance(hint, type) and not isinstance(value, hint) or (
            hint is int and isinstance(value, bool)):
        raise ConfigError(f"{key}: expected {hint.__name__}, got {value!r}")
    return value


def from_dict(cls, d: dict, prefix: str = ""):
    """Build dataclass `cls` from a (possibly partial) mapping, checking names and types."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise ConfigError(f"unknown config key(s): {', '.join(prefix + k for k in unknown)}; "
                          f"valid keys here: {', '.join(sorted(names))}")
    try:
        return cls(**{k: _check(v, hints[k], prefix + k) for k, v in d.items()})
    except AssertionError as e:  # a model dataclass's own consistency check
        raise ConfigError(f"{prefix.rstrip('.') or cls.__name__}: {e}") from None


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def _set_dotted(d: dict, dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    for p in parents:
        d = d.setdefault(p, {})
        if not isinstance(d, dict):
            raise ConfigError(f"{dotted}: '{p}' is not a section")
    d[last] = value


def _merge(base: dict, update: dict) -> dict:
    out = dict(base)
    for k, v in update.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _user_dict(yaml_path: str | os.PathLike | list | None, overrides: list[str]) -> dict:
    """What the YAML file(s) and the overrides set, merged in order, without defaults."""
    d = {}
    for path in [yaml_path] if isinstance(yaml_path, (str, os.PathLike)) else yaml_path or []:
        try:
            with open(path, encoding="utf-8") as f:
                part = yaml.safe_load(f) or {}
        except OSError as e:
            raise ConfigError(f"{path}: cannot read the config file ({e.strerror})") from None
        if not isinstance(part, dict):
            raise ConfigError(f"{path}: expected a mapping at the top level")
        d = _merge(d, part)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        _set_dotted(d, key.strip(), yaml.safe_load(raw) if raw.strip() else "")
    return d


def _dotted_keys(d: dict, prefix: str = "") -> set:
    keys = set()
    for k, v in d.items():
        keys.add(prefix + k)
        if isinstance(v, dict):
            keys |= _dotted_keys(v, f"{prefix}{k}.")
    return keys


def merged_dict(cls, yaml_path: str | list[str] | None = None, overrides: list[str] = ()) -> dict:
    return _merge(dataclasses.asdict(cls()), _user_dict(yaml_path, overrides))


def load_config(cls, yaml_path: str | list[str] | None = None, overrides: list[str] = ()):
    """Defaults < YAML file(s) < `key=value` overrides, validated against dataclass `cls`."""
    return from_dict(cls, merged_dict(cls, yaml_path, overrides))


# --- documentation ------------------------------------------------------------------------------


def _field_comments(cls) -> dict:
    """{field name: its trailing comment} read from the dataclass's source."""
    comments, names = {}, {}
    source = inspect.getsource(cls)
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    for lineno, line in enumerate(source.splitlines(), 1):
        m = re.match(r"\s+(\w+)\s*:\s*[^=]+=", line)
        if m and lineno in comments:
            names[m.group(1)] = comments[lineno]
    return names


def describe(cls, defaults=None, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(dotted key, type, default, description) for every leaf field of dataclass `cls`."""
    defaults = defaults if defaults is not None else cls()
    hints, comments, rows = typing.get_type_hints(cls), _field_comments(cls), []
    for f in dataclasses.fields(cls):
        value, hint = getattr(defaults, f.name), hints[f.name]
        if dataclasses.is_dataclass(hint):
            rows += describe(hint, value, f"{prefix}{f.name}.")
            continue
        key = prefix + f.name
        note = f"(set from {DERIVED[key]}) " if key in DERIVED else ""
        type_name = re.sub(r"\btyping\.|<class '(\w+)'>", r"\1", str(hint))
        rows.append((key, type_name, repr(value), note + comments.get(f.name, "")))
    return rows


def help_text(cls=TrainConfig) -> str:
    rows = describe(cls)
    width = max(len(k) for k, *_ in rows)
    lines = []
    for key, type_name, default, text in rows:
        section = key.rsplit(".", 1)[0] if "." in key else ""
        if lines and section != lines[-1][0]:
            lines.append((section, ""))
        lines.append((section, f"  {key:<{width}}  {type_name} = {default}\n  {'':<{width}}  {text}"))
    return "\n".join(line for _, line in lines)
