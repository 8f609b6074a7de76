"""bench/train_speed_bench.py's model FLOPs, extended from batches of 1 and 2 rows to a whole
bucket, so that a checkpointed batch size, which a plain step would not fit, is counted too; and
its profile of one step; variants timed in turn; what a run saves and prints."""

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from aed.train_config import load_train_config  # noqa: E402
from aed.train_progress import CountFlops  # noqa: E402
from common import last_json  # noqa: E402
from train_speed_bench import Bench, timings  # noqa: E402


def test_model_flops_of_a_bucket_equal_a_direct_count_and_ignore_checkpointing():
    torch.manual_seed(0)
    cfg = load_train_config(["configs/tiny.yaml"], ["activation_checkpointing=both"])
    bench = Bench(cfg, torch.device("cpu"), "none", compiled=False)  # no DDP wrapper: no process group here
    batch_size, frames, tokens = 5, 161, 12
    with CountFlops() as direct:
        bench.module.encoder.checkpoint_activations = bench.module.decoder.checkpoint_activations = False
        bench.step(bench.batch(batch_size, frames, tokens))
    bench.module.encoder.checkpoint_activations = bench.module.decoder.checkpoint_activations = True
    counted = bench.model_flops(batch_size, frames, tokens)
    assert counted == direct.flops > 0
    # A checkpointed step recomputes each layer's forward: the model FLOPs leave that out.
    with CountFlops() as recomputing:
        bench.step(bench.batch(batch_size, frames, tokens))
    assert recomputing.flops > counted
    assert bench.module.encoder.checkpoint_activations and bench.module.decoder.checkpoint_activations


def test_the_profile_lists_the_step_s_matrix_products():
    cfg = load_train_config(["configs/tiny.yaml"], [])
    bench = Bench(cfg, torch.device("cpu"), "none", compiled=False)
    table = bench.profile(bench.batch(2, 161, 12), rows=5)
    ops = [line for line in table.splitlines()
           if line.strip() and not line.startswith("-") and "Name" not in line and "time total" not in line]
    assert "Self CPU" in table and len(ops) == 5, table  # the rows asked for, between rules, header and total
    assert "aten::mm" in table or "aten::addmm" in table  # a transformer's step spends most in its products


def test_interleaved_variants_take_their_steps_in_turn():
    cfg = load_train_config(["configs/tiny.yaml"], [])
    benches = [Bench(cfg, torch.device("cpu"), "none", compiled=False, name=name) for name in ("a", "b")]
    order = []
    for bench in benches:
        step = bench.timed_step
        bench.timed_step = lambda batch, bench=bench, step=step: order.append(bench.name) or step(batch)
    timing = timings(benches, benches[0].batch(2, 161, 12), argparse.Namespace(warmup=1, steps=3))
    assert order == ["a", "b"] * 3  # one step of each variant, then the next round
    for t in timing:
        assert len(t["steps"]) == 3 and all(s > 0 for s in t["steps"]) and t["warmup_s"] > 0
        assert len(t["phases"]) == 3 and all(len(p) == 3 and min(p) > 0 for p in t["phases"])


@pytest.mark.slow(seconds=40)
def test_a_run_saves_what_it_measured_and_prints_it_last(tmp_path):
    saved = tmp_path / "speed.json"
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "train_speed_bench.py"), "configs/tiny.yaml",
                          "--buckets", "1", "--steps", "1", "--warmup", "0", "--fused", "both", "--interleave",
                          "--threads", "1", "--save", str(saved)], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    printed, kept = last_json(run.stdout), json.loads(saved.read_text())
    assert printed.pop("load_avg") and kept.pop("load_avg")
    assert kept == printed and printed["interleaved"]
    assert [v["fused"] for v in printed["variants"]] == [False, True]
    for v in printed["variants"]:
        (row,) = v["buckets"]
        assert row["step_ms"] > 0 and row["flops"] > 0 and v["all"]["audio_s_per_s"] > 0
    assert list(printed["ratios"]) == ["AdamW fused/default, eager, checkpointing none"]
