"""Checkpoints written by a training run: through torch.distributed.checkpoint (DCP) on every rank,
published by a completion marker, older ones cleaned up; and what a run loads back from them (its
own tensors resharded, or another run's weights to start from). A whole run's state is saved by
`save_run` and put back by `resume_run`: weights, optimizer, schedule, the EMA of the weights, the
attention guide's state, and where the data stands (`DataPosition`: sampler and RNG states, for an
exact resume). What a checkpoint holds and how it
is read are aed/model_checkpoint.py's.

Under DDP every rank holds the same weights and DCP spreads their writing over the ranks; under
FSDP each rank writes its own shards. Either way the tensors are saved under their parameter
names, so a checkpoint resumes on any world size and under either strategy. `async_save` lets
training continue while the files are written.
"""

import dataclasses
import logging
import os
import random
import shutil
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor

from aed.config import to_dict
from aed.model_checkpoint import (COMPLETE, TENSORS, Checkpoint, CheckpointError, checkpoint_step, is_complete,
                                  list_checkpoints, load_latest, pack_dir, quiet_single_process, read_checkpoint)
from aed.train_data import TrainingData
from aed.train_distributed import (Process, barrier, gather_objects, is_distributed, share_rank0_buffers,
                                   torchrun_restart)
from aed.train_guide import GuideState
from aed.train_setup import ExponentialMovingAverage, TrainingSetup

log = logging.getLogger(__name__)


# --- writing --------------------------------------------------------------------------------------


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


# --- loading back into a run ------------------------------------------------------------------------


def training_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer, ema=None) -> dict:
    """{"model", "optimizer"} keyed by parameter name, as DCP saves them: whole tensors under DDP,
    this rank's shards (DTensors) under FSDP. The same keys under both strategies, so either one
    resumes the other. A fresh optimizer gets its (zero) state first, as DCP's loader needs it.
    With `ema` (aed.train_setup.ExponentialMovingAverage), also "ema": its tensors, sharded as the weights."""
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


# --- a run's state --------------------------------------------------------------------------------


class DataPosition:
    """Exact resume's bookkeeping, in one place: where this rank's data and random streams stand.
    `restore` puts a checkpoint's sampler and RNG states back; `start` and `next_batch` draw the
    training batches, counting those the loop takes; `state` is what a checkpoint saves of them:
    the sampler rewound by the batches the DataLoader prefetched (`data.counter`) but the loop did
    not take, and the RNG states."""

    def __init__(self, data: TrainingData, proc: Process):
        self.data, self.proc, self.consumed = data, proc, 0

    def restore(self, ckpt: Checkpoint, path: str) -> None:
        """A checkpoint of another world size continues its interrupted pass in other batches."""
        proc, sampler = self.proc, self.data.sampler
        saved_world = len(ckpt.sampler)
        if saved_world == proc.world_size:
            sampler.load_state_dict(ckpt.sampler[proc.rank])
        else:
            try:
                sampler.load_state_dict(sampler.regroup_state(ckpt.sampler))
            except ValueError as e:
                sys.exit(f"cannot resume {path}, written by {saved_world} ranks, on {proc.world_size}: {e}; "
                         f"resume with {saved_world} ranks or start a new run_dir with init_from={path}")
            log.warning("%s was written by %d ranks, this run has %d: weights, optimizer, schedule and step "
                        "continue exactly; the data continues the interrupted pass without repeating what was "
                        "trained in it, in other batches than %d ranks would have drawn", path, saved_world,
                        proc.world_size, saved_world)
        if proc.rank < saved_world:
            set_rng_state(ckpt.rng[proc.rank], proc.device)

    def start(self):
        """The DataLoader's batches from here on; draw them with `next_batch`."""
        self.consumed = self.data.counter.taken = 0
        return iter(self.data.loader(self.proc.device))

    def next_batch(self, loader):
        batch = next(loader)
        self.consumed += 1
        return batch

    def state(self) -> dict:
        """This rank's part of a checkpoint: {"rng": ..., "sampler": ...}."""
        return {"rng": rng_state(self.proc.device),
                "sampler": self.data.sampler.state_dict(rewind=self.data.counter.taken - self.consumed)}


def resume_run(setup: TrainingSetup, position: DataPosition, ema: ExponentialMovingAverage | None
               ) -> tuple[int, float, GuideState]:
    """(step, FLOPs so far, the attention guide's `GuideState`) of the newest valid checkpoint in
    run_dir, with the weights, optimizer, schedule, sampler and RNG states and the EMA of the weights
    restored; (0, 0.0, a new GuideState) for a new run, whose weights may come from init_from. A
    checkpoint of another world size continues its interrupted pass in other batches; one written
    without an EMA starts the EMA at its weights."""
    cfg = setup.cfg
    try:
        path, saved = load_latest(cfg.run_dir, with_tensors=False)
    except CheckpointError as e:
        sys.exit(f"cannot resume: {e}")
    restart, max_restarts = torchrun_restart()
    if restart:  # a rank failed, and torchrun stopped the others and started them all again
        log.info("restart %d of torchrun's --max-restarts %d: resuming from %s", restart, max_restarts,
                 path or "step 0 (no checkpoint yet)")
    if saved is None:
        if cfg.init_from:
            try:
                log.info("init_from %s: %s", cfg.init_from,
                         init_from_checkpoint(setup.model, cfg.init_from, cfg.init_encoder_only))
            except ValueError as e:
                sys.exit(str(e))
        return 0, 0.0, GuideState()
    if not load_training_state(setup.model, setup.optimizer, path, ema) and ema is not None:
        ema.reset(setup.model)
        log.info("%s has no EMA of the weights (written without ema_decay): the EMA starts from its weights", path)
    ckpt = Checkpoint.from_dict(saved | {"model": None})  # meta.pt: the tensors are loaded
    setup.scheduler.load_state_dict(ckpt.scheduler)
    setup.scaler.load_state_dict(ckpt.scaler)
    position.restore(ckpt, path)
    log.info("resumed from %s at step %d%s", path, ckpt.step, "" if ckpt.guide_ended is None else
             f" (its attention guide ended at step {ckpt.guide_ended}, when the decoder listened)")
    return ckpt.step, ckpt.flops, GuideState(ckpt.guide_ended, ckpt.guide_check_due, ckpt.guide_start,
                                             ckpt.guide_restarts)


def varied_edges(cfg, step: int) -> bool:
    """Whether the model at `step` has heard its utterances' edges varied: a model that has not (its
    edges begin after augment.edge_after batches) is decoded as one trained on them as read."""
    return cfg.augment.edge_prob > 0 and step * cfg.optim.grad_accum > cfg.augment.edge_after


def save_run(writer: CheckpointWriter, setup: TrainingSetup, position: DataPosition, step: int, flops: float,
             ema: ExponentialMovingAverage | None, guide: GuideState) -> None:
    """Every rank writes its part of the weights, optimizer state and EMA (DCP); rank 0 adds the
    gathered sampler and RNG states (`DataPosition.state`). Under DDP, also checks that the ranks'
    parameters are identical (a desync would otherwise go unnoticed)."""
    cfg, model, proc = setup.cfg, setup.model, position.proc
    t0 = time.time()
    sharded = cfg.train.strategy == "fsdp"
    checksum = None if sharded else sum(p.detach().double().sum().item() for p in model.parameters())
    states = gather_objects({"checksum": checksum} | position.state())
    share_rank0_buffers(model)
    state = training_tensors(model, setup.optimizer, ema)
    if proc.master:
        checksums = [s["checksum"] for s in states]
        if len(set(checksums)) > 1:
            raise RuntimeError(f"step {step}: ranks disagree on parameters (checksums {checksums})")
        state = Checkpoint(model_config=dataclasses.asdict(cfg.model), features=dataclasses.asdict(cfg.features),
                           tokenizer=pack_dir(cfg.train.tokenizer),
                           max_train_duration=position.data.bins.durations[-1],  # infer.py's chunk length
                           edge_silence=position.data.edge_silence,  # ... and the silence at its edges
                           trim_silence=cfg.train.trim_silence,  # ... cut as training cut it
                           varied_edges=tuple(cfg.augment.edge_seconds) if varied_edges(cfg, step) else None,  # ... or not
                           new_tokens=setup.added_tokens,  # a later run can still train only them
                           step=step, flops=flops, scheduler=setup.scheduler.state_dict(),
                           scaler=setup.scaler.state_dict(), sampler=[s["sampler"] for s in states],
                           rng=[s["rng"] for s in states], config=to_dict(cfg), guide_ended=guide.ended,
                           guide_check_due=guide.check_due, guide_start=guide.start,
                           guide_restarts=guide.restarts,
                           **state).to_dict()
    path = writer.save(state, step)
    log.info("%s %s in %.1f s%s", "saving" if writer.pending else "saved", path, time.time() - t0,
             "" if sharded else f" (parameter checksum {checksum:.6e}, equal on {proc.world_size} rank(s))")
