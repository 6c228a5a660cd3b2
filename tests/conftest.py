import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).parent))  # spawned ranks import rank_fns from here too
# DeepSpeed compiles a small comm op on first use: cache it in the build folder, as make does.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / "_build" / "torch_extensions"))
os.environ.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")


@pytest.fixture(scope="session")
def lab_metrics() -> dict:
    """Execute every lab through papermill with the CI profile (skipped when nothing changed)."""
    from labkit.labs import OUT_DIR, list_labs, run_lab

    return {name: json.loads(run_lab(name, "ci", OUT_DIR).read_text()) for name in list_labs()}


# `make test` runs two pytest workers (pytest-xdist, --dist loadgroup): a test file is one unit of
# work, so its module fixtures are built once; the labs and the book share the executed labs, so they
# are one unit, and the longest units go first so that neither worker is left with a long tail.
GROUPS = {"test_labs": "labs", "test_book": "labs"}
FIRST = ("labs", "test_assignments", "test_slurm", "test_fault_tolerance", "test_train", "test_sharded")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if not item.get_closest_marker("xdist_group"):
            module = Path(str(item.fspath)).stem
            item.add_marker(pytest.mark.xdist_group(GROUPS.get(module, module)))

    def rank(item):
        group = item.get_closest_marker("xdist_group").args[0]
        return FIRST.index(group) if group in FIRST else len(FIRST)
    items.sort(key=rank)  # stable: within a unit, tests keep their order
