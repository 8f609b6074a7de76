"""The EMA of the weights (aed/train_setup.py: ExponentialMovingAverage): its update and warm-up, the swap validation runs
inside, the memory it adds to the OOMptimizer's fixed state, exact resume, FSDP against DDP, and
infer.py --ema. One single-process train.py run serves most checks; the two-rank comparison runs
this file under torchrun on a toy model (its `__main__` below)."""

import os
import subprocess
import sys
from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
from test_train import MINI, ROOT, losses, run_in_process, run_train
from test_train_distributed import copy_until, metric
from torch import nn
from torch.distributed.tensor import DTensor

from aed import cli_infer
from aed.memory_measure import fake_world
from aed.memory_oomptimizer import TrainingStep
from aed.model import AED, AEDConfig
from aed.model_checkpoint import CheckpointError, load_model, read_checkpoint, read_ema
from aed.train_checkpoint import has_ema
from aed.train_distributed import exit_worker, shard
from aed.train_setup import ExponentialMovingAverage, local

DECAY = 0.9  # low enough that a few steps move the EMA measurably away from the weights
# FSDP reduce-scatters where DDP all-reduces: nothing promises the same order of summation, so the
# weights, and so their EMA, are compared to float32 rounding carried through a few AdamW steps.
RTOL, ATOL = 1e-5, 1e-6
TOY_STEPS = 5


def toy() -> nn.Module:
    """The same small model on every call (and every rank)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 5))


def perturb(model: nn.Module) -> None:
    """A stand-in for an optimizer step: every trainable weight moves."""
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p))


# --- the average itself --------------------------------------------------------------------------


def test_update_follows_the_formula_with_its_warm_up():
    model = toy()
    model[1].requires_grad_(False)  # frozen: its average is itself, so none is kept
    ema = ExponentialMovingAverage(model, DECAY)
    assert ema.weights.keys() == {"0.weight", "0.bias", "3.weight", "3.bias"}
    assert ema.nbytes == 4 * sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert ema.decay_at(0) == pytest.approx(0.1) and ema.decay_at(2) == pytest.approx(0.25)
    assert ema.decay_at(1000) == DECAY  # the warm-up is over once (1 + n) / (10 + n) reaches the decay
    expected = {k: v.clone() for k, v in ema.weights.items()}
    for step in range(4):
        perturb(model)
        d = min(DECAY, (1 + step) / (10 + step))
        params = dict(model.named_parameters())
        expected = {k: d * v + (1 - d) * params[k].detach() for k, v in expected.items()}
        ema.update(model, step)
        for k, v in expected.items():
            torch.testing.assert_close(ema.weights[k], v, rtol=1e-6, atol=1e-6)  # lerp rounds otherwise
    with pytest.raises(ValueError, match="0 < decay < 1"):
        ExponentialMovingAverage(model, 1.0)


def test_swapped_puts_the_ema_in_and_the_raw_weights_back_bit_exactly():
    model = toy()
    ema = ExponentialMovingAverage(model, DECAY)
    perturb(model)
    ema.update(model, 0)
    raw = {k: v.clone() for k, v in model.state_dict().items()}
    average = {k: v.clone() for k, v in ema.weights.items()}
    params = list(model.parameters())
    with ema.swapped(model):
        assert all(torch.equal(model.get_parameter(k), v) for k, v in average.items())
    assert all(torch.equal(v, raw[k]) for k, v in model.state_dict().items())
    assert all(torch.equal(v, average[k]) for k, v in ema.weights.items())
    assert all(p is q for p, q in zip(params, model.parameters()))  # the optimizer's references still hold
    with pytest.raises(RuntimeError, match="validation failed"), ema.swapped(model):
        raise RuntimeError("validation failed")
    assert all(torch.equal(v, raw[k]) for k, v in model.state_dict().items())


TINY = dict(n_mels=24, vocab_size=40, pad_id=1, enc_d_model=32, enc_layers=2, enc_heads=4, subsampling_channels=8,
            dec_d_model=48, dec_layers=2, dec_heads=4, dec_max_len=64)


@pytest.mark.parametrize("world_size", [1, 2])
def test_the_memory_model_counts_the_ema_as_fixed_state(world_size):
    """One fp32 copy of the parameters more at every batch shape; over FSDP's two (fake) ranks, of
    rank 0's shards: the first ceil(d0 / 2) rows of every parameter, about half the bytes. (Real
    tensors: the fake collectives leave the gathered weights garbage, which the bytes do not see.)"""
    with fake_world(2) if world_size == 2 else nullcontext():
        torch.manual_seed(0)
        model = AED(AEDConfig(**TINY)).train()
        if world_size == 2:
            shard(model, torch.device("cpu"), 2, "fp32")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ema = ExponentialMovingAverage(model, DECAY)
        plain, with_ema = TrainingStep(model, optimizer), TrainingStep(model, optimizer, ema=ema)
        plain.warm_up(50, 5)  # AdamW's state first: the steps compared then hold the same state
        grown = [with_ema.peak(*shape) - plain.peak(*shape) for shape in ((2, 100, 8), (6, 200, 16))]
        params = dict(model.named_parameters())
        if world_size == 2:  # each rank its own shard, placed as the parameter: nothing gathered
            assert all(isinstance(e, DTensor) and e.placements == params[k].placements
                       and local(e).shape == local(params[k]).shape for k, e in ema.weights.items())
    full = sum(4 * p.numel() for p in params.values())
    expected = sum(4 * -(-p.shape[0] // world_size) * (p.numel() // p.shape[0]) for p in params.values())
    assert grown == [expected, expected] == [ema.nbytes] * 2
    assert expected == pytest.approx(full / world_size, rel=0.02)


# --- train.py -------------------------------------------------------------------------------------

RUN = ("ema_decay=0.9", "max_steps=4", "ckpt_every=2", "keep_last=3")


@pytest.fixture(scope="module")
def ema_run(made_once):
    """4 steps with an EMA, checkpoints at 2 and 4, validation at 0, 2 and 4: (run dir, stderr)."""
    def make(folder):
        p = run_train(folder / "run", *RUN, "val.every=2", "val.max_utterances=4")
        (folder / "stderr.txt").write_text(p.stderr)

    folder = made_once("ema-run", make)
    return folder / "run", (folder / "stderr.txt").read_text()


@pytest.mark.slow(seconds=12)
def test_the_run_keeps_saves_and_validates_the_ema(ema_run):
    run, stderr = ema_run
    assert "EMA of the weights, decay 0.9" in stderr
    assert stderr.count("(EMA weights)") == 3  # steps 0, 2 and 4
    ckpt = read_checkpoint(str(run / "ckpt-00000004"))
    ema = read_ema(str(run / "ckpt-00000004"))
    assert ema.keys() <= ckpt["model"].keys() and all(v.dtype == torch.float32 for v in ema.values())
    assert any(not torch.equal(v, ckpt["model"][k]) for k, v in ema.items())


@pytest.mark.slow(seconds=8)
def test_resume_continues_the_ema_exactly(ema_run, tmp_path):
    run = tmp_path / "run"
    copy_until(ema_run[0], run, 2)
    p = run_train(run, *RUN)
    assert "at step 2" in p.stderr
    whole, resumed = read_ema(str(ema_run[0] / "ckpt-00000004")), read_ema(str(run / "ckpt-00000004"))
    assert whole.keys() == resumed.keys() and all(torch.equal(whole[k], resumed[k]) for k in whole)


@pytest.mark.slow(seconds=12)
def test_a_checkpoint_without_ema_resumes_with_the_ema_started_at_its_weights(ema_run, tmp_path):
    run = tmp_path / "run"
    copy_until(ema_run[0], run, 2)
    run_train(run, "max_steps=3", "ckpt_every=1", "keep_last=3")  # no EMA: step 3 saves none
    assert not has_ema(str(run / "ckpt-00000003"))
    with pytest.raises(CheckpointError, match="holds no EMA"):
        load_model(str(run / "ckpt-00000003"), ema=True)
    p = run_train(run, *RUN)
    assert "ckpt-00000003 has no EMA of the weights" in p.stderr
    w3 = read_checkpoint(str(run / "ckpt-00000003"))["model"]
    w4, ema = read_checkpoint(str(run / "ckpt-00000004"))["model"], read_ema(str(run / "ckpt-00000004"))
    d = min(DECAY, (1 + 3) / (10 + 3))  # one update, after 3 steps, from the weights of step 3
    assert all(torch.allclose(ema[k], torch.lerp(w3[k], w4[k], 1 - d), rtol=0, atol=1e-7) for k in ema)


@pytest.mark.slow(seconds=12)
def test_a_sharded_run_keeps_the_ema_as_an_unsharded_one_does(ema_run, tmp_path):
    """train.strategy=fsdp on a group of one: the EMA as DTensors through the step, validation (the
    whole copy gathered from the swapped shards) and the sharded checkpoint."""
    run = tmp_path / "run"
    p = run_train(run, *RUN, "train.strategy=fsdp", "val.every=2", "val.max_utterances=4")
    assert "sharded over 1 rank(s)" in p.stderr and p.stderr.count("(EMA weights)") == 3
    la, lb = losses(ema_run[0]), losses(run)
    assert all(abs(la[s] - lb[s]) <= 1e-4 * abs(la[s]) for s in la), (la, lb)
    # validation gathered the swapped shards: the EMA's loss, not the weights' (which differs by far more)
    assert metric(run, "val/dev/loss") == pytest.approx(metric(ema_run[0], "val/dev/loss"), rel=1e-4)
    a, b = read_ema(str(ema_run[0] / "ckpt-00000004")), read_ema(str(run / "ckpt-00000004"))
    assert a.keys() == b.keys()
    # All tensors together: a bias that cancels out (a convolution's before BatchNorm) gets noise for
    # a gradient, which AdamW scales up (tests/test_train_distributed.py), in the EMA as in the weights.
    flat = [torch.cat([d[k].flatten() for k in sorted(a)]) for d in (a, b)]
    assert (flat[0] - flat[1]).norm() <= 1e-3 * flat[1].norm()


@pytest.mark.slow(seconds=8)
def test_infer_ema_decodes_the_ema_weights(ema_run):
    run = ema_run[0]
    saved = read_ema(str(run / "ckpt-00000004"))
    averaged, raw = load_model(str(run), ema=True), load_model(str(run))
    params = dict(averaged.model.named_parameters())
    assert all(torch.equal(params[k], v) for k, v in saved.items())
    assert torch.equal(averaged.model.decoder.output_proj.weight,  # tied to the embedding: the same EMA
                       saved["decoder.embedding.token_embedding.weight"])
    raw_params = dict(raw.model.named_parameters())
    assert any(not torch.equal(raw_params[k], v) for k, v in saved.items())
    wav = os.path.join(MINI, "examples", "en_asr_16k.wav")
    p = run_in_process(cli_infer.main, ["--ckpt", str(run), "--ema", "--quiet", wav])
    assert p.returncode == 0 and "decoding the EMA of the weights" in p.stderr and wav in p.stdout
    p = run_in_process(cli_infer.main, ["--ckpt", str(run), "--ema", "--average", "2", wav])
    assert p.returncode == 2 and "--ema and --average do not combine" in p.stderr


# --- two ranks: FSDP against DDP -------------------------------------------------------------------


@pytest.mark.slow(seconds=20)
def test_ema_under_fsdp_equals_ema_under_ddp(tmp_path):
    """The toy model trained the same way on two ranks (gloo) under DDP and FSDP2 (this file's
    `__main__`); FSDP's EMA written sharded through DCP by both ranks, read back whole."""
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        __file__, str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    ddp, fsdp = torch.load(tmp_path / "ddp.pt"), read_ema(str(tmp_path / "fsdp"))
    assert ddp.keys() == fsdp.keys()
    for k in ddp:
        torch.testing.assert_close(fsdp[k], ddp[k], rtol=RTOL, atol=ATOL)
    initial = dict(toy().named_parameters())
    assert all(not torch.allclose(ddp[k], initial[k]) for k in ddp)  # it moved: the comparison means something


def two_ranks(out: str) -> None:
    """Under torchrun with 2 ranks: TOY_STEPS AdamW steps of the toy model on each rank's own
    batches, under DDP and then under FSDP2, each with an EMA. Rank 0 saves DDP's EMA (torch.save);
    FSDP's is saved by both ranks through DCP, each its shards, as train.py's checkpoints are. Ends
    the process as train.py does (aed.train_distributed.exit_worker)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    from aed.train_checkpoint import training_tensors

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for strategy in ("ddp", "fsdp"):
        model = toy()
        if strategy == "fsdp":
            mesh = init_device_mesh("cpu", (2,))
            fully_shard(model[0], mesh=mesh)  # a unit of its own, as train.py's layers are
            parallel = fully_shard(model, mesh=mesh)
        else:
            parallel = DistributedDataParallel(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ema = ExponentialMovingAverage(model, DECAY)
        batches = torch.Generator().manual_seed(rank)  # each rank its own batches, the same under both
        for step in range(TOY_STEPS):
            parallel(torch.randn(4, 8, generator=batches)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            ema.update(model, step)
        if strategy == "ddp" and rank == 0:
            torch.save(ema.state_dict(), os.path.join(out, "ddp.pt"))
        elif strategy == "fsdp":
            params = dict(model.named_parameters())
            assert all(e.placements == params[k].placements for k, e in ema.weights.items())
            dcp.save(training_tensors(model, optimizer, ema), checkpoint_id=os.path.join(out, "fsdp"))
    exit_worker()


if __name__ == "__main__":
    two_ranks(sys.argv[1])
