"""Train an attention encoder-decoder speech model (multilingual ASR + AST) with 2D bucketing.

    python train.py configs/tiny.yaml                                        # CPU, bundled data
    python train.py configs/tiny.yaml optim.lr=1e-3 max_steps=500            # key=value overrides
    python train.py configs/canary-1b.yaml buckets.yaml                      # + oom.py --out's batch sizes
    torchrun --nproc_per_node 8 train.py configs/canary-1b-flash.yaml \\
        train.manifests='[{path: /data/en.jsonl, weight: 2}, /data/de.jsonl]' run_dir=runs/flash
    torchrun --nnodes 4 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint $HEAD:29500 \\
        train.py configs/canary-1b-flash.yaml ...                            # many nodes
    aed-train configs/tiny.yaml                                              # installed (pip install .)
    torchrun --nproc_per_node 8 -m aed.cli_train configs/canary-1b-flash.yaml ...

`main()` reads top to bottom in the order things happen: build (config, processes, model and
optimizer, data) and resume (`start_run`), the loop, clean up (`finish_run`). What a run is made of lives in the modules it calls: the
model, optimizer, schedule and step (`aed/train_setup.py`, which oom.py builds and measures too),
the data (`aed/train_data.py`), checkpoints and exact resume (`aed/train_checkpoint.py`), the
attention guide and decoder restarts (`aed/train_guide.py`), validation
(`aed/train_validation.py`) and the progress line (`aed/train_progress.py`). Re-running the same
command resumes from the newest checkpoint in `run_dir`; SIGTERM / SIGUSR1 (a cluster job's time
limit) saves one and exits 0.
"""

import atexit
import json
import logging
import os
import random
import signal
import sys
import time
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch

from aed.config import ConfigError, to_dict
from aed.data_manifest import Faults, ManifestError
from aed.memory_measure import format_bytes
from aed.memory_oomptimizer import preflight_run
from aed.train_checkpoint import CheckpointWriter, DataPosition, resume_run, save_run
from aed.model_checkpoint import LM_FILE
from aed.train_config import OBJECTIVES, help_text, parse_config
from aed.train_data import TrainingData, build_training_data, save_transcript_lm
from aed.train_distributed import (Process, all_reduce, cleanup, exit_worker, init_distributed, is_distributed,
                                   peer_lost, wrap)
from aed.train_guide import GuideState, act_on_deafness, set_attention_guide
from aed.train_progress import Progress, RunLog, StepFlops, matmul_peak
from aed.train_setup import (ExponentialMovingAverage, TrainingSetup, build_training_setup, compile_layers,
                             count_targets, train_step)
from aed.train_validation import report_listening, validate

log = logging.getLogger(__name__)


def read_config(argv: list[str]):
    """`train.py CONFIG.yaml [MORE.yaml ...] [key=value ...]` -> TrainConfig and validation sets by
    name (`aed.train_config.parse_config`); --help prints this module's usage and every key with
    its type, default and description."""
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__ + "\nUsage: train.py CONFIG.yaml [MORE.yaml ...] [key=value ...]\n\nConfig keys (YAML sections = "
              "dotted prefixes), type = default, description:\n\n" + help_text())
        sys.exit(0)
    try:
        return parse_config(argv)
    except ConfigError as e:
        sys.exit(f"config error: {e}")


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
    a message naming it. Rank 0 logs the resolved config and saves it (and estimated bins, and the
    transcripts' n-gram) in run_dir."""
    try:
        setup = build_training_setup(cfg, proc.device)
        cfg = setup.cfg
        if proc.master:
            log.info("config:\n%s", json.dumps(to_dict(cfg), indent=2, default=str))
            with open(os.path.join(cfg.run_dir, "config.json"), "w") as f:
                json.dump(to_dict(cfg), f, indent=2, default=str)
        data = build_training_data(cfg, setup.tokenizer, proc.rank, proc.world_size,
                                   bins_out=os.path.join(cfg.run_dir, "bins.json") if proc.master else None)
        if proc.master and cfg.train.lm_order and OBJECTIVES[cfg.objective].reads_text:
            save_transcript_lm(cfg, setup.tokenizer, os.path.join(cfg.run_dir, LM_FILE))
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


def prepare_model(setup: TrainingSetup, data: TrainingData, proc: Process, ema: ExponentialMovingAverage | None,
                  step: int):
    """The model as the step runs it, after resume and the memory check: wrapped for DDP (FSDP is
    built sharded), its EMA started at rank 0's weights in a new run, its blocks compiled with
    `compile`. Returns wrap's (model to run, no_sync)."""
    cfg, model = setup.cfg, setup.model
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
    return parallel_model, no_sync


def next_batches(position: DataPosition, loader, grad_accum: int, progress: Progress, unreadable: Faults) -> list:
    """The next step's `grad_accum` non-empty micro-batches; audio that could not be read is counted."""
    micro = []
    while len(micro) < grad_accum:
        t_wait = time.perf_counter()
        batch = position.next_batch(loader)
        progress.data_wait_s += time.perf_counter() - t_wait
        unreadable.report(batch.errors, "training")
        progress.skipped_audio += len(batch.errors)
        if len(batch):
            micro.append(batch)
    return micro


def optimizer_step(setup: TrainingSetup, parallel_model, no_sync, micro: list, step: int, step_flops: StepFlops,
                   progress: Progress, ema: ExponentialMovingAverage | None, proc: Process) -> bool:
    """One training step on the micro-batches (`aed.train_setup.train_step`), counted in `progress`
    with every rank's FLOPs (the budget is global), then the EMA of the weights and the schedule.
    Returns whether the weights were updated (a non-finite gradient norm skips the update)."""
    cfg, model, device = setup.cfg, setup.model, proc.device
    num_targets = all_reduce(torch.tensor(float(count_targets(model, micro)), device=device))
    result, step_flop_count = step_flops.run(lambda: train_step(
        parallel_model, micro, setup.optimizer, setup.scaler, setup.spec_augment, setup.precision,
        cfg.optim.clip_grad, num_targets, proc.world_size, no_sync), micro)
    progress.add(model, micro, result, all_reduce(torch.tensor(float(step_flop_count), device=device)).item())
    if ema is not None and result.updated:
        ema.update(model, step)  # `step`: the optimizer steps before this one (the warm-up counts them)
    setup.scheduler.step()
    return result.updated


def log_progress(setup: TrainingSetup, data: TrainingData, progress: Progress, step_flops: StepFlops, run_log: RunLog,
                 step: int) -> None:
    """The progress line, and its values in metrics.jsonl with rank 0's realised shares of the audio."""
    values, line = progress.report(step, setup.scheduler.get_last_lr()[0], len(step_flops.cache))
    if data.counter.mix is not None:  # rank 0's realised shares of the audio since the start
        values |= data.counter.mix.values()
    run_log.write(values, step)
    log.info(line)


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


@dataclass
class Run:
    """What the loop carries from step to step."""

    setup: TrainingSetup
    data: TrainingData
    proc: Process
    val_names: list
    position: DataPosition
    ema: ExponentialMovingAverage | None
    guide: GuideState
    parallel_model: torch.nn.Module
    no_sync: object  # wrap's context manager factory, or None
    writer: CheckpointWriter
    run_log: RunLog
    unreadable: Faults
    progress: Progress
    received: list  # stop signals (catch_stop_signals)
    step: int
    loader: object = None  # the data iterator (DataPosition.start)
    last_validation: tuple[int, dict] | None = None  # (step, results)
    bad_steps: int = 0  # non-finite steps in a row
    step_flops: StepFlops = field(default_factory=StepFlops)


def start_run(cfg, val_names: list) -> Run:
    """Build (processes, model and optimizer, data), resume (or initialise from init_from), check
    memory, wrap and compile; then validate a new run once before its first step."""
    proc = start_process(cfg)
    setup, data = build(cfg, proc)
    cfg = setup.cfg
    position = DataPosition(data, proc)
    ema = ExponentialMovingAverage(setup.model, cfg.ema_decay) if cfg.ema_decay else None  # before the memory check
    step, flops, guide = resume_run(setup, position, ema)
    if cfg.memory_budget:
        preflight_run(setup, data, proc, ema)
    parallel_model, no_sync = prepare_model(setup, data, proc, ema, step)
    received = catch_stop_signals()
    writer = CheckpointWriter(cfg.run_dir, cfg.keep_last, proc.rank, cfg.async_checkpoint, is_distributed())
    peak = matmul_peak(proc.device, setup.precision)  # per device: MFU is FLOP/s per rank over this
    log.info("matmul peak %.3g FLOP/s per device (%s, measured); FLOPs so far %.4g%s", peak, setup.precision, flops,
             f" of a {cfg.budget_flops:.4g} budget" if cfg.budget_flops else "")
    progress = Progress(proc.device, proc.world_size, cfg, cfg.features.hop_length / cfg.features.sample_rate, peak,
                        step, flops)
    run = Run(setup, data, proc, val_names, position, ema, guide, parallel_model, no_sync, writer,
              RunLog(cfg.run_dir, proc.master, resumed_step=step), Faults(), progress, received, step)
    if step == 0 and cfg.val.every > 0:
        validated(run)
    run.loader = position.start()
    atexit.register(stop_workers, run)
    return run


def stop_workers(run: Run) -> None:
    """The workers ignore SIGTERM (aed.data_batch.ignore_stop_signals), so multiprocessing's own exit
    hook, which terminates them with SIGTERM and then waits, would hang: release the iterator first,
    which shuts them down cleanly. Registered after that hook, so it runs before it."""
    run.loader = None


def validated(run: Run) -> dict:
    """Validation at the current step (every rank validates at the same steps), kept as the last."""
    with run.progress.paused():
        results = validate(run.setup, run.val_names, run.proc, run.unreadable, run.run_log, run.step, run.ema)
    run.last_validation = run.step, results
    return results


def watch_attention(run: Run, micro: list) -> None:
    """The attention guide's check on this step's first batch: the guide stays, goes, or the decoder
    is restarted; a run whose decoder cannot learn to listen saves and stops with the reason."""
    deaf = set_attention_guide(run.setup, micro[0], run.step, run.guide)
    if deaf is None:
        return
    if run.last_validation is None and run.setup.cfg.val.every > 0:  # resumed: the decision needs the CTC head's WER
        validated(run)
    if stop_message := act_on_deafness(run.setup, run.guide, run.step, deaf,
                                       run.last_validation and run.last_validation[1], run.ema):
        save_run(run.writer, run.setup, run.position, run.step, run.progress.total_flops, run.ema, run.guide)
        run.writer.finish()
        sys.exit(stop_message)


def count_bad_step(run: Run, updated: bool, micro: list) -> None:
    """A non-finite gradient norm skips the update; max_bad_steps of them in a row stop the run."""
    run.bad_steps = 0 if updated else run.bad_steps + 1
    if run.bad_steps:
        log.warning("step %d: non-finite gradient norm, update skipped (%d in a row)", run.step + 1, run.bad_steps)
        if run.bad_steps >= run.setup.cfg.max_bad_steps:
            sys.exit(f"aborting: {run.bad_steps} consecutive non-finite steps (lower optim.lr, check the "
                     f"data, or use precision=fp32); last batch: {micro[-1].where}")


def after_step(run: Run) -> bool:
    """The progress line, validation and checkpoints due at this step; whether to stop (a signal).
    A preempted job has a grace period (often ~30 s) to save: a signal skips validation, and one
    that arrives during validation or a save stops right after it, not after another step."""
    cfg, step, progress, device = run.setup.cfg, run.step, run.progress, run.proc.device
    last = step == cfg.max_steps or progress.budget_spent()
    if step % cfg.log_every == 0 or last:
        log_progress(run.setup, run.data, progress, run.step_flops, run.run_log, step)
    stop = stop_requested(run.received, device)
    if not stop and cfg.val.every > 0 and (step % cfg.val.every == 0 or last):
        run.guide.validated(validated(run))
        stop = stop_requested(run.received, device)
    if stop or step % cfg.ckpt_every == 0 or last:
        save_run(run.writer, run.setup, run.position, step, progress.total_flops, run.ema, run.guide)
        stop = stop or stop_requested(run.received, device)
    run.writer.poll()
    if progress.budget_spent():
        log.info("FLOP budget spent at step %d: %.4g of %.4g FLOPs", step, progress.total_flops, cfg.budget_flops)
    if stop:
        log.info("stopping on signal at step %d; rerun the same command to resume", step)
    return stop


def finish_run(run: Run) -> None:
    """Whether the decoder listens (at a final validation), what was skipped, the last checkpoint
    complete, the workers and the process group ended."""
    if run.proc.master and run.last_validation is not None and run.last_validation[0] == run.step and run.step > 0:
        report_listening(run.last_validation[1], run.step)
    if skipped := run.data.skipped(run.unreadable):  # readers', sampler's and batches' skips, on this rank
        log.info("rank %d skipped, by kind: %s", run.proc.rank, ", ".join(f"{k} {n:,}" for k, n in skipped.items()))
    run.writer.finish()  # the last checkpoint is complete before the process ends
    run.run_log.close()
    stop_workers(run)
    atexit.unregister(stop_workers)  # main() may return into a program that goes on (the tests run it so)
    cleanup()


def main(argv: list[str] | None = None) -> None:
    """A training run, `python train.py ARGS` with argv = ARGS."""
    run = start_run(*read_config(sys.argv[1:] if argv is None else argv))
    cfg = run.setup.cfg
    while run.step < cfg.max_steps and not run.progress.budget_spent():
        micro = next_batches(run.position, run.loader, cfg.optim.grad_accum, run.progress, run.unreadable)
        if cfg.train.attention_guide:
            watch_attention(run, micro)
        updated = optimizer_step(run.setup, run.parallel_model, run.no_sync, micro, run.step, run.step_flops,
                                 run.progress, run.ema, run.proc)
        count_bad_step(run, updated, micro)
        run.step += 1
        if after_step(run):
            break
    finish_run(run)


def cli() -> None:
    """The command: `main()` on sys.argv, and how a rank's process ends (train.py, aed-train)."""
    try:
        main()
    except RuntimeError as e:
        if not peer_lost(e):
            raise
        # The rank that failed first logs its own reason; the others would only show a broken socket.
        sys.exit(f"stopping: a peer rank exited or lost its connection ({str(e).splitlines()[0][:200]}); "
                 "the log of the rank that failed first says why")
    exit_worker()  # skips the interpreter's finalization, which can abort a finished rank (see exit_worker)


if __name__ == "__main__":
    cli()
