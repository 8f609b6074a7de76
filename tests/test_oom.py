import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor
from torch.nn.parallel import DistributedDataParallel

from aed.cli_oom import main
from aed.data_audio import FeatureConfig, num_frames
from aed.train_data import bucket_shapes
from aed.memory_measure import (CUBLAS_WORKSPACE, CUDA_CONTEXT, LiveTensorMemory, OutOfMemory, SimulatedDevice,
                                allocated_limit, fake_world, is_out_of_memory, parse_bytes)
from aed.memory_oomptimizer import (MemoryBudgetError, MemoryModel, TrainingStep, make_monotone, optimize, preflight,
                                    search_batch_size, warn_ddp_rebuild)
from aed.model import AED, AEDConfig
from aed.model_transducer import TransducerASR
from bins import Bins, load_batch_sizes

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(n_mels=24, vocab_size=40, pad_id=1, enc_d_model=32, enc_layers=2, enc_heads=4, subsampling_channels=8,
            dec_d_model=48, dec_layers=2, dec_heads=4, dec_max_len=64)
SHAPES = [(1.0, 100, 8), (2.0, 200, 8), (2.0, 200, 16), (4.0, 400, 16)]  # (s, frames, tokens), 2D buckets
LIMIT = 16_000_000  # bytes: batch sizes of ~8-40 for the tiny model
THRESHOLD = 0.05



def tiny_setup(seed=0):
    torch.manual_seed(seed)
    model = AED(AEDConfig(**TINY))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


@pytest.fixture(scope="module")
def searched():
    model, optimizer = tiny_setup()
    step = TrainingStep(model, optimizer)
    return step, optimize(step, SHAPES, LIMIT, start=16, threshold=THRESHOLD)


# --- measurement -------------------------------------------------------------------------------


def test_tracker_counts_saved_activations_until_autograd_frees_them():
    x = torch.randn(1000, requires_grad=True)
    with LiveTensorMemory() as mem:
        y = x.exp()  # 4000 bytes; exp saves its output for backward
        z = y.sum()  # 4 bytes
        del y
        assert mem.current == 4004, "no Python name holds y, but the graph does: still live"
        z.backward()
        assert mem.current == 4004, "x.grad (4000) + z (4): y was freed with the graph"
        del z
        assert mem.current == 4000
    assert mem.peak >= 8004  # y, z and x.grad at once


def test_tracker_limit_raises_like_a_device_out_of_memory():
    with pytest.raises(OutOfMemory) as e, LiveTensorMemory(limit=10_000):
        a = torch.zeros(2000)  # 8000 bytes: fits
        torch.zeros(2000)  # 16000: over
    assert e.value.needed == 16000 and e.value.limit == 10_000
    del a


def test_tracker_counts_storages_resized_in_place():
    # FSDP2 frees a layer's gathered parameters with storage.resize_(0) and regathers into the same
    # storage with resize_(n): no aten op shows either.
    x = torch.zeros(1000)
    with LiveTensorMemory() as mem:
        mem.add([x])
        x.untyped_storage().resize_(0)
        assert mem.current == 0
        x.untyped_storage().resize_(4000)
        y = torch.empty(0)
        y.untyped_storage().resize_(800)  # a storage first seen when resized
        assert mem.current == 4800 and mem.peak == 4800
    assert torch.UntypedStorage.resize_ is torch._C.StorageBase.resize_, "resize_ is restored on exit"


@pytest.mark.slow(seconds=120)
def test_simulated_fsdp_step_matches_a_real_two_rank_step(tmp_path):
    # A real FSDP2 step at world size 2 (torchrun, gloo) measured on rank 0, against the same step on
    # fake tensors sharded over a fake world of 2. bf16: the parameters gathered in bf16 and autocast,
    # as train.py runs FSDP on CUDA. Both precisions in one world.
    sys.path.insert(0, str(ROOT / "bench"))
    from oom_bench import FSDP_SHAPES, TINY, build, fsdp_step

    # The simulation's own figures, exact: they are arithmetic on shapes, the same on every CPU. Rank 0
    # of 2 holds the first ceil(d0 / 2) rows of every parameter (FSDP2 shards dim 0), fp32 in both
    # precisions; after a step, a gradient shard of the same size; AdamW's two moments of it and a
    # 4-byte step count per parameter. Checked here because the peak's tolerance below cannot see
    # a missing gradient: at most ~1% of a row's peak is gradients (most are reduced after it).
    params = list(build(TINY, "aed").parameters())
    shard = sum(4 * -(-p.shape[0] // 2) * (p.numel() // p.shape[0]) for p in params)
    simulated = {}
    for precision in ("fp32", "bf16"):
        with fake_world(2), SimulatedDevice():
            step = fsdp_step(2, precision)
            simulated[precision] = step.peak(*FSDP_SHAPES[0])  # leaves this step's gradients in place
            held = {}
            for name, tensors in [("params", step.model.parameters()),
                                  ("grads", (p.grad for p in step.model.parameters())),
                                  ("adamw", (v for s in step.optimizer.state.values() for v in s.values()))]:
                mem = LiveTensorMemory()  # counts a DTensor by its local shard, each storage once
                mem.add(tensors)
                held[name] = mem.current
        assert held == {"params": shard, "grads": shard, "adamw": 2 * shard + 4 * len(params)}, (precision, held)

    out = tmp_path / "fsdp.json"
    subprocess.run([sys.executable, str(ROOT / "bench" / "oom_bench.py"), "validate-fsdp", "--out", str(out),
                    "--precision", "fp32", "bf16"], cwd=ROOT, check=True, capture_output=True, text=True)
    r = json.loads(out.read_text())
    assert r["world_size"] == 2 and sorted(r["precisions"]) == ["bf16", "fp32"]
    for precision, v in r["precisions"].items():
        rows = v["rows"]
        assert len(rows) == 3
        # No CPU kernel runs on fake tensors: the simulated peak is the same to the byte in any process.
        assert rows[0]["simulated"] == simulated[precision], (precision, rows[0], simulated[precision])
        # The real peak also counts the outputs of the kernels this CPU picks, which differ between CPUs
        # (AVX-512 ones add ~0.25% to a row). 1% covers them; a simulation that left out AdamW's state
        # (1.6-11% of every row's peak) or counted it twice still fails.
        assert all(abs(row["simulated"] - row["measured"]) <= 0.01 * row["measured"] for row in rows), (precision, rows)
        # rank 0's RSS growth over a larger step: the tensors the tracker counts, plus buffers kernels
        # allocate outside PyTorch's allocator (oneDNN's; with bf16 kernels on AVX-512 CPUs about a
        # fifth of the count), minus heap that glibc kept from earlier steps and reuses for allocations
        # below the mmap threshold (growth below the count). A tracker that lost the tensors autograd
        # saves for backward (~3/4 of this step) fails either way. FSDP's state (~1% of the step) is
        # below what RSS resolves: it is checked exactly above.
        assert 0.8 < v["rss"]["rss_growth"] / v["rss"]["tracked"] < 1.4, (precision, v["rss"])


@pytest.mark.slow
def test_tracker_matches_process_rss_growth():
    # glibc keeps freed heap memory, which RSS would count; a fixed mmap threshold makes it
    # return every large buffer, so RSS growth is the memory tensors really held at the peak.
    script = f"""
import json, torch
torch.set_num_threads(1)
from aed.memory_measure import LiveTensorMemory
from aed.model import AED, AEDConfig
from aed.memory_oomptimizer import TrainingStep
def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))
model = AED(AEDConfig(**{TINY!r}))
step = TrainingStep(model, torch.optim.AdamW(model.parameters()))
step.warm_up(50, 5)
rss_before = status("VmRSS:")
with LiveTensorMemory() as mem:  # counts what the step allocates, as RSS growth does
    step.run(8, 1000, 20)
print(json.dumps({{"tracked": mem.peak, "rss_growth": status("VmHWM:") - rss_before}}))
"""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["tracked"] > 30e6, r
    assert 0.9 < r["rss_growth"] / r["tracked"] < 1.2, r


def test_peak_grows_with_batch_size_and_sequence_lengths():
    model, optimizer = tiny_setup()
    step = TrainingStep(model, optimizer)
    step.warm_up(50, 5)
    base = step.peak(4, 200, 10)
    assert step.peak(8, 200, 10) > base
    assert step.peak(4, 400, 10) > base
    assert step.peak(4, 200, 30) > base
    assert step.peak(4, 200, 10) == base, "the CPU measurement is deterministic"


def test_ddp_adds_one_copy_of_the_gradients():
    model, optimizer = tiny_setup()
    plain, ddp = TrainingStep(model, optimizer), TrainingStep(model, optimizer, ddp=True)
    plain.warm_up(50, 5)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert ddp.peak(4, 200, 10) - plain.peak(4, 200, 10) == grad_bytes


def test_a_real_ddp_step_holds_what_the_ddp_constant_adds(tmp_path):
    """TrainingStep(ddp=True)'s constant against a real DistributedDataParallel step (gloo, world size
    1: the buckets do not depend on it). The tracker counts DDP's buckets from the first op that writes
    into them, which every DDP backward has; on a GPU the allocator does (tests/test_cuda_oom.py)."""
    model, optimizer = tiny_setup()
    plain, simulated = TrainingStep(model, optimizer), TrainingStep(model, optimizer, ddp=True)
    plain.warm_up(50, 5)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        real = TrainingStep(DistributedDataParallel(model), optimizer)
        peaks = [real.peak(4, 200, 10) for _ in range(3)]  # the second step rebuilds the buckets
    finally:
        dist.destroy_process_group()
    assert peaks == [simulated.peak(4, 200, 10)] * 3 and peaks[0] > plain.peak(4, 200, 10)


def test_bf16_step_is_measured():
    model, optimizer = tiny_setup()
    step = TrainingStep(model, optimizer, precision="bf16")
    step.warm_up(50, 5)
    assert step.peak(4, 200, 10) > sum(p.numel() * 4 for p in model.parameters())


# --- search ------------------------------------------------------------------------------------


@pytest.mark.parametrize("threshold", [0.05, 0.2])
@pytest.mark.parametrize("start", [1, 16, 100])
def test_search_finds_the_largest_fit_within_threshold_in_bounded_trials(start, threshold):
    for answer in [0, 1, 2, 3, 7, 15, 16, 17, 50, 99, 100, 101, 1000, 4097]:
        calls = []

        def peak_at(n):
            calls.append(n)
            return 1000 * n if n <= answer else None

        n, peak, trials = search_batch_size(peak_at, start, threshold)
        assert trials == len(calls)
        if answer == 0:
            assert n == 0 and peak is None
            continue
        assert 1 <= n <= answer and peak == 1000 * n
        assert max(n + 1, math.floor(n * (1 + threshold))) > answer, (answer, n)
        bound = abs(math.log2(answer / start)) + math.log2(1 / threshold) + 3
        assert trials <= bound, (answer, start, trials, calls)


def test_every_reported_size_fits_and_threshold_more_does_not(searched):
    step, rows = searched
    for r, (d, frames, tokens) in zip(rows, SHAPES):
        assert (r["duration"], r["frames"], r["tokens"]) == (d, frames, tokens)
        assert r["batch_size"] >= 2, r
        assert r["peak"] == step.peak(r["batch_size"], frames, tokens) <= LIMIT
        over = max(r["batch_size"] + 1, math.floor(r["batch_size"] * (1 + THRESHOLD)))
        with pytest.raises(OutOfMemory):
            step.peak(over, frames, tokens, LIMIT)


def test_real_search_converges_in_bounded_trials(searched):
    _, rows = searched
    start = 16
    for r in reversed(rows):  # searched largest first, each from 2x the previous answer
        assert r["trials"] <= abs(math.log2(r["batch_size"] / start)) + math.log2(1 / THRESHOLD) + 3, r
        start = 2 * r["batch_size"]
    assert rows[0]["batch_size"] > rows[-1]["batch_size"], "short buckets must get larger batches"


def test_make_monotone_lowers_the_larger_bucket():
    shapes = [(1.0, 100, 10), (1.0, 100, 20), (2.0, 200, 10), (2.0, 200, 20), (2.0, 200, 5)]
    sizes, changes = make_monotone(shapes, [50, 40, 45, 42, 60])
    # (2 s, 20 tok) covers both 1 s buckets and (2 s, 10 tok): min(50, 40, 45, 42) = 40.
    # (2 s, 5 tok) covers nothing else, so it keeps 60 even though it is larger than its neighbours.
    assert sizes == [50, 40, 45, 40, 60]
    assert changes == [(3, 42, 40)]


def test_bucket_shapes_1d_use_max_tps_and_cap_at_dec_max_len():
    feats = FeatureConfig()
    bins_1d = Bins([2.0, 10.0, 40.0], max_tps=[8.0, 5.0, 4.0])
    assert bucket_shapes(bins_1d, feats, dec_max_len=100) == [
        (2.0, num_frames(32000), 16), (10.0, num_frames(160000), 50), (40.0, num_frames(640000), 100)]
    assert [t for _, _, t in bucket_shapes(bins_1d, feats, 1000, max_tps=10)] == [20, 100, 400]
    bins_2d = Bins([2.0, 10.0], tokens=[[6, 12], [30]])
    assert bucket_shapes(bins_2d, feats, 512) == [(2.0, 200, 6), (2.0, 200, 12), (10.0, 1000, 30)]
    # the edges' added silence: frames of the bound + what they may add, the bound itself as it is
    assert bucket_shapes(bins_2d, feats, 512, added=0.6) == [(2.0, 260, 6), (2.0, 260, 12), (10.0, 1060, 30)]
    with pytest.raises(ValueError, match="max-tps"):
        bucket_shapes(Bins([2.0]), feats, 512)


def test_parse_bytes():
    assert parse_bytes("20GB") == 20 * 10**9
    assert parse_bytes("512 MiB") == 512 * 2**20
    assert parse_bytes("1.5g") == 1_500_000_000
    assert parse_bytes("4e9") == 4 * 10**9
    with pytest.raises(ValueError, match="20GB"):
        parse_bytes("twenty gigs")


# --- pre-flight check and command line -----------------------------------------------------------


def test_preflight_passes_the_searched_table_and_restores_the_training_state(searched):
    _, rows = searched
    model, optimizer = tiny_setup(seed=1)
    model.encoder.eval()  # as train_mode leaves a frozen encoder: the check must not switch it to training
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    peaks = preflight(TrainingStep(model, optimizer), SHAPES, [r["batch_size"] for r in rows], LIMIT)
    assert all(p <= LIMIT for p in peaks) and len(peaks) == len(SHAPES)
    assert not model.encoder.training and model.decoder.training
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in weights.items()), "weights changed"
    assert not optimizer.state and all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)


def test_preflight_fails_on_an_oversized_table_with_an_actionable_message(searched):
    _, rows = searched
    sizes = [r["batch_size"] for r in rows]
    sizes[2] = int(sizes[2] * 1.5)
    model, optimizer = tiny_setup()
    with pytest.raises(MemoryBudgetError) as e:
        preflight(TrainingStep(model, optimizer), SHAPES, sizes, LIMIT)
    msg = str(e.value)
    expected = rf"bucket 2 \(2\.00 s, 16 tokens\) at batch {sizes[2]} needs [0-9.]+ MB > 16\.0 MB budget"
    assert re.search(expected, msg), msg
    assert "1 of 4 buckets" in msg and "rerun oom.py" in msg


def test_cli_writes_monotone_batch_sizes_that_train_py_reads(tmp_path, capsys):
    config = tmp_path / "tiny.yaml"
    config.write_text(json.dumps({  # JSON is YAML; run_dir and train are train.py's, ignored here
        "model": {k: v for k, v in TINY.items() if k not in ("n_mels", "vocab_size", "pad_id")},  # from features, tokenizer
        "features": {"n_mels": 24}, "optim": {"lr": "1e-3", "betas": [0.9, 0.98]},
        "run_dir": "ignored", "train": {"num_buckets": 6}}))
    Bins([1.0, 3.0], tokens=[[8, 14], [20, 30]]).save(tmp_path / "bins.json")
    out = tmp_path / "batch_sizes.json"
    main(["--config", str(config), "--bins", str(tmp_path / "bins.json"), "--memory-budget", "20MB", "--device", "cpu",
          "-o", str(out)])
    bins, sizes = load_batch_sizes(out)
    assert bins.tokens == [[8, 14], [20, 30]]
    (a, b), (c, d) = sizes
    assert a >= b >= d and a >= c >= d and min(a, b, c, d) >= 1
    table = capsys.readouterr().out
    assert re.search(r"^\s+3\s+3\.00\s+30\s+300\s+\d+\s+[0-9.]+ MB\s+\d+", table, re.M), table
    assert "limit 18.0 MB" in table  # 20 MB budget - 10% margin


def test_ddp_warns_when_the_margin_cannot_hold_the_bucket_rebuild(caplog):
    layer = torch.nn.Linear(1000, 1000)  # 4.004 MB of fp32 gradients
    warn_ddp_rebuild(layer, 80_000_000, 0.1)  # 8 MB margin
    assert not caplog.records
    warn_ddp_rebuild(layer, 40_000_000, 0.1)  # 4 MB margin
    assert "may hold one more copy of the gradients (4.0 MB)" in caplog.text and "--margin 0.11" in caplog.text


def test_one_command_from_manifests_to_a_config_train_py_reads(tmp_path, capsys):
    # oom.py --out: bins from the config's manifests with its tokenizer and prompt, the TPS filter,
    # the search, and a YAML fragment that train.py merges over the config.
    import yaml

    from aed.train_config import load_train_config
    from aed.data_manifest import read_manifest
    from aed.data_batch import encode_utterance
    from aed.data_tokenizer import Tokenizer
    from bins import estimate_bins
    from aed.train_data import build_training_data

    manifest, tok_dir = str(ROOT / "data/mini/train.jsonl"), str(ROOT / "data/mini/tokenizer")
    config = tmp_path / "run.yaml"
    config.write_text(json.dumps({
        "model": {k: v for k, v in TINY.items() if k not in ("n_mels", "vocab_size", "pad_id")},
        "features": {"n_mels": 24}, "run_dir": str(tmp_path / "run"),
        "train": {"manifests": [manifest], "tokenizer": tok_dir, "num_buckets": 1, "sub_buckets": 2,
                  "bin_method": "equal", "num_workers": 0}}))
    out = tmp_path / "buckets.yaml"
    main(["--config", str(config), "--memory-budget", "30MB", "--device", "cpu", "--threshold", "0.5",
          "--start-batch-size", "8", "--out", str(out)])
    assert str(out) in capsys.readouterr().out

    fragment = yaml.safe_load(out.read_text())["train"]
    bins, sizes = load_batch_sizes(fragment["batch_sizes"])
    tok = Tokenizer.load(tok_dir)
    utts = read_manifest(manifest)
    n = [len(encode_utterance(tok, u)[0]) for u in utts]  # prompt + text + EOS, as training counts
    kept = [(u.duration, k) for u, k in zip(utts, n) if k <= TINY["dec_max_len"]]
    expected = estimate_bins([d for d, _ in kept], [k for _, k in kept], 1, 2, method="equal")
    assert bins == expected and fragment["max_tps"] == expected.max_tps  # the TPS filter, one per bin
    assert min(s for row in sizes for s in row) >= 1 and "manifests" not in fragment

    cfg = load_train_config([str(config), str(out)])
    assert cfg.train.batch_sizes == fragment["batch_sizes"] and cfg.train.max_tps == expected.max_tps
    data = build_training_data(cfg, tok, 0, 1)
    sampler, train_bins = data.sampler, data.bins
    assert train_bins == bins and sampler.sizes == [s for row in sizes for s in row]
    assert sampler.allocate.max_tps == expected.max_tps


# --- simulated device memory ---------------------------------------------------------------------


@pytest.mark.slow
def test_simulated_step_on_fake_tensors_matches_the_real_step():
    # Same step, same tracker: fake tensors must reproduce the real CPU peak (every op's output has
    # the same size; a boolean-mask index and host reads of lengths go through HostValues).
    shapes = [(4, 200, 10), (3, 400, 60)]
    for precision in ("fp32", "bf16"):
        model, optimizer = tiny_setup()
        real = TrainingStep(model, optimizer, precision)
        real.warm_up(50, 5)
        measured = [real.peak(*s) for s in shapes]
        with SimulatedDevice():
            model, optimizer = tiny_setup()
            fake = TrainingStep(model, optimizer, precision)
            fake.warm_up(50, 5)
            assert isinstance(next(model.parameters()), FakeTensor)
            simulated = [fake.peak(*s) for s in shapes]
        if precision == "fp32":
            assert simulated == measured
        else:  # a few kB of the CPU's bf16 kernels differ (0.1%)
            assert all(0.99 < s / m <= 1.0 for s, m in zip(simulated, measured)), (simulated, measured)


@pytest.mark.parametrize("where", ["encoder", "both"])
def test_simulated_checkpointed_step_matches_the_real_step_and_needs_less(where):
    """Activation checkpointing on fake tensors: the recomputation in backward is counted as the real
    step's is (to the byte, fp32), and the peak is lower than the plain step's."""
    shape = (3, 400, 60)

    def checkpointed(step):
        step.module.encoder.checkpoint_activations = True
        step.module.decoder.checkpoint_activations = where == "both"
        return step

    model, optimizer = tiny_setup()
    real = TrainingStep(model, optimizer)
    real.warm_up(50, 5)
    plain = real.peak(*shape)
    measured = checkpointed(real).peak(*shape)
    with SimulatedDevice():
        fake = checkpointed(TrainingStep(*tiny_setup()))
        fake.warm_up(50, 5)
        simulated = fake.peak(*shape)
    assert simulated == measured
    assert measured < 0.8 * plain, (measured, plain)


@pytest.mark.slow
def test_simulated_rnnt_step_is_close_to_the_real_one():
    def setup():
        torch.manual_seed(0)
        model = TransducerASR(AEDConfig(**TINY), 38, 4, pred_dim=32, joint_dim=32)
        return TrainingStep(model, torch.optim.AdamW(model.parameters()), text_vocab_size=38)

    shapes = [(4, 200, 10), (3, 400, 30)]
    real = setup()
    real.warm_up(50, 5)
    real_peaks = [real.peak(*shape) for shape in shapes]
    with SimulatedDevice():
        fake = setup()
        fake.warm_up(50, 5)
        fake_peaks = [fake.peak(*shape) for shape in shapes]
    for shape, f, r in zip(shapes, fake_peaks, real_peaks):
        # The LSTM predictor's CPU kernel keeps buffers the fake kernel does not (2-6% of a tiny step).
        assert 0.9 < f / r <= 1.0, (shape, f, r)


def test_host_values_answer_host_reads_and_masks_of_a_fake_computation():
    with SimulatedDevice():
        lens = torch.tensor([3, 1, 2])
        mask = torch.arange(4)[None, :] < lens[:, None]  # (3, 4), 6 True
        x = torch.randn(3, 4, 5, requires_grad=True)
        picked = x[mask]
        assert isinstance(picked, FakeTensor) and picked.shape == (6, 5)
        picked.sum().backward()  # index's backward puts through the same mask
        assert x.grad.shape == (3, 4, 5)
        assert lens.tolist() == [3, 1, 2] and int(lens.max()) == 3
        assert mask.nonzero().shape == (6, 2)
        with pytest.raises(RuntimeError, match="depends on the model's numbers"):
            float(x.sum())


def test_cuda_allocator_rounding_is_counted_per_storage():
    with LiveTensorMemory(granularity=512) as mem:
        a = torch.zeros(1, dtype=torch.uint8)  # 1 byte -> one 512-byte block
        b = torch.zeros(513, dtype=torch.uint8)  # -> 1024
        c = torch.zeros(0)  # no block
        assert mem.current == 512 + 1024
    del a, b, c
    assert allocated_limit(80 * 2**30, 0.1) == int(0.9 * 80 * 2**30) - CUBLAS_WORKSPACE - CUDA_CONTEXT


def test_memory_model_recovers_a_known_memory_function_and_its_batch_size():
    def true_peak(B, T, U):
        return 1e9 + B * (3e5 * T + 20 * T * T + 2e6 * U + 50 * U * U)

    grid = [(B, T, U) for B in (2, 8, 32) for T in (100, 800, 3000) for U in (10, 120, 400)]
    fitted = MemoryModel.fit([(B, T, U, true_peak(B, T, U)) for B, T, U in grid[::2]])
    held_out = [(B, T, U, true_peak(B, T, U)) for B, T, U in grid[1::2]]
    assert max(map(abs, fitted.relative_errors(held_out))) < 1e-6
    n = fitted.max_batch_size(800, 120, 40e9)
    assert true_peak(n, 800, 120) <= 40e9 < true_peak(n + 1, 800, 120)
    assert fitted.max_batch_size(800, 120, 0.5e9) == 0


def test_memory_model_keeps_coefficients_non_negative():
    # Pure per-frame memory plus noise: the other terms must not come out negative to compensate.
    samples = [(B, T, U, 1e8 + B * T * 1e4 * (1 + 0.01 * ((B + T + U) % 3 - 1)))
               for B in (1, 4, 16) for T in (100, 400, 1600) for U in (5, 50, 300)]
    assert all(c >= 0 for c in MemoryModel.fit(samples).coef[1:])


@pytest.mark.slow
def test_cli_simulates_a_cuda_device_and_sizes_from_a_fitted_memory_model(tmp_path, capsys):
    config = tmp_path / "tiny.yaml"
    config.write_text(json.dumps({"model": {k: v for k, v in TINY.items() if k not in ("n_mels", "vocab_size", "pad_id")},
                                  "features": {"n_mels": 24}, "precision": "auto"}))
    Bins([1.0, 3.0], tokens=[[8, 14], [20, 30]]).save(tmp_path / "bins.json")
    out = tmp_path / "batch_sizes.json"
    main(["--config", str(config), "--bins", str(tmp_path / "bins.json"), "--simulate-memory", "1GB", "--margin", "0.1",
          "--memory-model", "--fit-steps", "3", "--verify", "2", "-o", str(out)])
    _, sizes = load_batch_sizes(out)
    table = capsys.readouterr().out
    assert "(bf16, simulated CUDA)" in table, "auto precision resolves as on CUDA"
    limit = allocated_limit(10**9, 0.1)
    peaks = re.findall(r"^\s+\d+\s+\S+\s+\d+\s+\d+\s+\d+\s+([0-9.]+) (MB|GB)", table, re.M)
    # The table rounds to 0.01 GB / 0.1 MB: a printed peak may exceed the limit by half of that.
    half_digit = {"MB": 0.05e6, "GB": 0.005e9}
    assert len(peaks) == 2 and all(float(p) * {"MB": 1e6, "GB": 1e9}[u] - half_digit[u] <= limit for p, u in peaks), table
    assert min(s for row in sizes for s in row) > 100


@pytest.mark.slow
def test_cli_sizes_one_rank_of_fsdp_over_a_fake_world(tmp_path, capsys):
    config = tmp_path / "tiny.yaml"
    config.write_text(json.dumps({"model": {k: v for k, v in TINY.items() if k not in ("n_mels", "vocab_size", "pad_id")},
                                  "features": {"n_mels": 24}, "precision": "auto"}))
    Bins([1.0, 3.0], tokens=[[8, 14], [20, 30]]).save(tmp_path / "bins.json")
    out = tmp_path / "batch_sizes.json"
    main(["--config", str(config), "--bins", str(tmp_path / "bins.json"), "--simulate-memory", "1GB",
          "--strategy", "fsdp", "--world-size", "8", "--memory-model", "--fit-steps", "3", "--verify", "2", "-o", str(out)])
    assert "(bf16, FSDP over 8, simulated CUDA)" in capsys.readouterr().out
    assert min(s for row in load_batch_sizes(out)[1] for s in row) > 100
    assert not torch.distributed.is_initialized(), "the fake world is gone"


@pytest.mark.slow
def test_cli_sizes_a_transducer_objective(tmp_path, capsys):
    # train.py's objective=rnnt: the random targets stay below the tokenizer's ids (blank comes after).
    config = tmp_path / "rnnt.yaml"
    config.write_text(json.dumps({"model": {k: v for k, v in TINY.items() if k not in ("n_mels", "vocab_size", "pad_id")},
                                  "features": {"n_mels": 24}, "objective": "rnnt", "rnnt_pred_dim": 32,
                                  "rnnt_joint_dim": 32}))
    Bins([1.0, 2.0], tokens=[[8], [16]]).save(tmp_path / "bins.json")
    out = tmp_path / "batch_sizes.json"
    main(["--config", str(config), "--bins", str(tmp_path / "bins.json"), "--memory-budget", "30MB", "--device", "cpu",
          "-o", str(out)])
    _, sizes = load_batch_sizes(out)
    assert sizes[0][0] >= sizes[1][0] >= 1


# --- CUDA out-of-memory classification -------------------------------------------------------------


@pytest.mark.parametrize("message", [
    "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
    "cuDNN error: CUDNN_STATUS_ALLOC_FAILED",
    "cuFFT error: CUFFT_ALLOC_FAILED",
    "CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported at some other API call",
])
def test_library_allocation_failures_count_as_out_of_memory(message):
    assert is_out_of_memory(RuntimeError(message))


@pytest.mark.parametrize("error", [
    RuntimeError("CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasGemmEx(...)`"),
    RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED"),
    RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 4x3)"),
    RuntimeError("CUDA error: an illegal memory access was encountered"),
    ValueError("CUBLAS_STATUS_ALLOC_FAILED"),  # not a device error at all
])
def test_other_errors_are_not_out_of_memory(error):
    assert not is_out_of_memory(error)
