"""torchrun --max-restarts end to end: a rank killed mid-run (SIGKILL) makes torchrun stop the other
rank and start both again, and the new workers resume from the newest complete checkpoint without
anyone re-running the command. Two ranks on CPU (gloo), against the uninterrupted DDP run that
tests/test_train_distributed.py makes once per session."""

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from test_train import ROOT, SMALL, losses
from test_train_distributed import TWO_RANK, two_rank_run

from aed.model_checkpoint import read_checkpoint

pytestmark = pytest.mark.slow(seconds=80)
# The reference run's settings: the kill comes right after the first checkpoint (step 3), with steps 4-6 to go.
RUN = ("train.strategy=ddp", *TWO_RANK)


def workers(torchrun_pid: int) -> dict[int, int]:
    """{rank: pid} of the training processes torchrun started (its children; /proc, no psutil)."""
    ranks = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])  # the name in () may hold spaces
            if parent != torchrun_pid:
                continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
        except (OSError, ValueError):  # a process that ended meanwhile
            continue
        if b"RANK" in env:
            ranks[int(env[b"RANK"])] = int(entry)
    return ranks


def torchrun(run_dir, log_path, *args) -> subprocess.Popen:
    """train.py on 2 ranks under torchrun (`args`: its own flags), writing to `log_path`: a file, not a
    pipe, which nobody would read while the test waits."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *args,
           "train.py", "configs/tiny.yaml", f"run_dir={run_dir}", *SMALL, *RUN]
    # The setting tools/slurm.sbatch exports: without it torch's c10d rendezvous gives restarted
    # workers the first attempt's store, and their process group can hang (aed/train_distributed.py).
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    with open(log_path, "w") as log:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def test_a_killed_rank_is_restarted_and_the_run_ends_as_an_uninterrupted_one(tmp_path, made_once):
    reference, run = two_rank_run(made_once, "ddp")[0], tmp_path / "restarted"
    p = torchrun(run, tmp_path / "restarted.log", "--max-restarts=1")
    try:
        first = run / "ckpt-00000003" / "COMPLETE"
        deadline = time.monotonic() + 300  # generous: 2 busy cores
        while not first.exists() and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert first.exists(), f"no checkpoint at step 3:\n{(tmp_path / 'restarted.log').read_text()[-5000:]}"
        started = workers(p.pid)
        assert sorted(started) == [0, 1], started
        os.kill(started[0], signal.SIGKILL)  # rank 0: it also publishes the checkpoints
        p.wait(timeout=600)
    finally:
        if p.poll() is None:  # a hang: end torchrun and the workers it started, by their ids
            for pid in workers(p.pid).values():
                with contextlib.suppress(ProcessLookupError):  # one that ended meanwhile
                    os.killpg(pid, signal.SIGKILL)  # torchrun starts each worker in a session of its own
            p.kill()
            p.wait()
    out = (tmp_path / "restarted.log").read_text()
    assert p.returncode == 0, out[-5000:]
    assert "restart 1 of torchrun's --max-restarts 1: resuming from" in out, out[-5000:]

    # The same batches after the checkpoint, and bitwise the same weights at the end, BatchNorm's running
    # statistics included (a checkpoint holds rank 0's: aed.train_distributed.share_rank0_buffers).
    assert losses(run) == losses(reference)
    final = [read_checkpoint(str(r / "ckpt-00000006"))["model"] for r in (run, reference)]
    assert final[0].keys() == final[1].keys()
    assert all(torch.equal(final[0][k], final[1][k]) for k in final[0])
