"""bench/ssl_budget.py --quick end to end: every comparison is run and reported from real train.py runs."""

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow(seconds=50)
def test_quick_study_reports_every_comparison(tmp_path):
    plot = tmp_path / "ssl_budget.png"
    p = subprocess.run([sys.executable, "bench/ssl_budget.py", "--quick", "--work-dir", str(tmp_path / "work"),
                        "--plot", str(plot)], cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"),
                       capture_output=True, text=True, timeout=3600)
    assert p.returncode == 0, p.stderr[-4000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    metric = res["ssl_vs_scratch"]["metric"]
    assert metric in ("wer", "loss")
    for key, names in (("ssl_vs_scratch", ("ssl", "scratch")), ("slim_vs_wide", ("slim", "wide")),
                       ("data_size", ("full", "quarter"))):
        assert res[key]["metric"] == metric and all(math.isfinite(res[key][n]) and res[key][n] > 0 for n in names)
    assert abs(res["slim_vs_wide"]["params"]["slim"] / res["slim_vs_wide"]["params"]["wide"] - 1) < 0.1
    assert res["data_size"]["hours"]["quarter"] < 0.3 * res["data_size"]["hours"]["full"]
    sweep = res["size_sweep"]
    assert len(sweep) == 3 and sweep[0]["params"] < sweep[1]["params"] < sweep[2]["params"]
    for run in res["ssl"].values():  # every pretraining run stopped at the one FLOP budget, by itself
        assert run["flops"] >= res["budget_flops"] and run["steps"] >= 1 and math.isfinite(run["ssl_dev_loss"])
    assert {r["steps"] for r in res["finetune"].values()} == {res["finetune_steps"]}
    assert "scratch" in p.stdout and "quarter" in p.stdout  # the table
    if importlib.util.find_spec("matplotlib"):
        assert plot.stat().st_size > 0
