"""Every command README, the chapters, the runbook and cluster/README show is run as written.

Commands are harvested from the documents (code blocks, and inline code that starts like a
command) and each must match one rule of :data:`RULES`, which says how it is tested here:

* ``run``: as written, from the repository root with the project's Python first on PATH;
* ``gpu``: needs GPUs. On this machine it must stop at once with exit status 2 and one line naming
  the GPUs; ``train-flags`` commands are parsed by ``labkit.train``'s own parser as torchrun's ranks
  would parse them (8 GPUs pretended), so a renamed or removed flag fails here;
* ``help``: a template (``LAB``, ``...``, ``K``): its entry point's ``--help`` must run and name each
  flag the template uses;
* ``papermill-path``: README's jupytext-then-papermill commands, run in order;
* ``torchrun-flag``: a flag of torchrun's own, named in prose: its ``--help`` must name it;
* ``dry``: a ``make`` target that starts a server or runs the suite: ``make -n`` must expand it;
* ``elsewhere``: the named test runs it (Slurm scripts through a fake ``sbatch`` environment, the
  image's file set, torchrun.sh's runs).

A new command in a document with no rule fails :func:`test_every_documented_command_has_a_rule`.
"""
from __future__ import annotations

import functools
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", ROOT / "cluster" / "README.md", *sorted((ROOT / "book").glob("*.md"))]
COMMAND = re.compile(r"(python -m labkit|make [a-z]|bash cluster/|torchrun |sbatch |kubectl |helm |docker |"
                     r"NPROC=|papermill |jupytext )")
# (pattern on the command, how it is tested)
RULES: list[tuple[str, str]] = [
    (r"make (book|test)$", "elsewhere: .ci/run runs make test, whose test_book builds the book"),
    (r"make book HUB_URL=https://\S+$", "dry"),  # test_book builds the book for a hub, as this does
    (r"make (lab-ui|serve|assignments|venv)( LAB_UI_OPTS=.*)?$", "dry"),
    (r"make hub( HUB_OPTS=.*)?$", "dry"),
    (r"python -m labkit\.course\.hub (add|serve)\b", "help"),  # as root it makes users: tests/test_hub.py runs them
    (r"(jupytext|papermill) ", "papermill-path"),
    (r"make lab LAB=\w+ PROFILE=(cpu|ci)$", "dry"),
    (r"make lab LAB=\w+ PROFILE=gpu$", "gpu"),
    (r"make gpu-check", "dry"),
    (r"(NPROC=\S+ )?(STRATEGY=\S+ )?(STEPS=\S+ )?bash cluster/torchrun\.sh", "elsewhere: test_train runs torchrun.sh"),
    (r"torchrun .*-m labkit\.train", "train-flags"),
    (r"sbatch ", "elsewhere: test_cluster_files runs the Slurm scripts under a fake sbatch environment"),
    (r"(kubectl|helm) ", "elsewhere: test_cluster_files renders the manifests and values"),
    (r"docker (build|push)", "elsewhere: test_hub_image builds the image's file set as the Dockerfile does"),
    (r"torchrun --[a-z-]+(=\S+)?$", "torchrun-flag"),
    (r"python -m labkit\.launch\.torchrun \.\.\. -m labkit\.train$",  # the runbook on the Kubernetes job
     "elsewhere: test_cluster_files runs the job's script, its torchrun line with a stub python"),
    (r"torchrun --nproc-per-node 1 --max-restarts 1$",  # the chapter describing how each replica starts
     "elsewhere: test_failures_at_scale runs labkit.fault_tolerance.elastic_launch, which starts each so"),
    (r"python -m labkit run \S+ --profile gpu", "gpu"),
    (r"python -m labkit\.gpu_check --gpus", "gpu"),
    (r"make (compare|baseline)$", "dry"),
    (r"python -m labkit compare book/labs$", "elsewhere: test_labs holds every CI run's labs against the baseline"),
    (r"python -m labkit compare .*SITE_BASELINE", "help"),
    (r"python -m labkit(\.\w+)?$", "help"),  # the entry point named in prose
    (r"python -m labkit\.planning (memory|layouts)$", "help"),  # a subcommand named in prose
    (r"python -m labkit\.train (?!--help$|--list-strategies$)", "help"),  # its flags named in prose
    (r"python -m labkit\.course\.assignments", "help"),
    (r"python -m labkit\.course\.student_labs$", "help"),
    (r"python -m labkit(\.\w+)? .*(\.\.\.|\bLAB\b|\bPROFILE\b|\bK\b|\{|\]|\"$|OUT\b|N\b)", "help"),
    (r"python -m labkit(\.\w+)?( .*)?$", "run"),
]


def _commands() -> dict[str, str]:
    """Each command the documents show, joined across backslash continuations, and where it is."""
    out: dict[str, str] = {}
    for doc in DOCS:
        text = doc.read_text()
        spans = [ln for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S)
                 for ln in block.replace("\\\n", " ").splitlines()]
        spans += [m.replace("\n", " ") for m in re.findall(r"(?<!`)`([^`]+)`(?!`)", re.sub(r"```.*?```", "", text,
                                                                                      flags=re.S))]
        for span in spans:
            line = re.sub(r"\s+", " ", span.strip().removeprefix("$ ").split("  #")[0].split(" # ")[0]).strip()
            line = re.sub(r"^(\.venv/bin/)?python3? ", "python ", line)  # the venv's Python is on PATH here
            line = re.sub(r"^\.venv/bin/(jupytext|papermill) ", r"\1 ", line)
            if COMMAND.match(line):
                out.setdefault(line, doc.relative_to(ROOT).as_posix())
    return out


def _rule(command: str) -> str | None:
    return next((how for pattern, how in RULES if re.match(pattern, command)), None)


COMMANDS = _commands()


def test_every_documented_command_has_a_rule():
    assert len(COMMANDS) > 30
    missing = {c: where for c, where in COMMANDS.items() if _rule(c) is None}
    assert not missing, f"documented commands with no test rule (add one to RULES): {missing}"


def _env() -> dict[str, str]:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "CUDA_VISIBLE_DEVICES": ""}
    env.pop("MPLBACKEND", None)
    return env


def _start() -> str:
    """What README says a new shell starts with ("Your shell"): the line that activates ``.venv``."""
    (line,) = re.findall(r"^source \S*activate$", (ROOT / "README.md").read_text(), re.M)
    return line


def _fresh_env() -> dict[str, str]:
    """A new login shell's environment: nothing of this process's (its PATH, its virtualenv)."""
    keep = {k: os.environ[k] for k in ("HOME", "USER", "LOGNAME", "LANG", "TMPDIR") if k in os.environ}
    return {**keep, "TERM": "dumb", "CUDA_VISIBLE_DEVICES": ""}  # no GPU here: the gpu rule's commands stop


def _shell(command: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """``command`` as a reader types it: a fresh ``bash -l`` in the repository root, started as README says."""
    return subprocess.run(["bash", "-l", "-c", f"{_start()} && {command}"], cwd=ROOT, env=_fresh_env(),
                          capture_output=True, text=True, timeout=timeout)


def _of(kind: str) -> list[str]:
    return sorted(c for c in COMMANDS if _rule(c) == kind)


@pytest.mark.parametrize("command", _of("run"))
def test_commands_run_as_written(command):
    proc = _shell(command)
    assert proc.returncode == 0, f"{command} ({COMMANDS[command]}):\n{proc.stderr[-2000:]}"


@pytest.mark.parametrize("command", _of("gpu"))
def test_gpu_commands_stop_at_once_here_with_one_line(command):
    proc = _shell(command, timeout=60)
    assert proc.returncode == 2, f"{command}: {proc.returncode}\n{proc.stderr[-2000:]}"
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and not ln.startswith("make")]
    assert len(lines) == 1 and "GPU" in lines[0], proc.stderr


def test_the_papermill_path_runs_as_documented():
    steps = _of("papermill-path")
    steps.sort(key=list(COMMANDS).index)  # in the order the document gives them
    assert [c.split()[0] for c in steps] == ["jupytext", "papermill"]
    metrics = ROOT / "_build" / "strategy_cost.metrics.json"
    metrics.unlink(missing_ok=True)
    for command in steps:
        proc = _shell(command)
        assert proc.returncode == 0, f"{command}:\n{proc.stderr[-2000:]}"
    assert json.loads(metrics.read_text())["params"]["target_days"] == 60  # the override reached the lab


@functools.lru_cache(maxsize=None)
def _help(module: str) -> str:
    proc = _shell(f"python -m {module} --help", timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.parametrize("command", _of("help"))
def test_templates_name_an_entry_point_and_flags_that_exist(command):
    words = shlex.split(command.replace("...", " ").replace("{", " ").replace("}", " ").replace("]", " "))
    module = words[2]  # `python -m labkit run ...`: the subcommand's own --help names its flags
    sub = len(words) > 3 and words[3].isalpha() and module in ("labkit", "labkit.course.hub", "labkit.planning")
    text = _help(f"{module} {words[3]}" if sub else module)
    flags = {w.split("=")[0] for w in words if w.startswith("--")}
    absent = [f for f in flags if f not in text]
    assert not absent, f"{command}: {module} --help does not name {absent}"


@pytest.mark.parametrize("command", _of("torchrun-flag"))
def test_torchrun_flags_the_chapters_name_exist(command):
    flag = command.split()[1].split("=")[0]
    assert flag in _help("torch.distributed.run"), f"{command} ({COMMANDS[command]})"


@pytest.mark.parametrize("command", _of("dry"))
def test_make_targets_expand(command):
    proc = _shell(command.replace("make ", "make -n ", 1), timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip(), proc.stderr


@pytest.mark.parametrize("command", _of("train-flags"))
def test_torchrun_commands_parse_as_their_ranks_would(command, monkeypatch, tmp_path):
    from labkit.core import devices
    from labkit.train import cli

    argv = [w for w in shlex.split(command) if w != "..."]
    argv = argv[argv.index("labkit.train") + 1:]
    monkeypatch.setattr(devices, "cuda_count", lambda: 8)
    monkeypatch.chdir(tmp_path)  # the parser probes its output paths (ckpt/run1/...): not in the checkout
    ranks = re.search(r"--nproc-per-node (\d+)", command)
    monkeypatch.setenv("WORLD_SIZE", ranks[1] if ranks else "8")
    cfg, _ = cli.configs_from(argv)
    assert cfg.steps > 0


def test_lab_ui_starts_as_root_and_takes_options(tmp_path):
    """``make lab-ui`` as README shows it, with LAB_UI_OPTS: Jupyter refuses root without --allow-root."""
    import time
    import urllib.request

    from labkit.core.ports import listen_port

    port = listen_port()
    opts = f"--no-browser --port {port} --ServerApp.ip=127.0.0.1 --IdentityProvider.token=''"
    proc = subprocess.Popen(["make", "lab-ui", f"LAB_UI_OPTS={opts}"], cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline, answered = time.monotonic() + 120, False
        while time.monotonic() < deadline and proc.poll() is None and not answered:
            try:
                answered = urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status", timeout=2).status == 200
            except OSError:
                time.sleep(0.5)
        assert answered, proc.stderr.read()[-2000:] if proc.poll() is not None else "no answer in 120 s"
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=30)
