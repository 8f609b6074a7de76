import ast
import os
from dataclasses import dataclass, field

import pytest

from aed.config import ConfigError, load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Optim:
    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.98)


@dataclass
class Run:
    name: str = "run"
    steps: int = 10
    bf16: bool = False
    init_from: str | None = None
    manifests: list[dict | str] = field(default_factory=list)
    optim: Optim = field(default_factory=Optim)


def test_precedence_defaults_yaml_overrides(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("steps: 20\noptim:\n  lr: 0.001\n")
    cfg = load_config(Run, str(y), ["optim.lr=5e-4", "name=x"])
    assert (cfg.steps, cfg.optim.lr, cfg.name, cfg.optim.betas) == (20, 5e-4, "x", (0.9, 0.98))


def test_list_and_mapping_overrides():
    cfg = load_config(Run, None, ["manifests=[{path: a.jsonl, weight: 2}, b.jsonl]",
                                  "init_from=ckpt.pt", "optim.betas=[0.8, 0.9]"])
    assert cfg.manifests == [{"path": "a.jsonl", "weight": 2}, "b.jsonl"]
    assert cfg.init_from == "ckpt.pt" and cfg.optim.betas == (0.8, 0.9)


def test_int_is_accepted_for_float():
    assert load_config(Run, None, ["optim.lr=1"]).optim.lr == 1.0


@pytest.mark.parametrize("override, message", [
    ("stepz=3", "stepz"),
    ("optim.lrr=3", "optim.lrr"),
    ("steps=abc", "steps"),
    ("steps=true", "steps"),
    ("bf16=1", "bf16"),
    ("optim=3", "optim"),
    ("name.x=3", "name"),
    ("steps", "key=value"),
])
def test_errors_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(Run, None, [override])


def test_yaml_unknown_key(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("optim:\n  momentum: 0.9\n")
    with pytest.raises(ConfigError, match="optim.momentum"):
        load_config(Run, str(y))


def test_imports_nothing_from_aed():
    """aed/model.py and aed/train_config.py both import it; an `aed` import here would bring back their cycle."""
    with open(os.path.join(ROOT, "aed/config.py")) as f:
        tree = ast.parse(f.read())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [n for n in names if n == "aed" or n.startswith("aed.")], names
