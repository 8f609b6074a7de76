"""tools/slurm.sbatch's own logic, without SLURM: fake `srun`, `scontrol`, `scancel` and `torchrun` on
PATH record what the script asks of them, and the fake torchrun behaves as train.py does on SIGTERM
(finish, save, exit 0). Through the time-limit signal (SIGUSR1 to the script): the training step is
signalled, saves, the job is requeued and exits with the step's status; the rendezvous port comes
from the job id; a failed step's status is the job's."""

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FAKES = {
    "scontrol": """echo "scontrol $*" >> "$FAKE_LOG"
if [ "$1 $2" = "show hostnames" ]; then echo node1; echo node2; fi""",
    "scancel": """echo "scancel $*" >> "$FAKE_LOG"
kill -TERM "$(cat "$FAKE_DIR/step.pid")\"""",
    # srun's own options, then the command, which keeps srun's pid (the job step scancel signals)
    "srun": """echo "srun $*" >> "$FAKE_LOG"
while [ "${1#--}" != "$1" ]; do shift; done
echo $$ > "$FAKE_DIR/step.pid"
exec "$@\"""",
    # train.py as torchrun runs it: on SIGTERM it finishes its step, saves and exits 0
    "torchrun": """echo "torchrun $*" >> "$FAKE_LOG"
if [ -n "$FAKE_FAIL" ]; then exit "$FAKE_FAIL"; fi
trap 'echo "checkpoint saved" >> "$FAKE_LOG"; exit 0' TERM
echo started >> "$FAKE_LOG"
sleep 60 & wait""",
}


def fake_slurm(tmp_path: Path, job_id: int, **env) -> tuple[subprocess.Popen, Path]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in FAKES.items():
        (bin_dir / name).write_text("#!/bin/bash\n" + body + "\n")
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "calls.log"
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "FAKE_LOG": str(log),
           "FAKE_DIR": str(tmp_path), "SLURM_JOB_ID": str(job_id), "SLURM_JOB_NODELIST": "node[1-2]",
           "SLURM_NNODES": "2", "SLURM_CPUS_PER_TASK": "4", **env}
    p = subprocess.Popen(["bash", str(ROOT / "tools" / "slurm.sbatch"), "configs/tiny.yaml", "run_dir=runs/x"],
                         cwd=tmp_path, env=env)
    return p, log


def calls(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def test_time_limit_saves_requeues_and_exits_with_the_steps_status(tmp_path):
    p, log = fake_slurm(tmp_path, 12345)
    deadline = time.time() + 30
    while "started" not in calls(log) and time.time() < deadline:
        time.sleep(0.05)
    assert "started" in calls(log), calls(log)
    p.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@120 sends before the time limit
    assert p.wait(timeout=30) == 0
    lines = calls(log)
    torchrun = next(line for line in lines if line.startswith("torchrun"))
    assert "--rdzv_endpoint node1:32345" in torchrun and "--rdzv_id 12345" in torchrun  # 20000 + 12345
    assert "--nnodes 2" in torchrun and torchrun.endswith("train.py configs/tiny.yaml run_dir=runs/x")
    assert next(line for line in lines if line.startswith("srun")).startswith("srun --cpus-per-task=4 torchrun")
    order = [line for line in lines if line.startswith(("scancel", "checkpoint", "scontrol requeue"))]
    assert order == ["scancel --signal=TERM 12345", "checkpoint saved", "scontrol requeue 12345"]


@pytest.mark.parametrize("job_id, port", [(12346, 32346), (52345, 32345), (7, 20007)])
def test_the_rendezvous_port_comes_from_the_job_id(tmp_path, job_id, port):
    p, log = fake_slurm(tmp_path, job_id, FAKE_FAIL="3")
    assert p.wait(timeout=30) == 3  # a failed step fails the job, with its status, and is not requeued
    lines = calls(log)
    assert any(f"--rdzv_endpoint node1:{port} " in line for line in lines), lines
    assert not any("requeue" in line for line in lines)


def test_the_port_can_be_set(tmp_path):
    p, log = fake_slurm(tmp_path, 12345, FAKE_FAIL="1", AED_RDZV_PORT="29400")
    assert p.wait(timeout=30) == 1
    assert any("--rdzv_endpoint node1:29400 " in line for line in calls(log))
