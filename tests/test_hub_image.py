"""The hub image runs the course: its file set, built as the Dockerfile builds it (without Docker),
lists the labs and runs one; without labs/ every entry point says so instead of skipping them."""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "cluster" / "jupyterhub" / "Dockerfile"


def _instructions() -> list[tuple[str, str]]:
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    return [(m[1].upper(), m[2].strip()) for m in re.finditer(r"^\s*([A-Za-z]+)\s+(.*)$", text, re.M)
            if not m[0].lstrip().startswith("#")]


def build_file_set(root: Path, skip: tuple[str, ...] = ()) -> Path:
    """The files the Dockerfile's COPY instructions put in the image, under ``root`` (absolute paths
    in the image become paths under it); returns the image's copy of the project (its WORKDIR)."""
    workdir = Path("/")
    project = None
    for op, arg in _instructions():
        if op == "WORKDIR":
            workdir = workdir / arg
        elif op == "COPY":
            *sources, dest = shlex.split(arg)
            target = root / (workdir / dest).relative_to("/")
            for src in sources:
                if src in skip:
                    continue
                path = ROOT / src
                out = target / path.name if dest.endswith("/") and not path.is_dir() else target
                if path.is_dir():
                    shutil.copytree(path, out, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
                else:
                    out.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy(path, out)
            if (workdir / dest).as_posix().startswith("/opt/"):
                project = root / workdir.relative_to("/")
    assert project is not None, "the Dockerfile copies nothing into /opt"
    return project


def _env(project: Path) -> dict[str, str]:
    # pip install -e . in the image: the project on the path, from any folder; the image's Python
    env = {**os.environ, "PYTHONPATH": str(project), "LABKIT_PYTHON": "python",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop("MPLBACKEND", None)
    return env


def test_the_image_has_what_the_chapters_commands_need():
    steps = dict(_instructions())
    assert re.search(r"apt-get install .*\bmake\b", " ".join(a for o, a in _instructions() if o == "RUN"))
    assert "LABKIT_PYTHON=python3" in steps["ENV"]


@pytest.fixture(scope="module")
def image(tmp_path_factory) -> Path:
    return build_file_set(tmp_path_factory.mktemp("image"))


def test_the_image_lists_every_lab_and_runs_one_from_a_home_folder(image, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    proc = subprocess.run([sys.executable, "-m", "labkit", "list"], cwd=home, env=_env(image),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.split() == sorted(p.stem for p in (ROOT / "labs").glob("*.md"))
    # the packing lab runs bench/ from the image's copy (the lab the issue found failing)
    proc = subprocess.run([sys.executable, "-m", "labkit", "run", "packing", "--profile", "ci", "--as-script",
                           "--out", str(tmp_path / "out")], cwd=home, env=_env(image), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert (tmp_path / "out" / "packing.metrics.json").is_file()
    # make runs with the image's Python: no .venv is made
    proc = subprocess.run(["make", "-n", "--no-print-directory", "assignments"], cwd=image, env=_env(image),
                          capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == "python -m labkit.labs.assignments", proc.stdout


def test_without_labs_every_entry_point_says_so(tmp_path):
    image = build_file_set(tmp_path, skip=("labs",))
    env = _env(image)
    for argv in (["-m", "labkit", "list"], ["-m", "labkit", "run", "--profile", "ci"],
                 ["-m", "labkit.gpu_check", "--device", "cpu", "--only", "labs"]):
        proc = subprocess.run([sys.executable, *argv], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode != 0 and "no labs in" in proc.stderr and "Traceback" not in proc.stderr, \
            (argv, proc.returncode, proc.stderr[-2000:])


def test_every_home_gets_the_labs_in_student_form_and_keeps_a_students_work(image, tmp_path):
    """The image writes the student form (its RUN step) and each server's postStart copies it into the
    home (values.yaml), never over a lab the student has worked on."""
    import yaml

    (run,) = [a for o, a in _instructions() if o == "RUN" and "labkit.labs.student_labs" in a]
    folder = re.search(r"python -m labkit\.labs\.student_labs (\S+)", run)[1]
    out = tmp_path / folder.lstrip("/")
    proc = subprocess.run([sys.executable, "-m", "labkit.labs.student_labs", str(out)], cwd=tmp_path,
                          env=_env(image), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    home = tmp_path / "home"
    (home / "labs").mkdir(parents=True)
    (home / "labs" / "memory.ipynb").write_text("a student's work")
    values = yaml.safe_load((ROOT / "cluster" / "jupyterhub" / "values.yaml").read_text())
    shell, flag, hook = values["singleuser"]["lifecycleHooks"]["postStart"]["exec"]["command"]
    proc = subprocess.run([shell, flag, hook.replace(folder, str(out))], env={**os.environ, "HOME": str(home)},
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert (home / "labs" / "memory.ipynb").read_text() == "a student's work"
    labs = sorted((home / "labs").glob("*.ipynb"))
    assert [p.stem for p in labs] == sorted(p.stem for p in (ROOT / "labs").glob("*.md"))
    assert (image.parents[1] / "etc/labkit/jupyter/student/labconfig/page_config.json").is_file()
    for p in (p for p in labs if p.stem != "memory"):
        text = p.read_text()
        assert "YOUR CODE HERE" in text and "BEGIN SOLUTION" not in text and "HIDDEN TESTS" not in text, p.name
