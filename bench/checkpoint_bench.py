"""Checkpoint save and load time at canary-1b scale: weights + AdamW moments, ~12 GB, through
torch.distributed.checkpoint (DCP), as train.py writes them.

    python bench/checkpoint_bench.py --dir /tmp/ckpt_bench              # canary-1b, ~10 min, ~13 GB RAM
    python bench/checkpoint_bench.py --dir /tmp/ckpt_bench --config configs/canary-180m-flash.yaml
    python bench/checkpoint_bench.py --dir /tmp/ckpt_bench --device cuda   # the state on a GPU, as in training

The model is built on the meta device, then materialised with random fp32 values, and AdamW's
exp_avg / exp_avg_sq are built as its state dict (a real step would need 4 GB more for gradients),
on the CPU or, with --device cuda, on the GPU where training holds them: then every save first
copies the state to host memory, and that copy is what async_save blocks the training loop for.
Measured, each from a fresh directory:

  single      one torch.save of everything by one process: what a rank-0-only format costs
  dcp/T       aed.train_checkpoint.write_tensors (DCP's save) with T writer threads: what the training
              loop waits for with train.async_checkpoint=false (T=2: two ranks on one node write at once)
  async       the same through DCP's async_save: "blocked" is when the training loop may go on
              (the state is copied, which needs as much free RAM again), "written" when the
              background thread has finished; skipped, and said so, when that copy does not fit
  load        read_checkpoint's model (what infer.py loads) into the model, cold page cache

"written" is when the call returned (the data is in the page cache: it survives the job being
killed, not the machine crashing), "on disk" adds os.sync(). Disk and CPU are shared with other
jobs: timings are noisy. The last line is a JSON object.
"""

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import proc_status_bytes  # noqa: E402

from aed.model_checkpoint import quiet_single_process, read_checkpoint  # noqa: E402
from aed.train_checkpoint import begin_checkpoint, publish_checkpoint, training_tensors, write_meta  # noqa: E402
from aed.train_config import OptimConfig  # noqa: E402
from aed.model import AED, AEDConfig  # noqa: E402
from aed.train_setup import build_optimizer  # noqa: E402


def training_state(config: str, device: str) -> tuple[AED, dict]:
    """A model with random weights on `device` and {"model", "optimizer"} state dicts of the right
    shapes (AdamW after one step)."""
    cfg = AEDConfig.from_yaml(config)  # with Canary's vocabulary: 1,017,825,408 parameters for canary-1b
    with torch.device("meta"):
        model = AED(cfg)
    model.to_empty(device=device)
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(-0.05, 0.05)
    optimizer = build_optimizer(model, OptimConfig())
    for p in model.parameters():
        optimizer.state[p] = {"step": torch.tensor(1.0), "exp_avg": torch.rand_like(p) * 1e-3,
                              "exp_avg_sq": torch.rand_like(p) * 1e-6}
    return model, training_tensors(model, optimizer)  # what train.py hands to DCP


def write_times(fn) -> tuple[float, float]:
    """(seconds fn() took to write, seconds until the writes reached the disk: os.sync after it)."""
    t0 = time.perf_counter()
    fn()
    written = time.perf_counter() - t0
    os.sync()
    return written, time.perf_counter() - t0


def save_dcp(state: dict, path: str, threads: int) -> None:
    """write_tensors' DCP save, with `threads` writer threads in this one process."""
    begin_checkpoint(path)
    write_meta({"step": 1}, path)
    with quiet_single_process():
        dcp.save(state, storage_writer=dcp.FileSystemWriter(path, thread_count=threads), no_dist=True)
    publish_checkpoint(path, os.path.dirname(path), 1, keep_last=1)


def available_bytes() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable"))


def drop_page_cache() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/canary-1b.yaml")
    p.add_argument("--dir", required=True, help="scratch directory on the disk to measure (emptied)")
    p.add_argument("--threads", default="1,2", help="DCP writer thread counts to time")
    p.add_argument("--device", default="cpu", help="where the state lives: cpu, or cuda as in GPU training")
    args = p.parse_args()
    torch.set_num_threads(1)

    t0 = time.perf_counter()
    model, state = training_state(args.config, args.device)
    gb = sum(v.nbytes for v in state["model"].values()) / 1e9
    gb += sum(t.nbytes for s in state["optimizer"]["state"].values() for t in s.values() if t.dim()) / 1e9
    n = sum(p.numel() for p in model.parameters())
    print(f"{args.config}: {n:,} parameters, {gb:.2f} GB with AdamW state (built in {time.perf_counter() - t0:.0f} s)")
    results = {"config": args.config, "device": args.device, "parameters": n, "gb": round(gb, 2)}

    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    single = os.path.join(args.dir, "single.pt")
    written, synced = write_times(lambda: torch.save(state, single))
    os.remove(single)
    print(f"single torch.save: written {written:.1f} s, on disk {synced:.1f} s ({gb / synced:.2f} GB/s)")
    results["single"] = {"written_s": round(written, 1), "on_disk_s": round(synced, 1)}

    for w in map(int, args.threads.split(",")):
        path = os.path.join(args.dir, f"ckpt-{w:08d}")
        written, synced = write_times(lambda: save_dcp(state, path, w))
        print(f"dcp/{w}: written {written:.1f} s, on disk {synced:.1f} s ({gb / synced:.2f} GB/s)")
        results[f"dcp/{w}"] = {"written_s": round(written, 1), "on_disk_s": round(synced, 1)}

    if available_bytes() > 1.2 * gb * 1e9:  # async_save copies the whole state first
        path = os.path.join(args.dir, "ckpt-async")
        begin_checkpoint(path)
        t0 = time.perf_counter()
        with quiet_single_process():
            future = dcp.async_save(state, checkpoint_id=path, no_dist=True)
        blocked = time.perf_counter() - t0
        future.result()
        written = time.perf_counter() - t0
        print(f"async: training blocked {blocked:.1f} s, written after {written:.1f} s")
        results["async"] = {"blocked_s": round(blocked, 1), "written_s": round(written, 1)}
    else:
        print(f"async: skipped, its copy of the {gb:.1f} GB state does not fit the {available_bytes() / 1e9:.1f} GB "
              f"of RAM left")
        results["async"] = None

    cold = drop_page_cache()
    t0 = time.perf_counter()
    ckpt = read_checkpoint(os.path.join(args.dir, f"ckpt-{w:08d}"), ("model",))
    read = time.perf_counter() - t0
    model.load_state_dict(ckpt["model"])
    loaded = time.perf_counter() - t0
    print(f"load ({'cold' if cold else 'warm'} page cache): weights read in {read:.1f} s, in the model after {loaded:.1f} s")
    results["load"] = {"read_s": round(read, 1), "weights_loaded_s": round(loaded, 1), "cold_cache": cold}
    results["peak_rss_gb"] = round(proc_status_bytes("VmHWM") / 1024 / 1e6, 2)  # (kB / 1e6, as before)
    shutil.rmtree(args.dir)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
