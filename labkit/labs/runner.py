"""The lab runner: execute lab notebooks with papermill under a named profile.

Labs live in ``labs/`` as MyST-markdown notebooks (jupytext) with a papermill ``parameters`` cell.
A *profile* scales a lab to where it runs: ``cpu`` (the parameters cell's defaults: a 2-core laptop),
``ci`` (smaller still, for the regression runs) and ``gpu`` (a real cluster-size run, one GPU per
rank). ``python -m labkit run [LAB ...] --profile ci`` executes labs into ``book/labs/``, where the
book picks them up; a lab re-runs only when its source, labkit or the profile changed.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from unittest.mock import patch

from labkit.core import progress
from labkit.core.checks import brief_path
from labkit.labs.parameters import resolve
from labkit.labs.profiles import PROFILES

ROOT = Path(__file__).resolve().parent.parent.parent
LABS_DIR = ROOT / "labs"
OUT_DIR = ROOT / "book" / "labs"


def list_labs(labs_dir: Path = LABS_DIR) -> list[str]:
    """The labs in ``labs_dir``; a ValueError when it holds none (labkit installed without the
    course's ``labs/`` folder beside it: every lab would be silently missing)."""
    labs = sorted(p.stem for p in labs_dir.glob("*.md"))
    if not labs:
        raise ValueError(f"no labs in {labs_dir}: labkit is installed without the course's labs/ folder beside it "
                         "(a checkout of the repository has it; an image must copy labs/ and bench/)")
    return labs


def check_lab(name: str, profile: str, labs_dir: Path = LABS_DIR, gpus: int | None = None,
              overrides: dict | None = None) -> None:
    """A ValueError naming what exists when ``name`` is not a lab, ``profile`` not one of its profiles
    or an override not one of its parameters."""
    labs = list_labs(labs_dir)
    if name not in labs:  # asked of the list, not the filesystem: a 5,000-character name is no OSError
        raise ValueError(f"LAB={brief_path(name)} does not exist; valid labs: {labs}")
    resolve(name, profile, gpus=gpus, **(overrides or {}))  # fail fast, before a kernel starts


def _fingerprint(lab_path: Path, profile: str) -> str:
    h = hashlib.sha256(profile.encode())
    for f in [lab_path, *sorted((ROOT / "labkit").rglob("*.py")), ROOT / "requirements.txt"]:
        if f.exists():
            h.update(f.read_bytes())
    return h.hexdigest()


def _execute_notebook(name: str, src: Path, out_nb: Path, parameters: dict) -> None:
    import jupytext
    import papermill as pm

    LocalSocketKernelManager = _local_socket_manager()
    def execute() -> None:
        # The kernel inherits this environment: an executed notebook (a page of the book) keeps no bars.
        with patch.dict(os.environ, {progress.ENV: "0", **pinned_threads(parameters["PROFILE"])}):
            pm.execute_notebook(
                jupytext.read(src), str(out_nb), kernel_name=_kernel_name(), cwd=str(out_nb.parent),
                parameters=parameters, progress_bar=sys.stdout.isatty(), log_output=False,
                request_save_on_cell_execute=False, kernel_manager_class=LocalSocketKernelManager,
            )

    try:
        execute()
    except pm.PapermillExecutionError as e:
        raise RuntimeError(
            f"lab {name!r} failed in cell {e.exec_count} ({e.ename}: {e.evalue}); "
            f"the partly executed notebook is at {out_nb}"
        ) from None


def _local_socket_manager():
    """jupyter_client's AsyncKernelManager on unix sockets in a private folder (ZeroMQ ``ipc``): no
    TCP port for the kernel to lose to another process between the client's pick and its bind, and
    no plain-text TCP, of which ipykernel warns at every start."""
    import shutil
    import tempfile

    from jupyter_client.manager import AsyncKernelManager

    class Manager(AsyncKernelManager):
        async def _async_pre_start_kernel(self, **kw):
            self._box = tempfile.mkdtemp(prefix="labkit-kernel-")
            self.transport, self.ip = "ipc", os.path.join(self._box, "kernel")
            return await super()._async_pre_start_kernel(**kw)

        async def _async_interrupt_kernel(self) -> None:
            # jupyter_client interrupts before it asks an idle kernel to shut down, and ipykernel
            # then logs "KeyboardInterrupt caught in kernel" into a run that went well (issue 44)
            if not self.shutting_down:
                await super()._async_interrupt_kernel()

        async def _async_cleanup_resources(self, restart: bool = False) -> None:
            await super()._async_cleanup_resources(restart=restart)
            if not restart:
                shutil.rmtree(getattr(self, "_box", ""), ignore_errors=True)

    return Manager


def pinned_threads(profile: str) -> dict[str, str]:
    """The environment a lab runs in under ``profile``: the ``ci`` profile, the regression runs'
    (:mod:`labkit.labs.compare`), gives the kernel and every rank one thread, so that its losses
    add up in the same order on any host and can be held exactly against the baseline."""
    from labkit.core.devices import THREADS_ENV

    return {"OMP_NUM_THREADS": "1", THREADS_ENV: "1"} if profile == "ci" else {}


def _kernel_name() -> str:
    from jupyter_client.kernelspec import KernelSpecManager

    return "labkit" if "labkit" in KernelSpecManager().find_kernel_specs() else "python3"


def run_lab(name: str, profile: str, out_dir: Path = OUT_DIR, force: bool = False,
            labs_dir: Path = LABS_DIR, overrides: dict | None = None, as_script: bool = False,
            gpus: int | None = None, quiet: bool = False) -> Path:
    """Execute one lab; return the path of its metrics JSON. Skips the run when nothing changed.

    ``overrides`` and ``gpus`` become the lab's ``OVERRIDES`` and ``GPUS`` parameters; ``as_script``
    runs its cells without Jupyter (:mod:`labkit.labs.script`), for machines without papermill, its
    output in ``<lab>.log`` (and on the terminal unless ``quiet``)."""
    check_lab(name, profile, labs_dir, gpus, overrides)
    src = labs_dir / f"{name}.md"
    out_dir.mkdir(parents=True, exist_ok=True)
    out_nb, metrics = out_dir / f"{name}.ipynb", out_dir / f"{name}.metrics.json"
    stamp = out_dir / f".{name}.fingerprint"
    parameters: dict = {"PROFILE": profile, "METRICS_PATH": metrics.name}
    if overrides:
        parameters["OVERRIDES"] = dict(overrides)
    if gpus is not None:
        parameters["GPUS"] = gpus
    key = _fingerprint(src, profile if len(parameters) == 2 else repr(sorted(parameters.items())))
    key += "-script" if as_script else ""
    if not force and metrics.exists() and stamp.exists() and stamp.read_text() == key and (as_script or out_nb.exists()):
        print(f"[labs] {name}: up to date ({profile}), not re-run")
        return metrics
    stamp.unlink(missing_ok=True)
    metrics.unlink(missing_ok=True)
    how = " as a script" if as_script else ""
    base = PROFILES.get(name, {}).get(profile, {})
    changed = "".join(f", {k}={v!r} (the profile's: {base.get(k)!r})" for k, v in (overrides or {}).items())
    print(f"[labs] {name}: executing{how} with PROFILE={profile!r}{changed} ...", flush=True)
    t0 = time.perf_counter()
    if as_script:
        import torch

        from labkit.labs.script import run_script

        threads = torch.get_num_threads()
        with patch.dict(os.environ, pinned_threads(profile)):  # as in a kernel: this process is the kernel
            torch.set_num_threads(1 if pinned_threads(profile) else threads)
            try:
                run_script(src, out_dir, parameters, quiet)
            finally:
                torch.set_num_threads(threads)
    else:
        _execute_notebook(name, src, out_nb, parameters)
    if not metrics.exists():
        raise RuntimeError(f"lab {name!r} ran but wrote no metrics file {metrics}")
    stamp.write_text(key)
    print(f"[labs] {name}: done in {time.perf_counter() - t0:.0f} s -> {metrics if as_script else out_nb}")
    return metrics


def run_labs(names: list[str], profile: str, out_dir: Path = OUT_DIR, jobs: int = 1, force: bool = False,
             overrides: dict | None = None, as_script: bool = False, gpus: int | None = None) -> list[Path]:
    """:func:`run_lab` for every lab in ``names``; the paths of their metrics JSON, in order.

    ``jobs`` > 1 runs that many labs side by side, each in its own Python process (its output in
    ``<lab>.run.log``): a lab's ranks rarely keep two cores busy, so two labs at once finish the set
    sooner on a CPU. Timings measured then share the cores with the other lab. A ``gpu`` profile
    runs one lab at a time: every lab takes every GPU."""
    if jobs < 1 or (jobs > 1 and profile == "gpu"):
        raise ValueError(f"--jobs {jobs}: give 1 or more, and 1 for the gpu profile (each lab uses every GPU)")
    if jobs == 1:
        return [run_lab(n, profile, out_dir, force, overrides=overrides, as_script=as_script, gpus=gpus)
                for n in names]
    out_dir.mkdir(parents=True, exist_ok=True)

    def apart(name: str) -> Path:
        cmd = [sys.executable, "-m", "labkit", "run", name, "--profile", profile, "--out", str(out_dir)]
        cmd += ["--force"] * force + ["--as-script"] * as_script + (["--gpus", str(gpus)] if gpus else [])
        for key, value in (overrides or {}).items():
            cmd += ["-p", key, json.dumps(value)]
        log = out_dir / f"{name}.run.log"
        with open(log, "w") as f:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT).returncode
        lines = log.read_text().splitlines()
        print("\n".join(line for line in lines if line.startswith("[labs]")), flush=True)
        if rc != 0:
            tail = "\n".join(lines[-15:])
            raise RuntimeError(f"lab {name!r} failed (exit {rc}); the end of {log}:\n{tail}")
        return out_dir / f"{name}.metrics.json"

    with ThreadPoolExecutor(jobs) as pool:
        return list(pool.map(apart, names))
