"""labkit's shape: layers a tool enforces, short modules and functions, and the book's map to the code."""
import ast
import configparser
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LABKIT = ROOT / "labkit"
# Flat modules left at the top: the package's entry points and the old import paths the book and the
# README taught, kept as one-line re-exports of their new homes.
MAX_MODULE_LINES = 300
MAX_FUNCTION_LINES = 80


def test_import_contract_holds_no_layer_imports_upward_and_no_cycles():
    proc = subprocess.run([str(Path(sys.executable).parent / "lint-imports")], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "BROKEN" not in proc.stdout and proc.stdout.count("KEPT") == 3


def test_every_sub_package_sits_in_a_layer():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / ".importlinter")
    layered = set(re.findall(r"labkit\.(\w+)", cfg["importlinter:contract:layers"]["layers"]))
    packages = {p.parent.name for p in LABKIT.glob("*/__init__.py")}
    assert packages == layered, packages ^ layered
    acyclic = set(re.findall(r"labkit\.(\w+)", cfg["importlinter:contract:acyclic"]["ancestors"]))
    assert acyclic == packages


# Entry points by module name (python -m labkit.X), each calling one sub-package's main
ENTRY_POINTS = {"gpu_check.py": "labkit.course.gpu_check"}


def test_only_entry_points_stay_flat():
    """Everything lives in a sub-package; the old top-level import shims are gone (issue 47)."""
    flat = {p.name for p in LABKIT.glob("*.py")} - {"__init__.py", "__main__.py", *ENTRY_POINTS}
    for name, home in ENTRY_POINTS.items():
        imports = [n for n in ast.parse((LABKIT / name).read_text()).body if isinstance(n, ast.ImportFrom)]
        assert [n.module for n in imports] == [home], name
    assert not flat, flat


def _modules():
    return sorted(p for p in LABKIT.rglob("*.py"))


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(LABKIT)))
def test_modules_and_functions_are_short(path):
    src = path.read_text()
    assert len(src.splitlines()) <= MAX_MODULE_LINES, f"{path.name}: {len(src.splitlines())} lines"
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            n = node.end_lineno - node.lineno + 1
            assert n <= MAX_FUNCTION_LINES, f"{path.name}:{node.lineno} {node.name}() is {n} lines"


def test_readme_and_intro_map_every_chapter_to_its_lab_and_sub_package():
    toc = (ROOT / "_toc.yml").read_text()
    chapters = [c for c in re.findall(r"file: book/(\w+)\n", toc) if c not in ("intro",)]
    labs = re.findall(r"file: book/labs/(\w+)", toc)
    packages = {p.parent.name for p in LABKIT.glob("*/__init__.py")}
    for doc in (ROOT / "README.md", ROOT / "book" / "intro.md"):
        text = doc.read_text()
        rows = [line for line in text.splitlines() if line.startswith("|") and "labkit." in line]
        assert rows, f"{doc.name} has no chapter -> lab -> sub-package table"
        for chapter in chapters:
            if chapter in ("instructors", "clusters_runbook", "glossary", "references"):  # no lab, no package
                continue
            assert any(chapter in r or chapter.replace("_", " ") in r.lower() for r in rows), (doc.name, chapter)
        for lab in labs:
            assert any(lab in r for r in rows), (doc.name, lab)
        named = {m for r in rows for m in re.findall(r"labkit\.(\w+)", r)}
        assert named <= packages | {"memory", "train"}, named - packages


# The names the book and README teach, where they live (the old top-level shims are gone: issue 47).
TAUGHT = {"labkit.launch": ["launch"], "labkit.fault_tolerance": ["Checkpointer", "CheckpointError"],
          "labkit.feeding.packing": ["pack"], "labkit.memory": ["zero_model_state_bytes", "activation_bytes_per_layer"],
          "labkit.parallel.activation_checkpointing": ["apply"], "labkit.core.model": ["GPT", "GPTConfig"],
          "labkit.train": ["TrainConfig", "train", "main"]}


@pytest.mark.parametrize("module", sorted(TAUGHT))
def test_the_names_the_book_teaches_stay_importable(module):
    import importlib

    mod = importlib.import_module(module)
    assert all(callable(getattr(mod, name)) for name in TAUGHT[module]), module


# The one object that owns a run's layout builds every parallelism's group; core.devices.side_group is
# the one side channel (an async checkpoint's, a debugging wrapper's), over every rank.
GROUP_BUILDERS = {"new_group", "init_device_mesh", "new_subgroups", "new_subgroups_by_enumeration", "DeviceMesh",
                  "_unflatten", "_flatten", "split_group"}


def test_only_the_mesh_builds_process_groups():
    allowed = {LABKIT / "parallel" / "layout" / "mesh.py", LABKIT / "parallel" / "layout" / "mesh_nodes.py",
               LABKIT / "core" / "devices.py"}
    for path in _modules():
        calls = {node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                 for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Call)}
        assert path in allowed or not calls & GROUP_BUILDERS, (path.name, calls & GROUP_BUILDERS)


def _imports_of(path: Path, package: str) -> set[str]:
    """Every labkit module ``path`` imports, at the top, inside functions or for type checking only."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("labkit"):
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("labkit")}
    return {m for m in out if m.startswith(package + ".")}


def test_the_training_package_is_a_dag_even_for_type_only_imports():
    """labkit.train's modules import each other without a cycle, counting the imports made for type
    checking and inside functions too: the strategy records below the config, the plans above both."""
    package = "labkit.train"
    modules = {f"{package}.{p.stem}": p for p in (LABKIT / "train").glob("*.py") if p.stem != "__init__"}
    graph = {m: {d for d in _imports_of(p, package) if d in modules and d != m} for m, p in modules.items()}
    seen, done = set(), set()

    def visit(m, path):
        assert m not in seen or m in done, " -> ".join(path + [m])
        if m in done:
            return
        seen.add(m)
        for d in sorted(graph[m]):
            visit(d, path + [m])
        done.add(m)

    for m in sorted(graph):
        visit(m, [])


def test_no_setup_branches_on_a_strategy_name():
    for path in [*(LABKIT / "train").glob("*.py"), *(LABKIT / "parallel").glob("*.py")]:
        code = path.read_text()
        assert not re.search(r"(spec|strategy|self\.spec)\.name\s*(==|!=|in)", code), path.name
        assert not re.search(r"cfg\.strategy\s*(==|!=|in)", code), path.name


def test_one_layout_record_one_step_one_expert_parallelism():
    """Issue 47: one class named ``Plan`` (the planner's layout; the loop's is a ``Setup``), one
    ``train_step`` (the loop's; DeepSpeed's engine has its ``engine_step``), and expert parallelism
    placed by one implementation (``place_experts``, which the mesh and the tests' reference share)."""
    defined: dict[str, list[str]] = {}
    for path in LABKIT.rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
                defined.setdefault(node.name, []).append(str(path.relative_to(LABKIT)))
    assert defined["Plan"] == ["planning/plan.py"]
    assert defined["train_step"] == ["train/loop.py"]
    assert defined["place_experts"] == ["parallel/experts/placement.py"] and "ExpertParallel" not in defined


def test_one_site_validates_a_run():
    """Issue 47: the loop's layout checks run in labkit.train.validate alone (the planner asks the same
    check_layout of the layouts it ranks, so it never lists one the loop would refuse)."""
    callers = sorted(str(p.relative_to(LABKIT)) for p in LABKIT.rglob("*.py")
                     if p.name != "checks.py" and re.search(r"\bcheck_layout\(", p.read_text()))
    assert callers == ["planning/commands.py", "train/validate.py"], callers


def test_the_training_state_travels_as_one_stateful():
    """Issue 47: what a checkpoint saves of the trained objects is one object with DCP's Stateful protocol,
    for every setup (DeepSpeed's engine included), not five arguments each 'None if engine'."""
    import inspect

    from torch.distributed.checkpoint.stateful import Stateful

    from labkit.fault_tolerance.resume import TrainState, restore, training_state
    from labkit.train.resumable import Resumable

    assert isinstance(TrainState(), Stateful)
    assert list(inspect.signature(Resumable).parameters) == ["cfg", "meta", "train"]
    assert "train" in inspect.signature(training_state).parameters and "train" in inspect.signature(restore).parameters


def test_one_parallelism_config_carries_every_option_a_preset_takes():
    """Issue 47: a run's layout travels as one Parallelism (degrees and implementations), built by the
    preset's expansion alone; placement takes it whole (no Options record copied field by field), and
    every parallel option a preset takes reaches it."""
    import inspect
    from dataclasses import fields

    from labkit.parallel import compose
    from labkit.parallel.layout.parallelism import Parallelism
    from labkit.train.config import TrainConfig
    from labkit.train.strategies import OPTIONS, expand, strategy

    assert not hasattr(compose, "Options")
    assert inspect.signature(compose.place).parameters["par"].annotation in (Parallelism, "Parallelism")
    own = {f.name for f in fields(Parallelism)}
    # what is not the layout's: the emulated link (a DDP comm hook), DeepSpeed's optimizer offload,
    # and the pipeline split's three fields, which travel as one Split
    elsewhere = {"link_gbps", "link_latency_ms", "offload_optimizer", "pp_stages_per_rank",
                 "pp_first_stage_less_layers", "pp_last_stage_less_layers"}
    assert set(OPTIONS) - elsewhere <= own, set(OPTIONS) - elsewhere - own
    changed = dict(tp=2, pp=2, microbatches=8, pp_schedule="interleaved", sequence_parallel=True,
                   reshard_after_forward=False, fsdp_bf16=True, sync_each_microbatch=True, pp_stages_per_rank=2)
    par = expand(strategy("mesh"), TrainConfig(strategy="mesh", **changed))
    assert par == Parallelism(pp=2, dp_shard=-1, tp=2, pp_schedule="interleaved", pp_split=par.pp_split, microbatches=8,
                              sequence_parallel=True, reshard_after_forward=False, fsdp_bf16=True,
                              sync_each_microbatch=True)
    assert par.pp_split.v == 2 and par.resolve(8).degrees.label() == "pp=2 dp_shard=2 tp=2"
    ddp = expand(strategy("ddp"), TrainConfig(strategy="ddp", bucket_cap_mb=5.0, device="cpu"))
    assert (ddp.dp_replicate, ddp.dp_shard, ddp.dp_impl, ddp.bucket_cap_mb) == (-1, 1, "ddp", 5.0)
