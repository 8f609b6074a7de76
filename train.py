"""Train an attention encoder-decoder speech model (multilingual ASR + AST) with 2D bucketing.

    python train.py configs/tiny.yaml                                        # CPU, bundled data
    python train.py configs/tiny.yaml optim.lr=1e-3 max_steps=500            # key=value overrides
    python train.py configs/canary-1b.yaml buckets.yaml                      # + oom.py --out's batch sizes
    torchrun --nproc_per_node 8 train.py configs/canary-1b-flash.yaml \\
        train.manifests='[{path: /data/en.jsonl, weight: 2}, /data/de.jsonl]' run_dir=runs/flash
    torchrun --nnodes 4 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint $HEAD:29500 \\
        train.py configs/canary-1b-flash.yaml ...                            # many nodes

`main()` reads top to bottom in the order things happen: build (config, processes, model and
optimizer, data), resume, loop, clean up; each helper sits above its first use. What a run is made
of lives in `aed/`: the model, optimizer and schedule (`aed/train_setup.py`, which oom.py builds
too), the data (`aed/train_data.py`), the step (`aed.train_setup.train_step`, the function oom.py
measures), validation (`aed/train_validation.py`) and the progress line (`aed/train_progress.py`). Re-running
the same command resumes from the newest checkpoint in `run_dir`; SIGTERM / SIGUSR1 (a cluster
job's time limit) saves one and exits 0.
"""

import atexit
import dataclasses
import json
import logging
import os
import random
import signal
import sys
import time
import warnings
from contextlib import nullcontext
from typing import NamedTuple

import numpy as np
import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from aed.config import ConfigError, to_dict
from aed.data_manifest import Faults, ManifestError
from aed.data_sources import ManifestEntry
from aed.memory_measure import format_bytes, parse_bytes
from aed.memory_oomptimizer import MemoryBudgetError, TrainingStep, preflight
from aed.model_checkpoint import Checkpoint, CheckpointError, load_latest, pack_dir
from aed.train_checkpoint import (CheckpointWriter, init_from_checkpoint, load_training_state, rng_state, set_rng_state,
                                  training_tensors)
from aed.train_config import help_text, load_train_config
from aed.train_data import TrainingData, build_training_data
from aed.train_distributed import (all_reduce, cleanup, exit_worker, gather_objects, init_distributed, is_distributed,
                                   peer_lost, share_rank0_buffers, torchrun_restart, wrap)
from aed.train_progress import Progress, RunLog, StepFlops, matmul_peak
from aed.train_setup import (ExponentialMovingAverage, TrainingSetup, build_training_setup, compile_layers,
                             count_targets, train_step)
from aed.train_validation import (LISTENING_GAP, batch_listening_gap, evaluate, listening_gaps, listens, not_listening,
                                  whole_model)

log = logging.getLogger("train")


# --- config -----------------------------------------------------------------------------------


def parse_config(argv: list[str]):
    """`train.py CONFIG.yaml [MORE.yaml ...] [key=value ...]` -> TrainConfig and validation set
    names (later files override earlier ones, e.g. oom.py --out's buckets); --help prints every
    key with its type, default and description."""
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__ + "\nUsage: train.py CONFIG.yaml [MORE.yaml ...] [key=value ...]\n\nConfig keys (YAML sections = "
              "dotted prefixes), type = default, description:\n\n" + help_text())
        sys.exit(0)
    try:
        files = next((i for i, a in enumerate(argv) if "=" in a), len(argv))  # the YAML files come first
        cfg = load_train_config(argv[:files], argv[files:])
        return cfg, val_set_names(cfg.val.manifests)
    except ConfigError as e:
        sys.exit(f"config error: {e}")


def val_set_names(specs: list) -> dict:
    """Metric prefix -> ManifestEntry per validation set (val.manifests): its file stem, or
    folder_stem when stems repeat (data/mini/dev.jsonl and data/mini/digits/dev.jsonl -> mini_dev,
    digits_dev). A Shar or shard directory is named by the directory, a NeMo set or parquet files by
    the folder that holds them."""
    entries = [ManifestEntry.of(spec) for spec in specs]
    paths = [named_path(entry) for entry in entries]
    stems = [os.path.splitext(os.path.basename(p))[0] for p in paths]
    names = [f"{os.path.basename(os.path.dirname(os.path.abspath(p)))}_{s}" if stems.count(s) > 1 else s
             for p, s in zip(paths, stems)]
    if len(set(names)) < len(names):
        raise ConfigError(f"val.manifests need distinct file or folder names, got {paths}")
    return dict(zip(names, entries))


def named_path(entry: ManifestEntry) -> str:
    """The path that names a validation entry: its manifest or directory, or the folder of its files."""
    if entry.kind in ("shar", "shards", "manifest"):
        return os.path.normpath(entry.location)
    return os.path.dirname(os.path.abspath(entry.location))  # nemo: its tars' pattern; parquet: its glob


# --- processes -------------------------------------------------------------------------------


class Process(NamedTuple):
    rank: int
    world_size: int
    device: torch.device

    @property
    def master(self) -> bool:
        return self.rank == 0


def start_process(cfg) -> Process:
    """Joins the torchrun world (if any), sets up logging (rank 0 at INFO, others warnings only),
    CPU threads and seeds: dropout and SpecAugment differ per rank; data order is the sampler's."""
    rank, _, world_size, device = init_distributed(group_of_one=cfg.train.strategy == "fsdp")
    if world_size == 1:  # DCP's background writes would say, once, that they assume one process
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s [rank {rank}] %(message)s", datefmt="%H:%M:%S")
    os.makedirs(cfg.run_dir, exist_ok=True)
    if device.type == "cpu":  # OpenMP threads that outnumber free cores spin and stall every op
        torch.set_num_threads(cfg.cpu_threads or max(1, len(os.sched_getaffinity(0)) // world_size
                                                     - cfg.train.num_workers))
    torch.manual_seed(cfg.seed + rank)
    random.seed(cfg.seed + rank)
    np.random.seed(cfg.seed + rank)
    return Process(rank, world_size, device)


def build(cfg, proc: Process) -> tuple[TrainingSetup, TrainingData]:
    """The run's model, optimizer and schedule, then its data; a config or data problem exits with
    a message naming it. Rank 0 logs the resolved config and saves it (and estimated bins) in run_dir."""
    try:
        setup = build_training_setup(cfg, proc.device)
        cfg = setup.cfg
        if proc.master:
            log.info("config:\n%s", json.dumps(to_dict(cfg), indent=2, default=str))
            with open(os.path.join(cfg.run_dir, "config.json"), "w") as f:
                json.dump(to_dict(cfg), f, indent=2, default=str)
        data = build_training_data(cfg, setup.tokenizer, proc.rank, proc.world_size,
                                   bins_out=os.path.join(cfg.run_dir, "bins.json") if proc.master else None)
    except ConfigError as e:
        sys.exit(f"config error: {e}")
    except ManifestError as e:
        sys.exit(f"data error: {e}")
    if setup.precision != "fp32" and proc.device.type == "cpu":
        # docs/training.md has the measurement behind this warning
        log.warning("precision=%s on CPU: autocast's casts cost more than they save for small models; "
                    "measure both, or use precision=auto (fp32 on CPU)", setup.precision)
    log.info("%s", setup.describe())
    return setup, data


def check_memory(setup: TrainingSetup, data: TrainingData, proc: Process, ema: ExponentialMovingAverage | None) -> None:
    """memory_budget: the worst batch of every bucket runs once before step 0 (aed/memory_oomptimizer.py).
    Before the DDP wrap, whose gradient hooks must not fire during the check; an FSDP model runs
    its real, sharded step. The EMA of the weights, if kept, counts as state held through it."""
    cfg = setup.cfg
    try:
        peaks = preflight(TrainingStep.of(setup, ddp=proc.world_size > 1 and setup.cfg.train.strategy == "ddp",
                                          ema=ema),
                          setup.bucket_shapes(data.bins, cfg.train.max_tps), data.sampler.sizes,
                          parse_bytes(cfg.memory_budget))
    except MemoryBudgetError as e:
        sys.exit(f"preflight: {e}")
    log.info("preflight: all %d buckets fit %s (largest peak %s)", len(peaks), cfg.memory_budget,
             format_bytes(max(peaks)))
    if proc.device.type == "cuda":  # the progress line's peak memory is the training's, not the check's
        torch.cuda.reset_peak_memory_stats(proc.device)


# --- checkpoints ------------------------------------------------------------------------------


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


@dataclasses.dataclass
class GuideState:
    """Where train.attention_guide_until=listening stands, kept in checkpoints so that a resumed run
    guides the same steps: the step the guide ended at, whether a check is due at the next step
    (the last one found no rank with two rows to swap audio between), the step it last (re)started
    at, and the decoder restarts so far. A run that stopped on a decoder that does not listen saved
    a check as due: resumed, it checks at once, and restarts the decoder if the config now allows.
    After the guide ended, a due check is validation's request to look again (`validate`)."""
    ended: int | None = None
    check_due: bool = False
    start: int = 0
    restarts: int = 0


def resume(setup: TrainingSetup, position: DataPosition, proc: Process,
           ema: ExponentialMovingAverage | None) -> tuple[int, float, GuideState]:
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


def save(writer: CheckpointWriter, setup: TrainingSetup, position: DataPosition, step: int, flops: float,
         proc: Process, ema: ExponentialMovingAverage | None, guide: GuideState) -> None:
    """Every rank writes its part of the weights, optimizer state and EMA (aed/train_checkpoint.py, DCP); rank
    0 adds the gathered sampler and RNG states (`DataPosition.state`). Under DDP, also checks that
    the ranks' parameters are identical (a desync would otherwise go unnoticed)."""
    cfg, model = setup.cfg, setup.model
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
                           varied_edges=tuple(cfg.augment.edge_seconds) if cfg.augment.edge_prob > 0 else None,  # ... or not
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


# --- the loop's helpers -----------------------------------------------------------------------


def catch_stop_signals() -> list:
    """SIGTERM / SIGUSR1 (a cluster job's time limit or preemption) are recorded, not fatal: the
    loop saves a checkpoint and exits 0. Returns the list the signals are appended to."""
    received = []
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, lambda signum, frame: received.append(signum))
    return received


def stop_requested(received: list, device: torch.device) -> bool:
    """Whether any rank got a stop signal: all ranks stop at the same step."""
    flag = torch.tensor(float(bool(received)), device=device)
    return bool(all_reduce(flag, op=torch.distributed.ReduceOp.MAX).item())


GUIDE_CHECK_EVERY = 50  # steps between the checks that end train.attention_guide once the decoder listens


def set_attention_guide(setup: TrainingSetup, batch, step: int, guide: GuideState) -> float | None:
    """Sets the model's guided-attention weight for this step (train.attention_guide: [weight, steps],
    counted from `guide.start`). With attention_guide_until=listening, every GUIDE_CHECK_EVERY steps
    the decoder's cross-entropy on this step's first batch is measured with other utterances' audio
    against its own; once the gap reaches validation's LISTENING_GAP, the guide ends for good: it has
    taught the decoder to use the audio, and holding attention to a path any longer only constrains
    it. A check that finds no batch of two rows (long utterances: often one per batch) is repeated at
    the next step until one does. The last check falls on the guide's last step: returns its gap when
    the decoder is still deaf there (`act_on_deafness` takes it from there), else None. A check due
    after the guide ended (validation found the decoder deaf) brings the guide back, for its steps,
    if the training batch agrees."""
    cfg, model = setup.cfg, setup.model
    weight, steps = cfg.train.attention_guide
    since = step - guide.start
    deaf_at_end = None
    recheck = guide.ended is not None and guide.check_due
    if recheck or (guide.ended is None and 0 < since and (since % GUIDE_CHECK_EVERY == 0 or since == steps
                                                         or guide.check_due)
                   and (since <= steps or guide.check_due) and cfg.train.attention_guide_until == "listening"):
        def whole():  # the copy validation decodes with: a sharded model's layers run only inside its forward
            return whole_model(model, lambda: setup.objective.build(cfg, setup.tokenizer.vocab_size))

        gap = batch_listening_gap(whole, batch, next(model.parameters()).device, setup.precision, cfg.freeze)
        guide.check_due = gap is None
        if gap is None and step % GUIDE_CHECK_EVERY == 0:  # once per period, so a run that never can measure says so
            log.info("step %d: no rank has two utterances in its batch to swap audio between: the attention guide's "
                     "check is repeated at the next steps until one has", step)
        if gap is not None and recheck:
            if gap < LISTENING_GAP:
                log.warning("*** step %d: the decoder no longer uses the audio (%.2f nats/token on its training batch, "
                            "and deaf at the last validation), though it did when its attention guide ended at step "
                            "%d: the guide resumes for up to %d steps ***", step, gap, guide.ended, int(steps))
                guide.ended, guide.start, since = None, step, 0
            else:
                log.info("step %d: the decoder's cross-entropy on its training batch is %.2f nats/token higher with "
                         "other utterances' audio than with its own: it listens, the attention guide stays off", step, gap)
        elif gap is not None:
            if gap >= LISTENING_GAP:
                guide.ended = step
            elif since >= steps:
                deaf_at_end = gap
            log.info("step %d: the decoder's cross-entropy on its training batch is %.2f nats/token higher with "
                     "other utterances' audio than with its own: %s", step, gap,
                     "it listens, attention guide off" if guide.ended is not None else
                     "the guide's steps are over" if deaf_at_end is not None else
                     f"attention guide stays on until {LISTENING_GAP} (or step {guide.start + int(steps)})")
    ramp = cfg.train.attention_guide_ramp
    weight *= min(1.0, since / ramp) if ramp else 1.0  # weak while the CTC head that sets the path is still untrained
    model.attention_guide = weight if since < steps and guide.ended is None else 0.0
    model.guide_to, model.guide_heads = cfg.train.attention_guide_to, cfg.train.attention_guide_heads
    return deaf_at_end


# A CTC head at or above this WER on every validation set has not learned the sounds (greedy, where
# an untrained head's blanks and babble score 100%).
ENCODER_LEARNED = 90.0
DECODER = ("decoder.", "encoder_decoder_proj.")  # the parameters a decoder restart draws anew


def restart_decoder(setup: TrainingSetup, step: int, ema: ExponentialMovingAverage | None) -> None:
    """Gives the decoder (and the projection into it) the weights a new model of this config would
    draw, seeded by the step so that every rank draws the same, and drops their optimizer moments;
    the encoder and CTC head keep what they have learned. A decoder that has settled on predicting
    the text from the text alone gets little gradient toward the audio; a fresh one meets an encoder
    that already tells sounds apart, and the guide points it at them again."""
    cfg, model = setup.cfg, setup.model
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed + step)
        fresh = setup.objective.build(cfg, setup.tokenizer.vocab_size).state_dict()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith(DECODER):
                new = fresh[name].to(p.device, p.dtype)
                if isinstance(p, DTensor):  # FSDP2: this rank's shard of the same full tensor
                    new = distribute_tensor(new, p.device_mesh, p.placements)
                p.copy_(new)
                setup.optimizer.state.pop(p, None)  # AdamW starts its moments anew at the next step
    if ema is not None:
        ema.reset(model)


def act_on_deafness(setup: TrainingSetup, guide: GuideState, step: int, gap: float, validation: dict | None,
                    ema: ExponentialMovingAverage | None) -> str | None:
    """The guide's steps ended with a decoder that does not use the audio (its training-batch gap
    `gap`, under LISTENING_GAP): restart the decoder and guide it again, up to train.decoder_restarts
    times, saying so in one line; after that, or at once when the last validation found the CTC
    head's WER near 100% (an encoder that has not learned the sounds gives a new decoder nothing to
    listen to either), the message the run stops with: what was measured and what to try. Every
    rank decides alike: the gap is all-reduced, validation's results are the same on every rank."""
    cfg = setup.cfg
    steps = int(cfg.train.attention_guide[1])
    ctc = {k: v for k, v in (validation or {}).items() if k.endswith("/ctc_wer")}
    heard = ", ".join(f"{k[:-len('/ctc_wer')]} {v:.1f}%" for k, v in ctc.items())
    measured = (f"after {steps} guided steps (step {step}) the decoder's cross-entropy on its training batch is "
                f"{gap:+.2f} nats/token with other utterances' audio (a decoder that listens: over {LISTENING_GAP})"
                + (f"; the CTC head's WER at the last validation: {heard}" if heard else ""))
    encoder_learned = min(ctc.values()) < ENCODER_LEARNED if ctc else None
    if guide.restarts < cfg.train.decoder_restarts and encoder_learned is not False:
        restart_decoder(setup, step, ema)
        guide.restarts, guide.start, guide.ended, guide.check_due = guide.restarts + 1, step, None, False
        log.warning("*** the decoder does not use the audio: %s. Restarting the decoder from fresh weights on the encoder "
                    "trained so far, guided again for up to %d steps (restart %d of train.decoder_restarts=%d) ***",
                    measured, steps, guide.restarts, cfg.train.decoder_restarts)
        return None
    guide.check_due = True  # resumed, the run checks again at once
    advice = ("The encoder has learned the sounds (the CTC head transcribes them) but the decoder does not attend "
              "to them: raise train.attention_guide's weight or steps, or train.decoder_restarts"
              if encoder_learned else
              "The encoder has not learned the sounds either (the CTC head's WER is near 100%): the decoder has "
              "nothing to listen to. Check that the transcripts belong to their audio (tools/inspect_data.py), "
              "lower optim.lr or raise optim.warmup_steps, or train the encoder alone first (model.ctc_weight, "
              "init_from with init_encoder_only)" if encoder_learned is False else
              "Validate (val.manifests, val.every) with a CTC head (model.ctc_weight > 0) to see whether the encoder "
              "has learned the sounds; "
              "check that the transcripts belong to their audio (tools/inspect_data.py)")
    return (f"stopping: the decoder does not use the audio after {guide.restarts} decoder restart(s): {measured}. "
            f"Training on would make a language model of the text. {advice} (docs/training.md). Rerun the same "
            f"command to resume from this step with a changed config (raising train.decoder_restarts restarts the "
            f"decoder again).")


def validate(setup: TrainingSetup, val_names: dict, proc: Process, unreadable: Faults,
             run_log: RunLog, step: int, ema: ExponentialMovingAverage | None) -> dict:
    """Every rank calls this at the same step (aed/train_validation.py); rank 0 logs and records it,
    with `val/listening` (1 or 0: whether the decoder uses the audio on every set). With an EMA of
    the weights, validation scores the EMA (what infer.py --ema decodes), swapped into the model for
    the duration. Returns the results."""
    t0 = time.time()
    with ema.swapped(setup.model) if ema is not None else nullcontext():
        model = whole_model(setup.model, lambda: setup.objective.build(setup.cfg, setup.tokenizer.vocab_size))
        # train.skip_invalid is one switch for all of a run's manifests, validation's included
        res = evaluate(setup, model, val_names, proc.rank, proc.world_size, setup.cfg.train.skip_invalid, unreadable)
    heard = listens(res)
    run_log.write({f"val/{k}": v for k, v in res.items()} | {"val/seconds": time.time() - t0}
                  | ({} if heard is None else {"val/listening": float(heard)}), step)
    for k, v in res.items():
        if isinstance(v, list):
            for line in v:
                log.info("  %s", line)
    log.info("validation @ step %d%s: %s  (%.1f s)", step, " (EMA weights)" if ema is not None else "", "  ".join(
        f"{k}={v:.2f}" for k, v in res.items() if isinstance(v, float)), time.time() - t0)
    if step > 0:  # at step 0 no decoder listens yet
        for line in not_listening(res):
            log.warning("step %d: %s", step, line)
    return res


def report_listening(results: dict, step: int) -> None:
    """The end of a run: whether the model it leaves uses the audio, from its last validation."""
    gaps = listening_gaps(results)
    if not gaps:
        return
    measured = ", ".join(f"{name} {gap:+.2f}" for name, gap in gaps.items())
    if listens(results):
        log.info("the final model (validated at step %d) uses the audio: its cross-entropy rises by %s nats/token "
                 "with other utterances' audio", step, measured)
    else:
        log.warning("*** the final model (validated at step %d) does not use the audio: its cross-entropy changes by "
                    "%s nats/token with other utterances' audio (under %g): it writes what a language model of the "
                    "training text would. Train longer, guide the attention (train.attention_guide), or check that "
                    "the transcripts belong to their audio (docs/training.md) ***", step, measured, LISTENING_GAP)


# --- the run ----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    cfg, val_names = parse_config(sys.argv[1:] if argv is None else argv)

    # --- build: processes, model and optimizer, data
    proc = start_process(cfg)
    setup, data = build(cfg, proc)
    cfg, model, device = setup.cfg, setup.model, proc.device

    # --- resume (or initialise from init_from), check memory, wrap for DDP (FSDP is built sharded)
    position = DataPosition(data, proc)
    ema = ExponentialMovingAverage(model, cfg.ema_decay) if cfg.ema_decay else None  # before the memory check
    step, flops, guide = resume(setup, position, proc, ema)
    if cfg.memory_budget:
        check_memory(setup, data, proc, ema)
    parallel_model, no_sync = wrap(model, proc.world_size)
    if ema is not None:
        if step == 0:  # a new run's EMA starts at rank 0's weights, which the DDP wrap has just broadcast
            ema.reset(model)
        log.info("EMA of the weights, decay %g: %s on each rank; validation scores the EMA weights", cfg.ema_decay,
                 format_bytes(ema.nbytes))
    if cfg.compile:
        log.info("compile: %d blocks compiled (torch.compile); batches padded to their bucket's bounds, so each "
                 "compiles at most once per bucket (%d buckets; docs/training.md), at its first batch",
                 compile_layers(model, len(data.pad_to)), len(data.pad_to))

    # --- training loop
    received = catch_stop_signals()
    writer = CheckpointWriter(cfg.run_dir, cfg.keep_last, proc.rank, cfg.async_checkpoint, is_distributed())
    run_log = RunLog(cfg.run_dir, proc.master, resumed_step=step)
    unreadable = Faults()
    peak = matmul_peak(device, setup.precision)  # per device: MFU is FLOP/s per rank over this
    log.info("matmul peak %.3g FLOP/s per device (%s, measured); FLOPs so far %.4g%s", peak, setup.precision, flops,
             f" of a {cfg.budget_flops:.4g} budget" if cfg.budget_flops else "")
    progress = Progress(device, proc.world_size, cfg, cfg.features.hop_length / cfg.features.sample_rate, peak,
                        step, flops)
    last_validation = None  # (step, results) of the latest validation
    if step == 0 and cfg.val.every > 0:
        with progress.paused():
            last_validation = 0, validate(setup, val_names, proc, unreadable, run_log, 0, ema)
    step_flops, bad_steps = StepFlops(), 0
    loader = position.start()

    def stop_workers():
        """The workers ignore SIGTERM (aed.data_batch.ignore_stop_signals), so multiprocessing's own exit
        hook, which terminates them with SIGTERM and then waits, would hang: release the iterator
        first, which shuts them down cleanly. Registered after that hook, so it runs before it."""
        nonlocal loader
        loader = None

    atexit.register(stop_workers)
    while step < cfg.max_steps and not progress.budget_spent():
        micro = []
        while len(micro) < cfg.optim.grad_accum:
            t_wait = time.perf_counter()
            batch = position.next_batch(loader)
            progress.data_wait_s += time.perf_counter() - t_wait
            unreadable.report(batch.errors, "training")
            progress.skipped_audio += len(batch.errors)
            if len(batch):
                micro.append(batch)
        if cfg.train.attention_guide and (deaf := set_attention_guide(setup, micro[0], step, guide)) is not None:
            if last_validation is None and cfg.val.every > 0:  # resumed: the decision needs the CTC head's WER
                with progress.paused():
                    last_validation = step, validate(setup, val_names, proc, unreadable, run_log, step, ema)
            if stop_message := act_on_deafness(setup, guide, step, deaf, last_validation and last_validation[1], ema):
                save(writer, setup, position, step, progress.total_flops, proc, ema, guide)
                writer.finish()
                sys.exit(stop_message)
        num_targets = all_reduce(torch.tensor(float(count_targets(model, micro)), device=device))
        result, step_flop_count = step_flops.run(lambda: train_step(
            parallel_model, micro, setup.optimizer, setup.scaler, setup.spec_augment, setup.precision,
            cfg.optim.clip_grad, num_targets, proc.world_size, no_sync), micro)
        # every rank's FLOPs: the budget is global
        progress.add(model, micro, result, all_reduce(torch.tensor(float(step_flop_count), device=device)).item())
        bad_steps = 0 if result.updated else bad_steps + 1
        if bad_steps:
            log.warning("step %d: non-finite gradient norm, update skipped (%d in a row)", step + 1, bad_steps)
            if bad_steps >= cfg.max_bad_steps:
                sys.exit(f"aborting: {bad_steps} consecutive non-finite steps (lower optim.lr, check the "
                         f"data, or use precision=fp32); last batch: {micro[-1].where}")
        if ema is not None and result.updated:
            ema.update(model, step)  # `step`: the optimizer steps before this one (the warm-up counts them)
        setup.scheduler.step()
        step += 1

        last = step == cfg.max_steps or progress.budget_spent()
        if step % cfg.log_every == 0 or last:
            values, line = progress.report(step, setup.scheduler.get_last_lr()[0], len(step_flops.cache))
            if data.counter.mix is not None:  # rank 0's realised shares of the audio since the start
                values |= data.counter.mix.values()
            run_log.write(values, step)
            log.info(line)
        # A preempted job has a grace period (often ~30 s) to save: a signal skips validation, and
        # one that arrives during validation or a save stops right after it, not after another step.
        stop = stop_requested(received, device)
        if not stop and cfg.val.every > 0 and (step % cfg.val.every == 0 or last):
            with progress.paused():
                last_validation = step, validate(setup, val_names, proc, unreadable, run_log, step, ema)
            if guide.ended is not None and listens(last_validation[1]) is False:
                guide.check_due = True  # the next step looks at its training batch: the guide may resume
            stop = stop_requested(received, device)
        if stop or step % cfg.ckpt_every == 0 or last:
            save(writer, setup, position, step, progress.total_flops, proc, ema, guide)
            stop = stop or stop_requested(received, device)
        writer.poll()
        if progress.budget_spent():
            log.info("FLOP budget spent at step %d: %.4g of %.4g FLOPs", step, progress.total_flops, cfg.budget_flops)
        if stop:
            log.info("stopping on signal at step %d; rerun the same command to resume", step)
            break

    if proc.master and last_validation is not None and last_validation[0] == step and step > 0:
        report_listening(last_validation[1], step)

    # --- clean up
    if skipped := data.skipped(unreadable):  # readers', sampler's and batches' skips, on this rank
        log.info("rank %d skipped, by kind: %s", proc.rank, ", ".join(f"{k} {n:,}" for k, n in skipped.items()))
    writer.finish()  # the last checkpoint is complete before the process ends
    run_log.close()
    stop_workers()
    atexit.unregister(stop_workers)  # main() may return into a program that goes on (the tests run it so)
    cleanup()


if __name__ == "__main__":
    try:
        main()
    except RuntimeError as e:
        if not peer_lost(e):
            raise
        # The rank that failed first logs its own reason; the others would only show a broken socket.
        sys.exit(f"stopping: a peer rank exited or lost its connection ({str(e).splitlines()[0][:200]}); "
                 "the log of the rank that failed first says why")
    exit_worker()  # skips the interpreter's finalization, which can abort a finished rank (see exit_worker)
