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
optimizer, data), resume, loop, clean up. What a run is made of lives in the modules it calls: the
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

import numpy as np
import torch

from aed.config import ConfigError, to_dict
from aed.data_manifest import Faults, ManifestError
from aed.memory_measure import format_bytes
from aed.memory_oomptimizer import preflight_run
from aed.train_checkpoint import CheckpointWriter, DataPosition, resume_run, save_run
from aed.train_config import help_text, parse_config
from aed.train_data import TrainingData, build_training_data
from aed.train_distributed import (Process, all_reduce, cleanup, exit_worker, init_distributed, is_distributed,
                                   peer_lost, wrap)
from aed.train_guide import act_on_deafness, set_attention_guide
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


def main(argv: list[str] | None = None) -> None:
    """A training run, `python train.py ARGS` with argv = ARGS."""
    cfg, val_names = read_config(sys.argv[1:] if argv is None else argv)

    # --- build: processes, model and optimizer, data
    proc = start_process(cfg)
    setup, data = build(cfg, proc)
    cfg, model, device = setup.cfg, setup.model, proc.device

    # --- resume (or initialise from init_from), check memory, wrap and compile
    position = DataPosition(data, proc)
    ema = ExponentialMovingAverage(model, cfg.ema_decay) if cfg.ema_decay else None  # before the memory check
    step, flops, guide = resume_run(setup, position, ema)
    if cfg.memory_budget:
        preflight_run(setup, data, proc, ema)
    parallel_model, no_sync = prepare_model(setup, data, proc, ema, step)

    # --- training loop
    received = catch_stop_signals()
    writer = CheckpointWriter(cfg.run_dir, cfg.keep_last, proc.rank, cfg.async_checkpoint, is_distributed())
    run_log, unreadable = RunLog(cfg.run_dir, proc.master, resumed_step=step), Faults()
    peak = matmul_peak(device, setup.precision)  # per device: MFU is FLOP/s per rank over this
    log.info("matmul peak %.3g FLOP/s per device (%s, measured); FLOPs so far %.4g%s", peak, setup.precision, flops,
             f" of a {cfg.budget_flops:.4g} budget" if cfg.budget_flops else "")
    progress = Progress(device, proc.world_size, cfg, cfg.features.hop_length / cfg.features.sample_rate, peak,
                        step, flops)

    def validated(at: int) -> tuple[int, dict]:  # (step, results): every rank validates at the same steps
        with progress.paused():
            return at, validate(setup, val_names, proc, unreadable, run_log, at, ema)

    last_validation = validated(0) if step == 0 and cfg.val.every > 0 else None
    step_flops, bad_steps, loader = StepFlops(), 0, position.start()

    def stop_workers():
        """The workers ignore SIGTERM (aed.data_batch.ignore_stop_signals), so multiprocessing's own exit
        hook, which terminates them with SIGTERM and then waits, would hang: release the iterator
        first, which shuts them down cleanly. Registered after that hook, so it runs before it."""
        nonlocal loader
        loader = None

    atexit.register(stop_workers)
    while step < cfg.max_steps and not progress.budget_spent():
        micro = next_batches(position, loader, cfg.optim.grad_accum, progress, unreadable)
        if cfg.train.attention_guide and (deaf := set_attention_guide(setup, micro[0], step, guide)) is not None:
            if last_validation is None and cfg.val.every > 0:  # resumed: the decision needs the CTC head's WER
                last_validation = validated(step)
            if stop_message := act_on_deafness(setup, guide, step, deaf, last_validation and last_validation[1], ema):
                save_run(writer, setup, position, step, progress.total_flops, ema, guide)
                writer.finish()
                sys.exit(stop_message)
        updated = optimizer_step(setup, parallel_model, no_sync, micro, step, step_flops, progress, ema, proc)
        bad_steps = 0 if updated else bad_steps + 1
        if bad_steps:
            log.warning("step %d: non-finite gradient norm, update skipped (%d in a row)", step + 1, bad_steps)
            if bad_steps >= cfg.max_bad_steps:
                sys.exit(f"aborting: {bad_steps} consecutive non-finite steps (lower optim.lr, check the "
                         f"data, or use precision=fp32); last batch: {micro[-1].where}")
        step += 1

        last = step == cfg.max_steps or progress.budget_spent()
        if step % cfg.log_every == 0 or last:
            log_progress(setup, data, progress, step_flops, run_log, step)
        # A preempted job has a grace period (often ~30 s) to save: a signal skips validation, and
        # one that arrives during validation or a save stops right after it, not after another step.
        stop = stop_requested(received, device)
        if not stop and cfg.val.every > 0 and (step % cfg.val.every == 0 or last):
            last_validation = validated(step)
            guide.validated(last_validation[1])
            stop = stop_requested(received, device)
        if stop or step % cfg.ckpt_every == 0 or last:
            save_run(writer, setup, position, step, progress.total_flops, ema, guide)
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
