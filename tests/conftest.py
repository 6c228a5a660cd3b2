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
