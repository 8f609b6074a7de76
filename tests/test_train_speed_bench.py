"""bench/train_speed_bench.py's model FLOPs, extended from batches of 1 and 2 rows to a whole
bucket, so that a checkpointed batch size, which a plain step would not fit, is counted too; and
its profile of one step and its traces (where the time goes); variants timed in turn; what a run saves
and prints; the GPU script's parts, limits and traces."""

import argparse
import gzip
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
from train_speed_bench import KERNEL_KINDS, Bench, kernel_summary, kind_of, timings  # noqa: E402


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
    averages = bench.profile(bench.batch(2, 161, 12))
    # What the step ran, from the profiler's events: which ops lead the printed table depends on what
    # a busy machine lets each take, their presence and counts do not.
    counts = {event.key: event.count for event in averages}
    assert counts.get("aten::mm", 0) + counts.get("aten::addmm", 0) >= 10, sorted(counts)  # every Linear, fwd and bwd
    assert counts.get("aten::convolution", 0) > 0  # the subsampling
    table = averages.table(sort_by=bench.profile_key, row_limit=5)
    ops = [line for line in table.splitlines()
           if line.strip() and not line.startswith("-") and "Name" not in line and "time total" not in line]
    assert "Self CPU" in table and len(ops) == 5, table  # the rows asked for, between rules, header and total


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


def test_a_trace_is_written_and_the_steps_time_is_accounted_for(tmp_path):
    cfg = load_train_config(["configs/tiny.yaml"], [])
    bench = Bench(cfg, torch.device("cpu"), "none", compiled=False)
    path = tmp_path / "trace.json.gz"
    kernels = bench.trace(bench.batch(2, 161, 12), 2, path)
    events = json.loads(gzip.open(path).read())["traceEvents"]
    assert any(e.get("name") in ("aten::mm", "aten::addmm") for e in events) and not (tmp_path / "trace.json").exists()
    shares = kernels["shares"]
    assert set(shares) == {kind for kind, _ in KERNEL_KINDS} | {"other", "host gaps", "data wait"}
    assert sum(shares.values()) == pytest.approx(1.0, abs=0.05)  # one thread's ops and the gaps between them
    assert shares["matmul"] > 0.05 and shares["convolution"] > 0 and shares["optimizer"] > 0
    assert kernels["steps"] == 2 and 0 < kernels["busy_ms_per_step"] <= kernels["wall_ms_per_step"] * 1.05
    assert [kind_of(name) for name, _, _ in kernels["top"]] == [kind for _, _, kind in kernels["top"]]


def test_a_gpu_s_kernels_are_summed_as_the_union_of_their_intervals():
    """GPU kernels overlap on streams: the device is busy for their union, and waited for the host
    the rest of the wall time."""
    from types import SimpleNamespace

    def kernel(name, start, end):
        return SimpleNamespace(name=name, device_type=torch.autograd.DeviceType.CUDA,
                               time_range=SimpleNamespace(start=start, end=end, elapsed_us=lambda: end - start))
    host = SimpleNamespace(name="aten::mm", device_type=torch.autograd.DeviceType.CPU, self_cpu_time_total=5.0)
    prof = SimpleNamespace(events=lambda: [kernel("sm90_xmma_gemm_bf16", 0, 400), kernel("flash_fwd_kernel", 300, 500),
                                           kernel("multi_tensor_apply_kernel", 700, 800), host])
    k = kernel_summary(prof, torch.device("cuda"), wall_s=1e-3, steps=1)
    assert k["busy_ms_per_step"] == pytest.approx(0.6)  # [0, 500) and [700, 800)
    assert k["shares"]["host gaps"] == pytest.approx(0.4)
    assert k["shares"]["matmul"] == pytest.approx(0.4) and k["shares"]["attention"] == pytest.approx(0.2)
    assert k["shares"]["optimizer"] == pytest.approx(0.1) and k["top"][0][0] == "sm90_xmma_gemm_bf16"


def test_the_gpu_script_gives_each_part_its_limit_and_traces_it(tmp_path):
    """bench/gpu_train_table.sh with a stand-in for Python that records what it is asked to run:
    every part gets its trace and results under OUT, and a budget under a minute skips them all."""
    tokenizer = tmp_path / "tok"
    tokenizer.mkdir()
    (tokenizer / "tokenizer.json").write_text("{}")
    calls = tmp_path / "calls"
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\n[ "$1" = "-c" ] && exit 0\necho "$@" >> {calls}\n')
    fake.chmod(0o755)
    script = str(ROOT / "bench" / "gpu_train_table.sh")
    env = {"PATH": "/usr/bin:/bin", "PYTHON": str(fake), "BUDGET": "540"}
    run = subprocess.run([script, str(tokenizer), str(tmp_path / "out"), "1b-flash", "180m-flash-ckpt"],
                         capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stderr
    lines = calls.read_text().splitlines()
    assert [line.split()[1] for line in lines] == ["configs/canary-1b-flash.yaml", "configs/canary-180m-flash.yaml"]
    for line, part in zip(lines, ["1b-flash", "180m-flash-ckpt"]):
        assert f"--trace {tmp_path}/out/trace-{part}" in line and f"--save {tmp_path}/out/{part}.json" in line
    assert "1b-flash: up to 170 s" in run.stdout and "180m-flash-ckpt: up to 180 s" in run.stdout
    run = subprocess.run([script, str(tokenizer), str(tmp_path / "out2"), "1b-flash", "cuda-tests"],
                         capture_output=True, text=True, env={**env, "BUDGET": "59"})
    assert run.stdout.count("skipped") == 2 and calls.read_text().splitlines() == lines
