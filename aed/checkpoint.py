"""Checkpoints: sharded per rank, published by a completion marker, newest-valid lookup, and
loading a model for inference.

A checkpoint holds a `Checkpoint`: self-contained, so `infer.py` needs nothing else, and for a
training run everything resuming needs. On disk it is a plain dict of those fields.

train.py writes it as a directory, so that no single process serialises a 1B model's ~12 GB of
weights and AdamW moments (README, "Checkpoints at scale"):

    ckpt-00001000/
        shard-000-of-004.pt ... shard-003-of-004.pt   rank r: its share of the model and optimizer tensors
        meta.pt                                       everything else (rank 0), tensors as their shard keys
        COMPLETE                                      written last, once every shard is in place

Every rank holds the same (DDP) weights, so each writes a different 1/world_size of them, all
at once. A directory without COMPLETE (a job killed mid-save) is not a checkpoint. Readers map
the shards into memory (`torch.load(mmap=True)`), so loading costs no private copy per rank and
works for any world size. A single `torch.save` file (tools/convert_nemo.py, older runs) reads too.
"""

import glob
import logging
import os
import random
import re
import shutil
import tempfile
from dataclasses import MISSING, dataclass, field, fields

import numpy as np
import torch

from aed.audio import FeatureConfig
from aed.model import AED, AEDConfig
from aed.tokenizer import Tokenizer

log = logging.getLogger(__name__)


def pack_dir(directory: str) -> dict:
    """The files of a (flat) directory as {name: bytes}, to embed a tokenizer in a checkpoint."""
    out = {}
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                out[name] = f.read()
    return out


def unpack_tokenizer(files: dict) -> Tokenizer:
    with tempfile.TemporaryDirectory() as tmp:
        for name, data in files.items():
            with open(os.path.join(tmp, name), "wb") as f:
                f.write(data)
        return Tokenizer.load(tmp)


RESUME = {"resume": True}  # marks the fields a run needs to resume, beyond inference's


@dataclass
class Checkpoint:
    """What a checkpoint holds, each entry named here once. Fields without a default are what
    inference needs; those marked RESUME are what a training run needs to continue exactly."""
    model_config: dict  # AEDConfig fields
    model: dict  # the raw module's state dict
    features: dict  # FeatureConfig fields
    tokenizer: dict  # {file name: bytes} of the tokenizer directory (pack_dir)
    max_train_duration: float | None = None  # longest training utterance (s): infer.py's chunk length
    new_tokens: dict | None = None  # the rows tools/add_language.py appended (freeze=all_but_new_tokens)
    step: int | None = field(default=None, metadata=RESUME)  # optimizer steps taken
    flops: float = 0.0  # their FLOPs, all ranks together (aed/flops.py); checkpoints before FLOP counting have none
    optimizer: dict | None = field(default=None, metadata=RESUME)
    scheduler: dict | None = field(default=None, metadata=RESUME)
    scaler: dict | None = field(default=None, metadata=RESUME)
    sampler: list | None = field(default=None, metadata=RESUME)  # one BucketingSampler state per rank
    rng: list | None = field(default=None, metadata=RESUME)  # one `rng_state` per rank
    config: dict | None = field(default=None, metadata=RESUME)  # the run's resolved TrainConfig

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    @classmethod
    def from_dict(cls, d: dict) -> "Checkpoint":
        """A dict from `read_checkpoint` (with at least INFERENCE_KEYS); other keys are ignored."""
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})


INFERENCE_KEYS = tuple(f.name for f in fields(Checkpoint) if f.default is MISSING)
TRAINING_KEYS = INFERENCE_KEYS + tuple(f.name for f in fields(Checkpoint) if f.metadata.get("resume"))
COMPLETE = "COMPLETE"


class CheckpointError(RuntimeError):
    pass


# --- writing --------------------------------------------------------------------------------------


def sharded_tensors(state: dict) -> dict[str, torch.Tensor]:
    """The tensors that are split over the shards, by key: the model's and the optimizer's
    per-parameter state (the bulk of a checkpoint); the rest stays in meta.pt."""
    out = {f"model/{k}": v for k, v in state.get("model", {}).items()}
    for pid, param_state in state.get("optimizer", {}).get("state", {}).items():
        out |= {f"optimizer/{pid}/{k}": v for k, v in param_state.items() if isinstance(v, torch.Tensor)}
    return out


def shard_of(tensors: dict[str, torch.Tensor], world_size: int) -> dict[str, int]:
    """Key -> writing rank: largest tensors first, each to the rank with the fewest bytes so far.
    A function of names and sizes only, so every rank computes the same split on its own."""
    load, owner = [0] * world_size, {}
    for key in sorted(tensors, key=lambda k: (-tensors[k].nbytes, k)):
        r = min(range(world_size), key=load.__getitem__)
        owner[key] = r
        load[r] += tensors[key].nbytes
    return owner


def shard_name(rank: int, world_size: int) -> str:
    return f"shard-{rank:03d}-of-{world_size:03d}.pt"


def atomic_save(obj, path: str) -> None:
    """torch.save through a temp file + rename: `path` is either absent or complete. Without the
    zip records' CRC32s: computing them cut the speed of a CPU-bound write 3-5x on our 2-core
    machine (0.2-0.5 vs 1.3-1.5 GB/s into the page cache); a truncated file still fails to load."""
    crc = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        torch.save(obj, path + ".tmp")
    finally:
        torch.serialization.set_crc32_options(crc)
    os.replace(path + ".tmp", path)


def checkpoint_dir(run_dir: str, step: int) -> str:
    return os.path.join(run_dir, f"ckpt-{step:08d}")


def begin_checkpoint(path: str) -> None:
    """Rank 0, before any rank writes: an empty directory. One left at this step by an earlier,
    rolled-back attempt is removed first, so its marker or shards cannot mix with the new ones."""
    if os.path.lexists(path):
        remove(path)
    os.makedirs(path)


def remove(path: str) -> None:
    """A checkpoint directory, or a single-file checkpoint of an older run."""
    if os.path.isdir(path):
        shutil.rmtree(path)
    else:
        os.remove(path)


def write_shard(state: dict, path: str, rank: int, world_size: int) -> int:
    """Every rank: write its shard of `state`'s model and optimizer tensors into the checkpoint
    directory `path`; rank 0 also writes meta.pt, `state` without those tensors (which only rank
    0 needs to hold in full: the gathered sampler and RNG states). Returns the bytes written."""
    tensors = sharded_tensors(state)
    owner = shard_of(tensors, world_size)
    mine = {k: v.detach().cpu() for k, v in tensors.items() if owner[k] == rank}
    atomic_save(mine, os.path.join(path, shard_name(rank, world_size)))
    if rank == 0:
        meta = dict(state, shards=world_size, model=list(state.get("model", {})))  # model: its key order
        if "state" in state.get("optimizer", {}):
            per_param = state["optimizer"]["state"]
            meta["optimizer"] = dict(state["optimizer"], state={
                pid: {k: v for k, v in ps.items() if not isinstance(v, torch.Tensor)} for pid, ps in per_param.items()})
        atomic_save(meta, os.path.join(path, "meta.pt"))
    return sum(v.nbytes for v in mine.values())


def publish_checkpoint(path: str, run_dir: str, step: int, keep_last: int) -> None:
    """Rank 0, after every rank's write_shard returned: the completion marker, then the cleanup.
    Older checkpoints beyond the newest `keep_last` complete ones are deleted, and older
    incomplete ones; those numbered above `step` (left by a run rolled back past an unreadable
    checkpoint) are neither deleted nor counted, so the one just written always survives."""
    with open(os.path.join(path, COMPLETE), "w") as f:
        f.write(f"{step}\n")
    older = [p for p in list_checkpoints(run_dir) if checkpoint_step(p) < step]
    complete = [p for p in older if is_complete(p)]
    doomed = [p for p in older if p not in complete] + complete[: max(0, len(complete) - (keep_last - 1))]
    for old in doomed:
        remove(old)


def save_checkpoint(state: dict, run_dir: str, step: int, keep_last: int) -> str:
    """A checkpoint written by one process (a world of one): begin, write, publish."""
    path = checkpoint_dir(run_dir, step)
    begin_checkpoint(path)
    write_shard(state, path, 0, 1)
    publish_checkpoint(path, run_dir, step, keep_last)
    return path


# --- reading --------------------------------------------------------------------------------------


def checkpoint_step(path: str) -> int:
    return int(re.search(r"ckpt-(\d+)(\.pt)?$", path).group(1))


def list_checkpoints(run_dir: str) -> list[str]:
    """Checkpoints in `run_dir` (directories, and single files of older runs), oldest first."""
    paths = [p for p in glob.glob(os.path.join(run_dir, "ckpt-*")) if re.search(r"ckpt-(\d+)(\.pt)?$", p)]
    return sorted(paths, key=checkpoint_step)


def is_checkpoint(path: str) -> bool:
    """A checkpoint (file or directory), as opposed to a run directory that holds checkpoints."""
    return os.path.isfile(path) or bool(re.search(r"ckpt-\d+$", os.path.normpath(path))) \
        or os.path.isfile(os.path.join(path, "meta.pt"))


def is_complete(path: str) -> bool:
    return os.path.isfile(path) or os.path.isfile(os.path.join(path, COMPLETE))


def read_checkpoint(path: str, required=INFERENCE_KEYS) -> dict:
    """The checkpoint at `path` as one dict, with the `required` entries checked; CheckpointError
    names the file at fault. Shard tensors are memory-mapped: pages are read when first used,
    and shared with every other process that maps them."""
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, COMPLETE)):
            raise CheckpointError(f"{path}: incomplete (no {COMPLETE} marker: the job stopped while saving it)")
        ckpt = load_file(os.path.join(path, "meta.pt"), mmap=False)
        if not isinstance(ckpt, dict) or not isinstance(ckpt.get("shards"), int):
            raise CheckpointError(f"{path}/meta.pt: not an aed checkpoint's meta.pt")
        tensors = {}
        for rank in range(ckpt["shards"]):
            tensors |= load_file(os.path.join(path, shard_name(rank, ckpt["shards"])), mmap=True)
        try:
            ckpt["model"] = {k: tensors.pop(f"model/{k}") for k in ckpt.get("model", [])}
        except KeyError as e:
            raise CheckpointError(f"{path}: no shard holds {e.args[0]}") from None
        for key, value in tensors.items():  # "optimizer/{param id}/{name}"
            _, pid, name = key.split("/")
            ckpt["optimizer"]["state"][int(pid)][name] = value
    else:
        ckpt = load_file(path, mmap=False)
    missing = [k for k in required if not isinstance(ckpt, dict) or k not in ckpt]
    if missing:
        raise CheckpointError(f"{path}: not a complete aed checkpoint (no {', '.join(missing)})")
    return ckpt


def load_file(path: str, mmap: bool):
    try:
        return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)
    except Exception as e:  # noqa: BLE001 - missing, truncated, corrupt, not a torch file: all unreadable
        raise CheckpointError(f"{path}: unreadable ({type(e).__name__}: {str(e)[:200]})") from None


def load_latest(run_dir: str, required=TRAINING_KEYS) -> tuple[str, dict] | tuple[None, None]:
    """The newest valid checkpoint of `run_dir`, or (None, None) when it has none. An invalid one
    (interrupted, truncated by a full disk, written by something else) is logged by name and the
    next older one tried; when checkpoints exist but none is valid, CheckpointError: starting from
    scratch silently would throw a run away."""
    paths = list_checkpoints(run_dir)
    problems = []
    for path in reversed(paths):
        try:
            ckpt = read_checkpoint(path, required)
        except CheckpointError as e:
            log.warning("skipping invalid checkpoint %s; trying an older one", e)
            problems.append(str(e))
            continue
        return path, ckpt
    if paths:
        raise CheckpointError(f"{run_dir} has {len(paths)} checkpoint(s) and none is valid:\n  "
                              + "\n  ".join(problems) + "\nmove them away to start this run from scratch")
    return None, None


# Tensors with one row per token id. The CTC head has one more, its blank, which stays the last row.
VOCAB_ROWS = ("decoder.embedding.token_embedding.weight", "decoder.output_proj.weight", "decoder.output_proj.bias")
CTC_ROWS = ("ctc.proj.weight", "ctc.proj.bias")


def grow_vocabulary(state: dict, size: int) -> list[str]:
    """Resize a model state dict's vocabulary to `size` ids, in place, for a tokenizer with blocks
    appended (every old id keeps its meaning); returns one note per grown tensor.

    Old rows are copied, so every old token's embedding and logit are what they were. New
    embedding rows are drawn with the old rows' spread; new output (and CTC) rows get zero
    weights and the lowest old bias: a constant logit no better than the least likely old token's,
    so old-language outputs do not change until training teaches the new rows. The CTC blank
    row moves to the new last position."""
    notes = []
    for k in VOCAB_ROWS + CTC_ROWS:
        if k not in state:
            continue
        old = state[k]
        blank = old[-1:] if k in CTC_ROWS else old[:0]
        rows = old[:-1] if k in CTC_ROWS else old
        n_new = size - len(rows)
        if n_new < 0:
            raise ValueError(f"{k}: the checkpoint has {len(rows)} token rows, more than the {size} asked for")
        if n_new == 0:
            continue
        if k.endswith("token_embedding.weight"):
            fresh = torch.randn(n_new, *rows.shape[1:], dtype=rows.dtype) * rows.float().std().to(rows.dtype)
        elif k.endswith("bias"):
            fresh = rows.min().expand(n_new).clone()
        else:
            fresh = rows.new_zeros(n_new, *rows.shape[1:])
        state[k] = torch.cat([rows, fresh, blank])
        notes.append(f"{k} grows from {len(old)} to {len(state[k])} rows")
    return notes


def init_from_checkpoint(model: torch.nn.Module, path: str, encoder_only: bool = False) -> str:
    """Initialise `model` (a fresh run) with the weights of the checkpoint at `path`; returns a
    summary for the log. Tensors of equal name and shape are copied; encoder_only copies only
    `encoder.*` (an rnnt- or ssl-pretrained encoder into an AED; extra layers stay random). A
    checkpoint of another objective loads the same way: what `model` lacks (a BEST-RQ run's
    quantizer and heads, a transducer's joint) is dropped and listed. Raises
    ValueError listing every tensor whose shape differs.

    A tokenizer with blocks appended (a new language's SentencePiece model: tools/add_language.py)
    keeps every old id, so the vocabulary-sized tensors, the CTC head's included, grow
    (`grow_vocabulary`)."""
    src = dict(read_checkpoint(path, ("model",))["model"])
    own = model.state_dict()
    prefix = "encoder." if encoder_only else ""
    notes = []
    size = own[VOCAB_ROWS[0]].shape[0] if VOCAB_ROWS[0] in own else None
    if not encoder_only and size is not None and VOCAB_ROWS[0] in src and src[VOCAB_ROWS[0]].shape[0] < size:
        notes = grow_vocabulary(src, size)
    mismatched = [f"{k}: {tuple(v.shape)} -> {tuple(own[k].shape)}" for k, v in src.items()
                  if k.startswith(prefix) and k in own and own[k].shape != v.shape]
    if mismatched:
        raise ValueError(f"init_from={path}: shape mismatches:\n  " + "\n  ".join(mismatched))
    loadable = {k: v for k, v in src.items() if k.startswith(prefix) and k in own}
    model.load_state_dict(loadable, strict=False)
    fresh = sorted({".".join(k.split(".")[:3]) for k in own if k.startswith(prefix) and k not in loadable})
    dropped = sorted({k.split(".")[0] for k in src if k not in own})
    return (f"loaded {len(loadable)} tensors{' (encoder only)' if encoder_only else ''}"
            + "".join(f"; {n}" for n in notes) + f"; left random: {', '.join(fresh) or 'nothing'}"
            + (f"; not in this model, dropped: {', '.join(dropped)}" if dropped else ""))


def rng_state(device: torch.device) -> dict:
    """Every random number generator a training step draws from (dropout, SpecAugment, ...)."""
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state(),
            "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if device.type == "cuda" and state["cuda"] is not None:
        torch.cuda.set_rng_state(state["cuda"], device)


def model_from_checkpoint(ckpt: dict, device="cpu") -> tuple[AED, Tokenizer, FeatureConfig]:
    """Model (eval mode), tokenizer and feature settings of a checkpoint read by `read_checkpoint`."""
    ckpt = Checkpoint.from_dict(ckpt)
    model = AED(AEDConfig(**ckpt.model_config))
    model.load_state_dict(ckpt.model)
    return model.to(device).eval(), unpack_tokenizer(ckpt.tokenizer), FeatureConfig(**ckpt.features)
