"""Checkpoints: written through torch.distributed.checkpoint (DCP), published by a completion
marker, newest-valid lookup, and loading a model for inference.

A checkpoint holds a `Checkpoint`: self-contained, so `infer.py` needs nothing else, and for a
training run everything resuming needs. train.py writes it as a directory:

    ckpt-00001000/
        .metadata, __0_0.distcp ...   DCP: the model, optimizer and EMA tensors, each rank writing its part
        meta.pt                       everything else (rank 0): config, tokenizer, schedule, sampler and RNG states
        COMPLETE                      written last, once every rank's part is in place

Under DDP every rank holds the same weights and DCP spreads their writing over the ranks; under
FSDP each rank writes its own shards. Either way the tensors are saved under their parameter
names, so a checkpoint resumes on any world size and under either strategy, and `read_checkpoint`
reads one in a single process with no distributed world (inference, init_from). `async_save`
lets training continue while the files are written. A directory without COMPLETE (a job killed
mid-save) is not a checkpoint. Also read: single `torch.save` files (tools/convert_nemo.py).
Directories of per-rank `shard-*.pt` files, from aed before DCP, are refused with the command that
converts them (tools/upgrade_checkpoint.py).
"""

import glob
import logging
import os
import random
import re
import shutil
import tempfile
import warnings
from contextlib import contextmanager
from dataclasses import MISSING, dataclass, field, fields

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor

from aed.data_audio import FeatureConfig
from aed.data_tokenizer import Tokenizer
from aed.model import AED, AEDConfig
from aed.train_distributed import barrier, is_distributed

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
    edge_silence: tuple | None = None  # (before, after) s of silence around the training utterances' speech
    new_tokens: dict | None = None  # the rows tools/add_language.py appended (freeze=all_but_new_tokens)
    ema: dict | None = None  # the trainable weights' EMA by parameter name, fp32 (ema_decay: aed/train_ema.py)
    step: int | None = field(default=None, metadata=RESUME)  # optimizer steps taken
    flops: float = 0.0  # their FLOPs, all ranks together (aed/train_progress.py); checkpoints before FLOP counting have none
    optimizer: dict | None = field(default=None, metadata=RESUME)
    scheduler: dict | None = field(default=None, metadata=RESUME)
    scaler: dict | None = field(default=None, metadata=RESUME)
    sampler: list | None = field(default=None, metadata=RESUME)  # one BucketingSampler state per rank
    rng: list | None = field(default=None, metadata=RESUME)  # one `rng_state` per rank
    config: dict | None = field(default=None, metadata=RESUME)  # the run's resolved TrainConfig
    guide_ended: int | None = None  # the step train.attention_guide ended at because the decoder listened (until=listening)
    guide_check_due: bool = False  # until=listening: the last check found no two rows to compare, so one is due at the next step

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

TENSORS = ("model", "optimizer", "ema")  # the Checkpoint fields written through DCP; the rest goes to meta.pt


def atomic_save(obj, path: str) -> None:
    """torch.save through a temp file + rename: `path` is either absent or complete."""
    torch.save(obj, path + ".tmp")
    os.replace(path + ".tmp", path)


def checkpoint_dir(run_dir: str, step: int) -> str:
    return os.path.join(run_dir, f"ckpt-{step:08d}")


def begin_checkpoint(path: str) -> None:
    """Rank 0, before any rank writes: an empty directory. One left at this step by an earlier,
    rolled-back attempt is removed first, so its marker or files cannot mix with the new ones."""
    if os.path.lexists(path):
        remove(path)
    os.makedirs(path)


def remove(path: str) -> None:
    """A checkpoint directory, or a single-file checkpoint (torch.save, as tools/convert_nemo.py writes)."""
    if os.path.isdir(path):
        shutil.rmtree(path)
    else:
        os.remove(path)


def write_meta(state: dict, path: str) -> None:
    """Rank 0: everything of `state` but its tensors (TENSORS), into meta.pt."""
    atomic_save({k: v for k, v in state.items() if k not in TENSORS}, os.path.join(path, "meta.pt"))


def write_tensors(state: dict, path: str, asynchronous: bool = False, process_group=None):
    """Every rank: the TENSORS entries of `state` (model and optimizer state dicts, plain tensors
    or FSDP's DTensors) into the directory `path`, through DCP. Returns None once written, or with
    `asynchronous` a future that completes when they are: the call returns once the tensors are
    copied, and a background thread writes them (over `process_group`, which must not be the
    training's: the loop keeps using that one meanwhile)."""
    tensors = {k: state[k] for k in TENSORS if k in state}
    single = not is_distributed()
    with quiet_single_process():
        if not asynchronous:
            dcp.save(tensors, checkpoint_id=path, process_group=process_group, no_dist=single)
            return None
        return dcp.async_save(tensors, checkpoint_id=path, process_group=process_group, no_dist=single)


@contextmanager
def quiet_single_process():
    """DCP warns that it assumes a single process whenever no process group exists, even when told
    so (no_dist): for tools, tests and inference that is the normal case, not news."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def publish_checkpoint(path: str, run_dir: str, step: int, keep_last: int) -> None:
    """Rank 0, once every rank's part is written: the completion marker, then the cleanup.
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
    """A checkpoint written by one process (tools/upgrade_checkpoint.py): begin, write, publish."""
    path = checkpoint_dir(run_dir, step)
    begin_checkpoint(path)
    write_meta(state, path)
    write_tensors(state, path)
    publish_checkpoint(path, run_dir, step, keep_last)
    return path


class CheckpointWriter:
    """A training run's checkpoints, written on every rank at once and, with `asynchronous`, in
    the background: `save` returns once the tensors are copied, and the checkpoint is published
    (COMPLETE) by the first `poll` (every step), `save` or `finish` after its files are all written. Only rank 0
    publishes; DCP's coordinator (rank 0) returns only once every rank's part is in place."""

    def __init__(self, run_dir: str, keep_last: int, rank: int, asynchronous: bool, distributed: bool):
        self.run_dir, self.keep_last, self.rank, self.asynchronous = run_dir, keep_last, rank, asynchronous
        self.pending = None  # (future, path, step) of a checkpoint still being written
        # Background writes talk over their own process group: the training's is busy with steps.
        self.group = dist.new_group(backend="gloo") if asynchronous and distributed else None

    def save(self, state: dict, step: int) -> str:
        """`state`: a Checkpoint's dict on rank 0; on the other ranks only its TENSORS entries."""
        self.finish()
        path = checkpoint_dir(self.run_dir, step)
        if self.rank == 0:
            begin_checkpoint(path)
            write_meta(state, path)
        barrier()  # the directory exists before anyone writes into it
        future = write_tensors(state, path, self.asynchronous, self.group)
        if future is None:
            self._publish(path, step)
        else:
            self.pending = (future, path, step)
        return path

    def finish(self) -> None:
        """Wait for the checkpoint being written, then publish it."""
        if self.pending is not None:
            future, path, step = self.pending
            self.pending = None
            future.result()
            self._publish(path, step)

    def poll(self) -> None:
        """Publish the checkpoint being written once it is complete, without waiting: it can then
        be decoded or resumed from before the next save."""
        if self.pending is not None and self.pending[0].done():
            self.finish()

    def _publish(self, path: str, step: int) -> None:
        if self.rank == 0:
            publish_checkpoint(path, self.run_dir, step, self.keep_last)


def training_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer, ema=None) -> dict:
    """{"model", "optimizer"} keyed by parameter name, as DCP saves them: whole tensors under DDP,
    this rank's shards (DTensors) under FSDP. The same keys under both strategies, so either one
    resumes the other. A fresh optimizer gets its (zero) state first, as DCP's loader needs it.
    With `ema` (aed.train_ema.ExponentialMovingAverage), also "ema": its tensors, sharded as the weights."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optimizer_state} | ({} if ema is None else {"ema": ema.state_dict()})


def has_ema(path: str) -> bool:
    """Whether the DCP checkpoint at `path` holds EMA weights (its index names them: no tensor is read)."""
    return any(k.startswith("ema.") for k in dcp.FileSystemReader(path).read_metadata().state_dict_metadata)


def load_training_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: str, ema=None) -> bool:
    """The weights and optimizer state of the checkpoint at `path` into this run's `model` and
    `optimizer`, resharded to its world size and strategy; and its EMA into `ema` when both have one.
    Returns whether `ema` was loaded: False for a checkpoint written without EMA, which the caller
    starts from the loaded weights."""
    with_ema = ema is not None and has_ema(path)
    state = training_tensors(model, optimizer, ema if with_ema else None)
    with quiet_single_process():
        dcp.load(state, checkpoint_id=path, no_dist=not is_distributed())
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    if with_ema:  # DCP loads into the EMA's own tensors; this checks the names and copies anything it replaced
        ema.load_state_dict(state["ema"])
    return with_ema


# --- reading --------------------------------------------------------------------------------------


def checkpoint_step(path: str) -> int:
    return int(re.search(r"ckpt-(\d+)(\.pt)?$", path).group(1))


def list_checkpoints(run_dir: str) -> list[str]:
    """Checkpoints in `run_dir` (directories, and single `ckpt-N.pt` files), oldest first."""
    paths = [p for p in glob.glob(os.path.join(run_dir, "ckpt-*")) if re.search(r"ckpt-(\d+)(\.pt)?$", p)]
    return sorted(paths, key=checkpoint_step)


def is_checkpoint(path: str) -> bool:
    """A checkpoint (file or directory), as opposed to a run directory that holds checkpoints."""
    return os.path.isfile(path) or bool(re.search(r"ckpt-\d+$", os.path.normpath(path))) \
        or os.path.isfile(os.path.join(path, "meta.pt"))


def is_complete(path: str) -> bool:
    return os.path.isfile(path) or os.path.isfile(os.path.join(path, COMPLETE))


def read_checkpoint(path: str, required=INFERENCE_KEYS, with_tensors: bool = True) -> dict:
    """The checkpoint at `path` as one dict, with the `required` entries checked; CheckpointError
    names the file at fault. Of a DCP directory, the TENSORS entries in `required` are read into
    this process, whole (inference, init_from); with_tensors=False reads meta.pt alone (a training
    run loads its tensors itself, sharded: `load_training_state`)."""
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, COMPLETE)):
            raise CheckpointError(f"{path}: incomplete (no {COMPLETE} marker: the job stopped while saving it)")
        ckpt = load_file(os.path.join(path, "meta.pt"), mmap=False)
        if not isinstance(ckpt, dict):
            raise CheckpointError(f"{path}/meta.pt: not an aed checkpoint's meta.pt")
        if isinstance(ckpt.get("shards"), int):
            raise CheckpointError(f"{path}: per-rank shard files (shard-*.pt) of aed before DCP checkpoints; "
                                  f"convert it once: python tools/upgrade_checkpoint.py {path} -o NEW_RUN_DIR")
        check_dcp_files(path)
        if with_tensors:
            ckpt |= read_dcp(path, [k for k in TENSORS if k in required])
        else:
            required = [k for k in required if k not in TENSORS]
    else:
        ckpt = load_file(path, mmap=False)
    missing = [k for k in required if not isinstance(ckpt, dict) or k not in ckpt]
    if missing:
        raise CheckpointError(f"{path}: not a complete aed checkpoint (no {', '.join(missing)})")
    return ckpt


def check_dcp_files(path: str) -> None:
    """CheckpointError unless DCP's index is readable and every file it points into is there, at
    least as long as the index says (a disk that filled up, a copy cut short)."""
    try:
        index = dcp.FileSystemReader(path).read_metadata()
    except Exception as e:  # noqa: BLE001 - missing, truncated, not a DCP index
        raise CheckpointError(f"{path}/.metadata: unreadable ({type(e).__name__}: {str(e)[:200]})") from None
    ends = {}
    for item in index.storage_data.values():
        ends[item.relative_path] = max(ends.get(item.relative_path, 0), item.offset + item.length)
    for name, end in sorted(ends.items()):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise CheckpointError(f"{file}: missing")
        if os.path.getsize(file) < end:
            raise CheckpointError(f"{file}: truncated ({os.path.getsize(file)} of {end} bytes)")


def read_dcp(path: str, keys: list[str]) -> dict:
    """The `keys` entries of a DCP directory, whole, in this process (no distributed world needed):
    tensors are allocated from DCP's own index."""
    if not keys:
        return {}
    state = {}
    try:
        with quiet_single_process():
            _load_state_dict(state, storage_reader=dcp.FileSystemReader(path),
                             planner=_EmptyStateDictLoadPlanner(keys=set(keys)), no_dist=True)
    except Exception as e:  # noqa: BLE001 - a missing or truncated .distcp file, a corrupt index
        raise CheckpointError(f"{path}: unreadable ({type(e).__name__}: {str(e)[:200]})") from None
    return state


def read_ema(path: str) -> dict:
    """The EMA weights of the checkpoint at `path`, {parameter name: fp32 tensor}, whole in this
    process (infer.py --ema); CheckpointError when it has none."""
    ema = read_dcp(path, ["ema"]).get("ema") if os.path.isdir(path) else load_file(path, mmap=False).get("ema")
    if ema is None:
        raise CheckpointError(f"{path} holds no EMA of the weights: its run trained without ema_decay "
                              "(leave out --ema to decode its weights)")
    return ema


def load_file(path: str, mmap: bool):
    try:
        return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)
    except Exception as e:  # noqa: BLE001 - missing, truncated, corrupt, not a torch file: all unreadable
        raise CheckpointError(f"{path}: unreadable ({type(e).__name__}: {str(e)[:200]})") from None


def load_latest(run_dir: str, required=TRAINING_KEYS,
                with_tensors: bool = True) -> tuple[str, dict] | tuple[None, None]:
    """The newest valid checkpoint of `run_dir` (`read_checkpoint`), or (None, None) when it has none. An invalid one
    (interrupted, truncated by a full disk, written by something else) is logged by name and the
    next older one tried; when checkpoints exist but none is valid, CheckpointError: starting from
    scratch silently would throw a run away."""
    paths = list_checkpoints(run_dir)
    problems = []
    for path in reversed(paths):
        try:
            ckpt = read_checkpoint(path, required, with_tensors)
        except CheckpointError as e:
            log.warning("skipping invalid checkpoint %s; trying an older one", e)
            problems.append(str(e))
            continue
        return path, ckpt
    if paths:
        raise CheckpointError(f"{run_dir} has {len(paths)} checkpoint(s) and none is valid:\n  "
                              + "\n  ".join(problems) + "\nmove them away to start this run from scratch")
    return None, None


def read_checkpoint_or_run(path: str, required=TRAINING_KEYS) -> tuple[str, dict]:
    """(path, checkpoint) of a checkpoint (a file or a `ckpt-*` directory) or of a run directory's
    newest valid one (`load_latest`): what every --ckpt of infer.py and the tools takes.
    FileNotFoundError names what is missing."""
    if os.path.isdir(path) and not is_checkpoint(path):
        newest, ckpt = load_latest(path, required)
        if ckpt is None:
            raise FileNotFoundError(f"{path}: a directory without ckpt-* checkpoints")
        return newest, ckpt
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such checkpoint file or run directory")
    return path, read_checkpoint(path, required)


def average_checkpoints(run_dir: str, count: int) -> tuple[list[str], dict]:
    """(paths, checkpoint) of the newest `count` valid checkpoints of run_dir, the checkpoint being
    the newest with its model weights replaced by their mean (ESPnet's and icefall's averaging:
    the mean of the last weights of a run sits nearer a wide minimum than any one of them).
    Integer buffers (BatchNorm's batch counter) keep the newest value."""
    paths = []
    for path in reversed(list_checkpoints(run_dir)):
        if len(paths) == count:
            break
        try:
            read_checkpoint(path, with_tensors=False)
            paths.append(path)
        except CheckpointError as e:
            log.warning("not averaging invalid checkpoint %s", e)
    if len(paths) < count:
        raise CheckpointError(f"{run_dir}: {len(paths)} valid checkpoint(s), asked to average {count} "
                              "(train.keep_last keeps that many; train.ckpt_every sets how far apart)")
    newest = read_checkpoint(paths[0])
    total = {k: v.double() if v.is_floating_point() else v for k, v in newest["model"].items()}
    for path in paths[1:]:
        for k, v in read_checkpoint(path)["model"].items():
            if v.is_floating_point():
                total[k] += v.double()
    newest["model"] = {k: (v / count).to(newest["model"][k].dtype) if v.is_floating_point() else v
                       for k, v in total.items()}
    return paths[::-1], newest


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
    # An FSDP2 model's parameters are DTensors: each full tensor is sharded as its parameter is.
    model.load_state_dict({k: distribute_tensor(v.to(own[k].dtype), own[k].device_mesh, own[k].placements)
                           if isinstance(own[k], DTensor) else v for k, v in loadable.items()}, strict=False)
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
