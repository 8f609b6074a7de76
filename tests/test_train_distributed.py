"""Two ranks on CPU (gloo): DDP in sync, train.strategy=fsdp (FSDP2) against DDP, and checkpoints
through torch.distributed.checkpoint: exact resume, another world size, another strategy,
asynchronous saves, and inference from a sharded checkpoint. One DDP and one FSDP run serve all;
FSDP on a single process has its own pair of runs."""

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch
from test_train import MINI, ROOT, losses, run_train

from aed.decode_transcribe import read_requests, transcribe
from aed.model_checkpoint import TRAINING_KEYS, load_latest, load_model, read_checkpoint
from aed.train_checkpoint import CheckpointWriter

pytestmark = pytest.mark.slow
# FSDP reduce-scatters where DDP all-reduces, and sums in another order: not bitwise, but close.
LOSS_TOLERANCE = 1e-4
VALIDATE = ("val.every=6", "val.max_utterances=8")  # validation on a gathered copy of the sharded weights
TWO_RANK = ("max_steps=6", "ckpt_every=3", "keep_last=2", *VALIDATE)  # the runs two_rank_run makes


def metric(run_dir, key: str):
    """The last value of `key` in the run's metrics.jsonl."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [row[key] for row in map(json.loads, f) if key in row][-1]


def copy_until(src, dst, step: int) -> None:
    """dst: the run dir of `src` as it was right after its checkpoint at `step`."""
    shutil.copytree(src, dst, ignore=lambda d, names: [n for n in names if n.startswith("ckpt-")
                                                       and n != f"ckpt-{step:08d}"])


def two_rank_run(made_once, strategy: str):
    """6 steps at 2 ranks, with a checkpoint at step 3 (and 6): (run dir, train.py's stderr)."""
    def make(folder):
        p = run_train(folder / "run", f"train.strategy={strategy}", *TWO_RANK, nproc=2)
        (folder / "stderr.txt").write_text(p.stderr)

    folder = made_once(f"two-rank-{strategy}", make)
    return folder / "run", (folder / "stderr.txt").read_text()


@pytest.fixture(scope="module")
def ddp_run(made_once):
    return two_rank_run(made_once, "ddp")


@pytest.fixture(scope="module")
def fsdp_run(made_once):
    return two_rank_run(made_once, "fsdp")[0]


def test_ddp_two_ranks_stay_in_sync(ddp_run):
    run, stderr = ddp_run
    assert stderr.count("equal on 2 rank(s)") == 2  # parameter checksums compared at steps 3 and 6
    ckpt = read_checkpoint(str(run / "ckpt-00000006"), TRAINING_KEYS)
    assert len(ckpt["sampler"]) == 2
    assert ckpt["sampler"][0]["batches"] == ckpt["sampler"][1]["batches"]


def test_ddp_resume_on_fewer_ranks_continues_weights_optimizer_schedule_and_data(ddp_run, tmp_path):
    """2 ranks -> 1. Guaranteed: weights, optimizer moments, schedule and step continue exactly
    (test_faults' round trip), and the data pass continues without repeating what was trained in it
    (test_faults' sampler test); not guaranteed: the same batches as an uninterrupted run."""
    run = tmp_path / "run"
    copy_until(ddp_run[0], run, 3)
    assert len(list((run / "ckpt-00000003").glob("__*_0.distcp"))) == 2  # both ranks wrote a part
    p = run_train(run, "max_steps=5", "ckpt_every=5")
    assert "written by 2 ranks, this run has 1" in p.stderr and "at step 3" in p.stderr
    two, one = read_checkpoint(str(run / "ckpt-00000003"), TRAINING_KEYS), read_checkpoint(
        str(run / "ckpt-00000005"), TRAINING_KEYS)
    assert len(two["sampler"]) == 2 and len(one["sampler"]) == 1
    assert one["scheduler"]["last_epoch"] == 5
    assert all(int(s["step"]) == 5 for s in one["optimizer"]["state"].values())  # 3 + 2 AdamW updates
    assert one["sampler"][0]["pass_idx"] == two["sampler"][0]["pass_idx"]  # the same pass continues


def assert_trains_and_decodes_alike(ddp, fsdp) -> None:
    """Two 6-step runs, DDP's and FSDP's: the same losses and FLOPs, and checkpoints that compute alike."""
    la, lb = losses(ddp), losses(fsdp)
    assert sorted(la) == sorted(lb) == [1, 2, 3, 4, 5, 6]
    assert all(abs(la[s] - lb[s]) <= LOSS_TOLERANCE * abs(la[s]) for s in la), (la, lb)
    val_losses = [metric(run, "val/dev/loss") for run in (ddp, fsdp)]
    assert val_losses[0] == pytest.approx(val_losses[1], rel=LOSS_TOLERANCE)
    flops = [metric(run, "train/flops") for run in (ddp, fsdp)]
    assert flops[0] == flops[1] > 0  # the same matmuls: FSDP's gathers and reductions are no FLOPs

    # infer.py's loader, one process, no distributed world: the sharded checkpoint reads whole.
    # Weights are compared through what they compute: a bias that cancels out (keys' before the
    # softmax, a convolution's before BatchNorm) has no gradient but noise, which AdamW scales up.
    a, b = load_model(str(ddp)), load_model(str(fsdp))
    assert a.path.endswith("ckpt-00000006") and b.path.endswith("ckpt-00000006")
    assert a.model.state_dict().keys() == b.model.state_dict().keys()
    feats, feat_lens = torch.randn(3, 300, a.features.n_mels), torch.tensor([300, 250, 120])
    with torch.no_grad():
        (x, _), (y, _) = a.model.encode(feats, feat_lens), b.model.encode(feats, feat_lens)
    assert (x - y).norm() <= 1e-3 * y.norm()  # elementwise up to ~1.5e-3 where values reach ~2.6
    requests = read_requests(os.path.join(MINI, "dev.jsonl"))[:8]
    texts = [[r.pred_text for r in transcribe(asr, requests)[0]] for asr in (a, b)]
    assert texts[0] == texts[1]


def test_fsdp_trains_like_ddp_and_its_checkpoint_decodes_like_ddps(ddp_run, fsdp_run):
    assert_trains_and_decodes_alike(ddp_run[0], fsdp_run)


def test_fsdp_on_one_process_shards_over_a_group_of_one_and_trains_like_ddp(tmp_path):
    """train.strategy=fsdp without torchrun: the same sharded step and checkpoints on one rank,
    so that an FSDP run can be tried out on one GPU (no memory saved: nothing to shard over)."""
    runs = {}
    for strategy in ("ddp", "fsdp"):
        runs[strategy] = tmp_path / strategy
        p = run_train(runs[strategy], f"train.strategy={strategy}", "max_steps=6", "ckpt_every=3", *VALIDATE)
        assert ("sharded over 1 rank(s) (FSDP2)" in p.stderr) == (strategy == "fsdp")
    assert_trains_and_decodes_alike(runs["ddp"], runs["fsdp"])
    assert not torch.distributed.is_initialized()  # train.py's group of one ends with the run


def test_init_from_loads_into_a_sharded_model_as_into_a_whole_one(ddp_run, tmp_path):
    """init_from under train.strategy=fsdp: each full tensor of the checkpoint is sharded as its
    parameter is, and a head the checkpoint lacks stays random, as under DDP: the first step's loss
    (the loaded weights') is DDP's."""
    first = {}
    for strategy in ("ddp", "fsdp"):
        run = tmp_path / strategy
        p = run_train(run, f"train.strategy={strategy}", f"init_from={ddp_run[0] / 'ckpt-00000006'}", "max_steps=1",
                      "val.every=100")
        assert "init_from" in p.stderr and "loaded" in p.stderr
        first[strategy] = losses(run)[1]
    assert abs(first["ddp"] - first["fsdp"]) < LOSS_TOLERANCE, first


def test_fsdp_resumes_exactly_mid_epoch(fsdp_run, tmp_path):
    run = tmp_path / "run"
    copy_until(fsdp_run, run, 3)
    p = run_train(run, "train.strategy=fsdp", "max_steps=6", "ckpt_every=3", "keep_last=2", nproc=2)
    assert "resumed from" in p.stderr and "at step 3" in p.stderr
    la, lb = losses(fsdp_run), losses(run)
    assert all(la[s] == lb[s] for s in (4, 5, 6)), (la, lb)  # bitwise: same batches, shards and dropout


def test_a_sharded_checkpoint_resumes_on_one_rank_and_under_ddp(fsdp_run, tmp_path):
    ckpt3 = read_checkpoint(str(fsdp_run / "ckpt-00000003"), TRAINING_KEYS)
    for name, extra in (("one", dict(nproc=1)), ("ddp", dict(nproc=2))):
        run = tmp_path / name
        copy_until(fsdp_run, run, 3)
        p = run_train(run, "train.strategy=ddp", "max_steps=5", "ckpt_every=5", **extra)
        assert "at step 3" in p.stderr
        assert ("written by 2 ranks, this run has 1" in p.stderr) == (name == "one")
        ckpt5 = read_checkpoint(str(run / "ckpt-00000005"), TRAINING_KEYS)
        assert ckpt5["scheduler"]["last_epoch"] == 5 and len(ckpt5["sampler"]) == extra["nproc"]
        steps = {int(s["step"]) for s in ckpt5["optimizer"]["state"].values()}
        assert steps == {5}, steps  # the sharded AdamW state continued: 3 + 2 updates
        assert ckpt5["model"].keys() == ckpt3["model"].keys()


def test_an_async_checkpoint_counts_only_once_written_and_published(tmp_path):
    """While a checkpoint is being written in the background (or if the job is killed then), the
    run directory's newest valid checkpoint is the previous one."""
    from test_faults import fake_state
    writer = CheckpointWriter(str(tmp_path), keep_last=1, rank=0, asynchronous=True, distributed=False)
    writer.save(fake_state(1), 1)
    writer.finish()
    writer.save(fake_state(2), 2)  # returns once the tensors are copied
    assert not (tmp_path / "ckpt-00000002" / "COMPLETE").exists()
    path, ckpt = load_latest(str(tmp_path))
    assert path.endswith("ckpt-00000001") and ckpt["step"] == 1
    writer.finish()
    path, ckpt = load_latest(str(tmp_path))
    assert path.endswith("ckpt-00000002") and torch.equal(ckpt["model"]["w"], torch.full((4,), 2.0))
    assert not (tmp_path / "ckpt-00000001").exists()  # keep_last=1: removed once its successor counted



def test_poll_publishes_a_finished_async_checkpoint_without_waiting_for_the_next_save(tmp_path):
    from test_faults import fake_state
    writer = CheckpointWriter(str(tmp_path), keep_last=2, rank=0, asynchronous=True, distributed=False)
    writer.save(fake_state(1), 1)
    deadline = time.time() + 60
    while writer.pending is not None and time.time() < deadline:  # the loop calls poll every step
        writer.poll()
        time.sleep(0.01)
    assert writer.pending is None and (tmp_path / "ckpt-00000001" / "COMPLETE").exists()
    assert load_latest(str(tmp_path))[1]["step"] == 1


# --- the end of a process -----------------------------------------------------------------------


# A rank's last moments, as short as they can be: its process group held past destroy_process_group,
# as DDP and FSDP hold it, broadcasts of Python objects (as a checkpoint's plan is broadcast), the end.
LAST_COLLECTIVES = """
import torch.distributed as dist

from aed.train_distributed import exit_worker, init_distributed

init_distributed()
held = dist.group.WORLD
for step in range(3):
    plan = [{"step": step}] if dist.get_rank() == 0 else [None]
    dist.broadcast_object_list(plan, src=0)
    assert plan == [{"step": step}], plan
exit_worker()
"""
LAUNCHES = 10  # one after another: each is a chance for a rank to reach its finalization first


@pytest.mark.slow(seconds=60)
def test_ranks_end_cleanly_right_after_their_last_collectives(tmp_path):
    """No rank aborts at its exit (aed.train_distributed.exit_worker). Ended by destroy_process_group
    and the interpreter's own exit instead, some of these launches lose a rank to SIGABRT, more the
    busier the cores."""
    script = tmp_path / "last_collectives.py"
    script.write_text(LAST_COLLECTIVES)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for _ in range(LAUNCHES):
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0 and "terminate called" not in p.stderr, p.stderr[-3000:]
