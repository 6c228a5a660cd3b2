"""Start the elastic replicas of :mod:`labkit.fault_tolerance.elastic`, kill one, and hold the run
against what the arithmetic says it should have been.

:func:`run_elastic` hosts the :class:`~labkit.fault_tolerance.quorum.Lighthouse`, starts one
``torchrun --nproc-per-node 1 --max-restarts 1`` job per replica (torchrun's agent restarts the
worker that is killed; ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` as in
:mod:`labkit.fault_tolerance.injection`), waits, and reads every worker's log and final state.

The references: :func:`replay` trains one process on exactly the shares each committed step used
(the survivors' rows while a replica was gone, every row otherwise): the losses an elastic run
*should* have, to fp32's rounding (the ranks add in another order). :func:`peer_reference` is the
``"peer"`` run without a fault, on the same ranks and so the same arithmetic: bit for bit.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from labkit.core.checks import non_negative_int, one_of, positive_number
from labkit.core.data import load_corpus
from labkit.fault_tolerance.elastic import POLICIES, Trainer
from labkit.fault_tolerance.injection import kill_tree
from labkit.fault_tolerance.quorum import Lighthouse
from labkit.fault_tolerance.replicas import build, local_backward


def _command(cfg_path: Path, replica: int, port: int, out: Path) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--max-restarts", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", "--monitor-interval", "0.05",
            "--shutdown-timeout", "5", "-m", "labkit.fault_tolerance.elastic", "--config", str(cfg_path),
            "--replica", str(replica), "--port", str(port), "--out", str(out)]


def run_elastic(cfg: dict, policy: str, kill: dict, work_dir: str | os.PathLike, timeout_s: float = 240.0) -> dict:
    """One elastic job: ``cfg["replicas"]`` workers under torchrun, replica ``kill["replica"]``
    SIGKILLed before step ``kill["step"]``; ``cfg["stall"] = {"replica": r, "s": t}`` plants a second
    fault, survivor ``r`` silent for ``t`` seconds when the failure hits. Returns the logs, final
    states and the recovery's times."""
    one_of("policy", policy, POLICIES, "policies")
    non_negative_int("kill step", kill["step"])
    if not 0 <= kill["replica"] < cfg["replicas"] or kill["step"] >= cfg["steps"]:
        raise ValueError(f"kill={kill} must name a replica below {cfg['replicas']} and a step below {cfg['steps']}")
    positive_number("timeout_s", timeout_s)
    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    lighthouse = Lighthouse(timeout_s)
    cfg_path = work / "config.json"
    cfg_path.write_text(json.dumps({**cfg, "policy": policy, "kill": kill, "ckpt_dir": str(work / "ckpt")}))
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "PYTHONWARNINGS": "ignore"}
    t0 = time.monotonic()
    procs = []
    for r in range(cfg["replicas"]):
        with open(work / f"torchrun{r}.out", "w") as out:  # a file: a full pipe would block torchrun
            procs.append(subprocess.Popen(_command(cfg_path, r, lighthouse.port, work), env=env, stdout=out,
                                          stderr=subprocess.STDOUT, start_new_session=True))
    results = [work / f"replica{r}.json" for r in range(cfg["replicas"])]
    try:
        _wait(procs, results, time.monotonic() + timeout_s, work)
    finally:
        for p in procs:
            if p.poll() is None:
                kill_tree(p.pid)
                p.wait()
    if not all(r.exists() for r in results):
        tails = [(work / f"torchrun{r}.out").read_text()[-1500:] for r in range(len(procs))]
        raise RuntimeError(f"elastic workers failed (exit codes {[p.returncode for p in procs]}):\n" + "\n".join(tails))
    store = lighthouse.store
    killed_at = float(store.get("killed_at")) if store.check(["killed_at"]) else None
    logs = [json.loads((work / f"replica{r}.json").read_text()) for r in range(cfg["replicas"])]
    states = [torch.load(work / f"replica{r}.pt", weights_only=True) for r in range(cfg["replicas"])]
    return {"policy": policy, "kill": kill, "killed_at": killed_at, "logs": logs, "states": states,
            "wall_s": time.monotonic() - t0, **recovery(logs, kill, killed_at)}


def _wait(procs: list[subprocess.Popen], results: list[Path], deadline: float, work: Path,
          grace_s: float = 2.0) -> None:
    """Until every torchrun has exited, or every worker has written its result and ``grace_s`` more
    passed (an agent's own teardown, seconds of closing its rendezvous, is not the job's)."""
    done_at = None
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if now > deadline:
            raise TimeoutError(f"the elastic job did not finish in time; see {work}/torchrun*.out")
        if done_at is None and all(r.exists() for r in results):
            done_at = now
        if done_at is not None and now > done_at + grace_s:
            return
        time.sleep(0.05)


def recovery(logs: list[dict], kill: dict, killed_at: float | None) -> dict:
    """The survivor's view (the lowest replica that was neither killed nor left out of the group, so
    trained every step): losses and shares per step, and the seconds from the kill to the failure
    seen, the group re-formed, the replacement started and joined."""
    witness = next(log for log in logs if log["replica"] != kill["replica"]
                   and not any(e["event"] == "joined" for e in log["events"]))
    joiner = next(log for log in logs if log["replica"] == kill["replica"])
    ev = {}
    for e in witness["events"]:  # the first of each; "grown": the growth that let the replacement in
        if e["event"] != "grown" or kill["replica"] in e["members"]:
            ev.setdefault(e["event"], e)
    joined = next(e for e in joiner["events"] if e["event"] == "joined")
    out = {"loss": [s["loss"] for s in witness["steps"]], "shares": [s["shares"] for s in witness["steps"]],
           "degraded_steps": sum(len(s["shares"]) < len(logs) for s in witness["steps"]),
           "rejoined_after_step": ev["grown"]["step"] if "grown" in ev else None,
           "left_out": [log["replica"] for log in logs if any(e["event"] == "left out" for e in log["events"])]}
    if killed_at is not None and "failure" in ev:
        out.update(detect_s=ev["failure"]["time"] - killed_at, regroup_s=ev["regrouped"]["time"] - killed_at,
                   restart_s=joiner["start"] - killed_at, imported_s=joiner["imported"] - killed_at,
                   rejoin_s=joined["time"] - killed_at)
    return out


def replay(cfg: dict, shares: list[list[int]]) -> dict:
    """One process, step ``t`` on exactly the shares ``shares[t]``, each share's mean loss averaged:
    the arithmetic an elastic run's steps stand for. Returns the losses and the final parameters."""
    model, opt = build(cfg, torch.device("cpu"))
    data, losses, threads = load_corpus(), [], torch.get_num_threads()
    # One thread: on cores shared with other processes, OpenMP's threads wait for each other at every
    # op of so small a model (seen here: 20 steps in 13 s on two threads, 1.4 s for 50 on one).
    torch.set_num_threads(1)
    try:
        for step, present in enumerate(shares):
            total = local_backward(model, data, cfg, step, present, torch.device("cpu"))
            for p in model.parameters():
                p.grad /= len(present)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(total.item() / len(present))
    finally:
        torch.set_num_threads(threads)
    return {"loss": losses, "params": {k: v.detach().clone() for k, v in model.named_parameters()}}


def peer_reference(cfg: dict) -> dict:
    """The ``"peer"`` run with nothing killed, on this rank of a :func:`labkit.launch.launch` group:
    its losses and final state, to hold the interrupted run against bit for bit."""
    tr = Trainer(cfg, "peer")
    tr.build()
    rank, members = dist.get_rank(), list(range(dist.get_world_size()))
    losses = [tr.step(step, members, rank) for step in range(cfg["steps"])]
    return {"loss": losses, "state": {k: v.detach().clone() for k, v in tr.tensors().items()}}
