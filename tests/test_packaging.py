"""What `pip install .` puts on the import path: the package `aed`, the self-contained bucketing
modules `sampler` and `bins` (pyproject.toml says why they stay top-level), and the commands
aed-train, aed-oom and aed-infer; not the checkout's scripts (train.py, oom.py, infer.py)."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_wheel_holds_aed_and_the_bucketing_modules_only(tmp_path):
    pytest.importorskip("setuptools", reason="building the wheel without network needs setuptools installed")
    source = tmp_path / "source"  # a copy, so the build leaves no build/ or egg-info in the checkout
    shutil.copytree(ROOT / "aed", source / "aed", ignore=shutil.ignore_patterns("__pycache__"))
    for path in ROOT.glob("*.py"):
        shutil.copy(path, source)
    for name in ("pyproject.toml", "README.md", "requirements.txt"):
        shutil.copy(ROOT / name, source)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(source),
                    "-w", str(tmp_path / "wheel")], check=True, capture_output=True, timeout=120)
    (wheel,) = (tmp_path / "wheel").glob("aed-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        entry_points = next(z.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt"))
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"aed", "sampler.py", "bins.py"}, top
    assert {f"aed/{p.name}" for p in (ROOT / "aed").glob("*.py")} <= set(names)
    for command in ("aed-train = aed.cli_train:cli", "aed-oom = aed.cli_oom:main", "aed-infer = aed.cli_infer:main"):
        assert command in entry_points, entry_points
