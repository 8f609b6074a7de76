"""The map in aed/__init__.py is the code: it lists every module of the package once, in layers
(config, data, model, decode, train, memory, cli), and every module imports only modules listed above
it. So decoding never loads training code, and `import aed` for transcription loads none."""

import ast
import subprocess
import sys
from pathlib import Path

import aed

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "aed"
LAYERS = ("config", "data", "model", "decode", "train", "memory", "cli")


def mapped_modules() -> list[str]:
    """The modules the map names, in its order: the lines `name  what it is` of its block."""
    doc = aed.__doc__.splitlines()
    start = next(k for k, line in enumerate(doc) if line.startswith("config "))
    block = doc[start: doc.index("", start)]
    return [line.split()[0] for line in block if len(line.split()) > 1]


def aed_imports(path: Path) -> set[str]:
    """The aed modules a file imports, at any depth (function-level imports included)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("aed."):
            out.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            out |= {a.name.split(".")[1] for a in node.names if a.name.startswith("aed.")}
    return out


def test_the_map_lists_every_module_once_in_layer_order():
    mapped = mapped_modules()
    assert len(mapped) == len(set(mapped)), "a module listed twice"
    assert sorted(mapped) == sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")
    layers = [LAYERS.index(m.split("_")[0]) for m in mapped]
    assert layers == sorted(layers), f"layers out of order: {mapped}"


def test_every_import_goes_to_a_module_listed_above():
    order = {m: k for k, m in enumerate(mapped_modules())}
    upward = [f"{m} imports {target}" for m, k in order.items()
              for target in sorted(aed_imports(PACKAGE / f"{m}.py")) if order[target] >= k]
    assert not upward, "imports that do not go up the map:\n  " + "\n  ".join(upward)


def test_the_bucketing_modules_import_nothing_from_aed():
    for name in ("sampler.py", "bins.py"):
        assert not aed_imports(ROOT / name), name


def test_importing_aed_loads_no_training_code():
    loaded = subprocess.run([sys.executable, "-c", "import sys, aed; print(sorted(m for m in sys.modules "
                             "if m.startswith(('aed.train', 'aed.memory', 'aed.cli'))))"],
                            capture_output=True, text=True, check=True, cwd=ROOT).stdout.strip()
    assert loaded == "[]"


def test_the_readme_layout_lists_the_modules_in_the_maps_order():
    readme = (ROOT / "README.md").read_text()
    listed = [line.split("`")[1][len("aed/"): -len(".py")] for line in readme.splitlines()
              if line.startswith("| `aed/")]
    assert listed == mapped_modules()
