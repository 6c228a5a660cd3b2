import json
import os
import shutil
import sys
from pathlib import Path

import pytest
# nbgrader imports setuptools, whose distutils shim asserts that it loaded its own distutils; in a
# process where pip was imported first, the standard library's distutils.core is loaded instead and
# the import fails (reproduced: `import pip, distutils.core; import nbgrader.preprocessors`). A CI run
# met it in test_hub_safety, after whatever ran before it on that worker. setuptools first, in every
# worker, and the shim has done its work before anything can import pip.
import setuptools  # noqa: F401,E402

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
sys.path.insert(0, str(Path(__file__).parent))  # spawned ranks import rank_fns from here too
# DeepSpeed compiles a small comm op on first use: cache it in the build folder, as make does.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / "_build" / "torch_extensions"))
os.environ.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # Two workers share the cores: one OpenMP thread each (and in what they start, whose ranks
    # divide the cores among themselves anyway), or spinning thread pools fight over them.
    os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def lab_metrics() -> dict:
    """Execute every lab through papermill with the CI profile (skipped when nothing changed), two at
    a time: a lab's ranks keep about one core busy, and the other pytest worker leaves gaps."""
    from labkit.labs import OUT_DIR, list_labs
    from labkit.labs.runner import run_labs

    names = list_labs()
    return {name: json.loads(path.read_text()) for name, path in zip(names, run_labs(names, "ci", OUT_DIR, jobs=2))}


@pytest.fixture(scope="session")
def grading_sandbox() -> None:
    """Autograde runs every submission in bubblewrap (labkit/course/sandbox.py): without it, it refuses."""
    from labkit.course.sandbox import SandboxedKernelManager, SandboxRefused, check_bwrap

    try:
        check_bwrap(SandboxedKernelManager().bwrap)
    except SandboxRefused as e:
        pytest.fail(f"{e}. .ci/run installs Debian's `bubblewrap`; on another machine install it with your "
                    "package manager")


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).exists():
        pytest.fail("chromium is not installed: .ci/run installs Debian's `chromium`; "
                    "on another machine install it with your package manager")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run"])
        yield b
        b.close()


# `make test` runs three pytest workers (pytest-xdist): a test file is one unit of work, so its module
# fixtures are built once; the labs and the book share the executed labs, so they are one unit; and
# the longest units go first, so that no worker is left with a long tail. (The scheduler is
# ours: xdist 3.8's loadgroup renames node ids, which pytest 9 no longer lets it do.)
UNITS = {"test_labs": "labs", "test_book": "labs", "test_lab_style": "labs", "test_book_claims": "labs"}
# Longest first, as measured in CI (the rule that packs the workers best: a long unit never starts last).
FIRST = ("labs", "test_assignments", "test_mesh", "test_train", "test_slurm", "test_hub", "test_gpu_check", "test_hub_image", "test_fault_tolerance",
         "test_failures_at_scale",
         "test_sharded", "test_pipeline_parallel", "test_parallel", "test_p2p", "test_cluster_files",
         "test_moe", "test_communication", "test_tensor_parallel", "test_activation_checkpointing", "test_packing",
         "test_context_parallel", "test_memory", "test_launch")


def _unit(nodeid: str) -> str:
    module = Path(nodeid.split("::", 1)[0]).stem
    return UNITS.get(module, module)


def pytest_collection_modifyitems(config, items):
    def rank(item):
        unit = _unit(item.nodeid)
        return FIRST.index(unit) if unit in FIRST else len(FIRST)
    items.sort(key=rank)  # stable: within a unit, tests keep their order


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, absent when it is not installed
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ByUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _unit(nodeid)

    return ByUnit(config, log)


# Where the suite's time goes, worker by worker: `make test` keeps each test phase's start, end and
# worker in _build/test-timeline.tsv (durations alone cannot show a worker left idle at the end).
TIMELINE = ROOT / "_build" / "test-timeline.tsv"


def pytest_sessionstart(session):
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        TIMELINE.parent.mkdir(exist_ok=True)
        TIMELINE.write_text("worker\tstart\tstop\tphase\ttest\n")


def pytest_runtest_logreport(report):
    node = getattr(report, "node", None)  # set on the controller for a report from an xdist worker
    if os.environ.get("PYTEST_XDIST_WORKER") or not hasattr(report, "start"):
        return
    worker = node.gateway.id if node is not None else "main"
    with TIMELINE.open("a") as f:
        f.write(f"{worker}\t{report.start:.1f}\t{report.stop:.1f}\t{report.when}\t{report.nodeid}\n")
