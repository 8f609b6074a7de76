"""bench/train_speed_bench.py's model FLOPs, extended from batches of 1 and 2 rows to a whole
bucket, so that a checkpointed batch size, which a plain step would not fit, is counted too; and
its profile of one step."""

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from aed.train_config import load_train_config  # noqa: E402
from aed.train_progress import CountFlops  # noqa: E402
from train_speed_bench import Bench  # noqa: E402


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
