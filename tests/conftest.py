import getpass
import os
import shutil
import tempfile

import pytest
import torch
from filelock import FileLock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Inductor's cache key leaves out ATEN_CPU_CAPABILITY: a graph compiled under one set of CPU kernels and
# loaded from the cache under another fails in its generated wrapper ("tuple args required"), so
# `make test-other-kernels` after `make test` failed every compiled test. Each kernel set gets its own
# cache; set here, before anything compiles, so that subprocesses inherit it.
if os.environ.get("ATEN_CPU_CAPABILITY") and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(
        tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}_{os.environ['ATEN_CPU_CAPABILITY'].lower()}")


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """Tests use tiny tensors: on a 2-core machine extra OpenMP threads only fight over the cores
    (tiny ops got up to 100x slower with two threads while another process was busy). The scripts
    that tests run in subprocesses get one thread too."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OMP_NUM_THREADS", "1")
        yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True, scope="session")
def checkout_on_pythonpath():
    """Tests run bench/ and tools/ scripts in subprocesses; without `pip install -e .` those find `aed`
    (and `sampler`, `oom`, `tools`) only through PYTHONPATH. This checkout goes first, so a venv shared
    between checkouts tests the code of this one."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PYTHONPATH", ROOT, prepend=os.pathsep)
        yield


@pytest.fixture(scope="session")
def made_once(tmp_path_factory):
    """made_once(name, make) -> a folder that `make(folder)` filled, once per `make test`.

    `--dist worksteal` spreads a module's tests over both workers, so a module fixture that trains or
    exports would run in each. Here the first worker to ask makes the folder under the session's
    shared temp dir; the other waits on its lock and reuses it. The folder is read-only by convention:
    tests copy what they change."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # pytest-N/, above popen-gwK/

    def made(name: str, make):
        folder, done = shared / name, shared / f"{name}.made"
        with FileLock(f"{folder}.lock"):
            if not done.exists():
                shutil.rmtree(folder, ignore_errors=True)
                folder.mkdir()
                make(folder)
                done.touch()
        return folder

    return made


def expected_seconds(item) -> float:
    """What a test's `slow(seconds=...)` marker says it takes on 2 busy cores (0 if it says nothing)."""
    slow = item.get_closest_marker("slow")
    return slow.kwargs.get("seconds", 0) if slow else 0


def pytest_collection_modifyitems(items):
    """Slow tests first, the longest of them at the very front (stable, so every xdist worker collects
    the same order). `make test`'s first worker gets the front half of the queue and works down from
    the longest; the other worker, once its own half is done, steals from the back (--dist worksteal).
    So the longest runs start first and neither worker ends alone on one of them."""
    items.sort(key=lambda item: (item.get_closest_marker("slow") is None, -expected_seconds(item)))
