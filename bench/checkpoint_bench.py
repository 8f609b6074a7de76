"""Checkpoint save and load time at canary-1b scale: weights + AdamW moments, ~12 GB.

    python bench/checkpoint_bench.py --dir /tmp/ckpt_bench              # canary-1b, ~10 min, ~13 GB RAM
    python bench/checkpoint_bench.py --dir /tmp/ckpt_bench --config configs/tiny.yaml   # a dry run

The model is built on the meta device, then materialised with random fp32 values, and AdamW's
exp_avg / exp_avg_sq are built as its state dict (a real step would need 4 GB more for gradients).
Measured, each from a fresh directory:

  single     one torch.save of everything (the format before sharding): what rank 0 alone did
  shards/W   aed.checkpoint.write_shard for W ranks, run in W threads, as W ranks on one node do
  load       read_checkpoint (shards memory-mapped) + load_state_dict into the model, cold page cache

"written" is when torch.save returned (the data is in the page cache: it survives the job being
killed, not the machine crashing), "on disk" adds os.sync(). Disk and CPU are shared with other
jobs: timings are noisy. The last line is a JSON object.
"""

import argparse
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from aed.checkpoint import begin_checkpoint, publish_checkpoint, read_checkpoint, write_shard  # noqa: E402
from aed.config import OptimConfig  # noqa: E402
from aed.model import AED, AEDConfig  # noqa: E402
from aed.training import build_optimizer  # noqa: E402

def training_state(config: str) -> tuple[AED, dict]:
    """A model with random weights and an AdamW state dict of the right shapes (after one step)."""
    cfg = AEDConfig.from_yaml(config)  # with Canary's vocabulary: 1,017,825,408 parameters for canary-1b
    with torch.device("meta"):
        model = AED(cfg)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(-0.05, 0.05)
    optimizer = build_optimizer(model, OptimConfig())
    ids = {id(p): i for i, p in enumerate(q for g in optimizer.param_groups for q in g["params"])}
    moments = {ids[id(p)]: {"step": torch.tensor(1.0), "exp_avg": torch.rand_like(p) * 1e-3,
                            "exp_avg_sq": torch.rand_like(p) * 1e-6} for p in model.parameters()}
    state = optimizer.state_dict()
    state["state"] = moments
    return model, {"model": model.state_dict(), "optimizer": state, "step": 1}


def timed(fn) -> tuple[float, float]:
    t0 = time.perf_counter()
    fn()
    written = time.perf_counter() - t0
    os.sync()
    return written, time.perf_counter() - t0


def save_sharded(state: dict, path: str, world_size: int) -> None:
    begin_checkpoint(path)
    threads = [threading.Thread(target=write_shard, args=(state, path, r, world_size)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    publish_checkpoint(path, os.path.dirname(path), 1, keep_last=1)


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
    p.add_argument("--world-sizes", default="1,2", help="shard writer counts to time")
    args = p.parse_args()
    torch.set_num_threads(1)

    t0 = time.perf_counter()
    model, state = training_state(args.config)
    gb = sum(v.nbytes for v in state["model"].values()) / 1e9
    gb += sum(t.nbytes for s in state["optimizer"]["state"].values() for t in s.values()) / 1e9
    n = sum(p.numel() for p in model.parameters())
    print(f"{args.config}: {n:,} parameters, {gb:.2f} GB with AdamW state (built in {time.perf_counter() - t0:.0f} s)")
    results = {"config": args.config, "parameters": n, "gb": round(gb, 2)}

    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    single = os.path.join(args.dir, "single.pt")
    written, synced = timed(lambda: torch.save(state, single))
    os.remove(single)
    print(f"single torch.save: written {written:.1f} s, on disk {synced:.1f} s ({gb / synced:.2f} GB/s)")
    results["single"] = {"written_s": round(written, 1), "on_disk_s": round(synced, 1)}

    for w in map(int, args.world_sizes.split(",")):
        path = os.path.join(args.dir, f"ckpt-{w:08d}")
        written, synced = timed(lambda: save_sharded(state, path, w))
        print(f"shards/{w}: written {written:.1f} s, on disk {synced:.1f} s ({gb / synced:.2f} GB/s)")
        results[f"shards/{w}"] = {"written_s": round(written, 1), "on_disk_s": round(synced, 1)}

    cold = drop_page_cache()
    t0 = time.perf_counter()
    ckpt = read_checkpoint(path, ("model", "optimizer"))
    mapped = time.perf_counter() - t0
    model.load_state_dict(ckpt["model"])
    loaded = time.perf_counter() - t0
    touched = sum(float(s["exp_avg"][0].sum()) for s in ckpt["optimizer"]["state"].values())  # one page each
    print(f"load ({'cold' if cold else 'warm'} page cache): shards mapped in {mapped:.1f} s, weights copied into "
          f"the model after {loaded:.1f} s; optimizer moments stay mapped until used ({touched:.1f})")
    results["load"] = {"mapped_s": round(mapped, 1), "weights_loaded_s": round(loaded, 1), "cold_cache": cold}
    with open("/proc/self/status") as f:
        peak = next(line.split()[1] for line in f if line.startswith("VmHWM"))
    results["peak_rss_gb"] = round(int(peak) / 1e6, 2)
    shutil.rmtree(args.dir)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
