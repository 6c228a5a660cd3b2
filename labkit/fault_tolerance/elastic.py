"""Training through a lost replica: one worker of a job whose replicas come and go.

Each replica runs as its own ``torchrun --nproc-per-node 1 --max-restarts 1`` job (torchft runs one
per replica group the same way): torchrun's agent restarts a worker that dies, and the workers meet
in a :class:`labkit.fault_tolerance.quorum.Lighthouse` store to form their process group. A
collective that fails tells the survivors a replica is gone; they form a smaller group and, by
``policy``:

* ``"shrink"``: go on at once with their own shares: a global batch of ``survivors / replicas`` of
  the rows (torchft's fault-tolerant DDP averages over the replicas that took part);
* ``"cover"``: go on at once, the lost replica's share computed by a survivor as one more
  accumulation micro-batch: the global batch, and so the arithmetic, of an uninterrupted run;
* ``"peer"``: wait for the replacement: the optimizer state is sharded (ZeRO-1,
  :class:`labkit.parallel.zero_scratch.ZeroOneAdamW`), so no survivor holds the lost rank's Adam
  moments; its in-memory snapshot, kept by a peer (:mod:`labkit.fault_tolerance.peer_checkpoint`),
  is restored, and the run continues bit for bit. Each step is also saved to disk with
  :class:`labkit.fault_tolerance.Checkpointer`, to time the two restores side by side.

When the replacement asks to join, the members let it in at the next step boundary and a healthy
member sends it the state (torchft's live recovery). ``python -m labkit.fault_tolerance.elastic
--config C --replica R --port P --out O`` is one worker; :mod:`.elastic_launch` starts the job.
"""
from __future__ import annotations

import time

T_START = time.time()  # the process's start: how long a replacement takes to exist, import and join

import argparse  # noqa: E402 - after the clock, which must not count the imports
import gc  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from labkit.core.data import load_corpus  # noqa: E402
from labkit.core.devices import share_cores  # noqa: E402
from labkit.fault_tolerance.peer_checkpoint import PeerSnapshot  # noqa: E402
from labkit.fault_tolerance.quorum import Quorum  # noqa: E402
from labkit.fault_tolerance.replicas import all_reduce_grads, build, local_backward  # noqa: E402

POLICIES = ("shrink", "cover", "peer")


def shares_of(policy: str, members: list[int], replica: int, replicas: int) -> list[int]:
    """The shares of the global batch ``replica`` computes: its own, and under ``"cover"`` the lost
    replicas' shares dealt round-robin to the members."""
    mine = [replica]
    if policy == "cover":
        lost = sorted(set(range(replicas)) - set(members))
        mine += [s for i, s in enumerate(lost) if members[i % len(members)] == replica]
    return mine


class Trainer:
    """The model, optimizer and step of one ``policy`` on the current group."""

    def __init__(self, cfg: dict, policy: str) -> None:
        self.cfg, self.policy, self.data = cfg, policy, load_corpus()
        self.device = torch.device("cpu")  # gloo: see labkit.fault_tolerance.quorum
        self.model = self.opt = None

    def build(self) -> None:
        """A fresh model and optimizer on the current group (ZeRO-1's constructor is a collective)."""
        from labkit.parallel.zero_scratch import ZeroOneAdamW

        self.model, self.opt = build(self.cfg, self.device)
        if self.policy == "peer":
            self.opt = ZeroOneAdamW(self.model, lr=self.cfg["lr"], betas=(0.9, 0.95), weight_decay=0.0)

    def tensors(self) -> dict[str, torch.Tensor]:
        """What a snapshot or a live recovery moves: ZeRO-1's flat parameters and this rank's Adam
        slice, or the replicated parameters and Adam state (created empty when no step ran yet)."""
        if self.policy == "peer":
            params = {"flat": self.opt.flat}
            owners = [(self.opt.shard, "slice")]
            state = self.opt.inner.state
        else:
            params = dict(self.model.named_parameters())
            owners = [(p, n) for n, p in self.model.named_parameters()]
            state = self.opt.state
        out = dict(params)
        for p, name in owners:
            if not state.get(p):  # AdamW creates it at the first step; a restore needs it now
                state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                            "exp_avg_sq": torch.zeros_like(p)}
            out.update({f"{k}.{name}": v for k, v in state[p].items()})
        return out

    def step(self, step: int, members: list[int], replica: int) -> float:
        """One training step of this member; the mean loss over the shares the members computed."""
        replicas = self.cfg["replicas"]
        shares = shares_of(self.policy, members, replica, replicas)
        loss = local_backward(self.model, self.data, self.cfg, step, shares, self.device)
        n = replicas if self.policy == "cover" else len(members)
        if self.policy == "peer":
            self.opt.step()  # reduce-scatter, Adam on this rank's slice, all-gather
        else:
            all_reduce_grads(self.model, n)
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        dist.all_reduce(loss)
        return loss.item() / n


def _live_recovery(tr: Trainer, step: int, holds: bool = True) -> int:
    """Every member takes the state and step of the lowest rank that ``holds`` them (replicas hold the
    same; a joiner holds nothing, and may be rank 0: a replaced or left-out replica 0)."""
    flags = torch.zeros(dist.get_world_size(), dtype=torch.int32)
    flags[dist.get_rank()] = int(holds)
    dist.all_reduce(flags)
    src = int(flags.nonzero()[0])
    for t in tr.tensors().values():
        dist.broadcast(t, src=src)
    s = torch.tensor([step])
    dist.broadcast(s, src=src)
    return int(s)


def _peer_recovery(tr: Trainer, snap: PeerSnapshot, ck, log: dict) -> int:
    """Rebuild on the whole group and restore every rank's snapshot (a replaced rank's from its peer);
    time the same state read back from the disk checkpoint beside it. Returns the step restored."""
    tr.build()
    tensors = tr.tensors()
    steps = [None] * dist.get_world_size()
    dist.all_gather_object(steps, snap.step)
    if all(s is None for s in steps):  # lost before the first snapshot: every rank starts over from the seed
        return 0
    replaced = [r for r, s in enumerate(steps) if s is None]
    step = max(s for s in steps if s is not None)
    log["peer_restore_s"] = snap.restore(tensors, replaced)
    if replaced:
        t0 = time.perf_counter()
        disk_step, disk = ck.load_latest()
        log["disk_restore_s"] = time.perf_counter() - t0
        log["disk_equals_peer"] = disk_step == step and torch.equal(disk["local"]["own"], snap.own)
    snap.step = step
    return step


def _fail(q: Quorum, failure: str, step: int, log: dict) -> bool:
    """A collective failed: drop the group, form the next generation with whoever is left. False when
    this worker was left out (its heartbeat looked stale to the others, on starved cores): it then
    joins as a replacement does, as torchft's replicas do when they miss a quorum."""
    log["events"].append({"event": "failure", "step": step, "time": time.time(), "error": failure})
    q.leave()
    gc.collect()  # nothing may keep the old group's connections open
    members = q.form(q.gen + 1, q.members, everyone=False)  # the lost one has stopped beating
    log["events"].append({"event": "regrouped" if members else "left out", "members": members, "step": step,
                          "time": time.time()})
    return members is not None


def _grow(q: Quorum, tr: Trainer, snap: PeerSnapshot, ck, step: int, log: dict, joiners: list[int] | None):
    """Form the next generation with the joiners (a member's side, or a joiner's with None), then
    recover: the peer snapshots under ``"peer"``, rank 0's state otherwise. Returns (step, checkpointer)."""
    from labkit.fault_tolerance import Checkpointer

    if joiners is None:
        q.join()
    else:
        q.grow(joiners)
    log["events"].append({"event": "joined" if joiners is None else "grown", "members": q.members,
                          "step": step, "time": time.time()})
    if tr.policy != "peer":
        if joiners is None:
            tr.build()
        return _live_recovery(tr, step, holds=joiners is not None), ck
    ck = Checkpointer(tr.cfg["ckpt_dir"], keep_last=2)  # a collective: its own group, on the new one
    return _peer_recovery(tr, snap, ck, log), ck


def run(cfg: dict, replica: int, port: int, out: str) -> dict:
    """One worker, from its first start or its restart by torchrun, to the last step; its log."""
    policy, replicas, kill = cfg["policy"], cfg["replicas"], cfg.get("kill") or {}
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    log = {"replica": replica, "restart": restart, "start": T_START, "imported": time.time(), "events": [],
           "steps": [], "snapshot_s": [], "disk_save_s": []}
    share_cores(replicas)
    # 10 s for a collective: a survivor stuck in the dead group's raises after it and comes to regroup
    q = Quorum(port, replica, replicas, cfg["timeout_s"], cfg.get("collective_s", 10.0), cfg["stale_s"])
    tr, snap = Trainer(cfg, policy), PeerSnapshot()
    ck, step = None, 0
    # shrink: a re-formed group trains one step on its own before it lets a replacement in, so a lost
    # replica always costs at least one degraded step, however fast torchrun restarts it (without this,
    # a replacement that asked before the survivors' first step joined at once: a race, seen in CI)
    stepped = True
    if restart:
        step, ck = _grow(q, tr, snap, ck, 0, log, None)
    else:
        q.form(0, list(range(replicas)))
        tr.build()
        if policy == "peer":
            from labkit.fault_tolerance import Checkpointer

            ck = Checkpointer(cfg["ckpt_dir"], keep_last=2)
    while step < cfg["steps"] or len(q.members) < replicas:
        try:
            joiners = q.joiners() if policy != "shrink" or stepped or step >= cfg["steps"] else []
            if joiners:
                step, ck = _grow(q, tr, snap, ck, step, log, joiners)
                continue
            if len(q.members) < replicas and (policy == "peer" or step >= cfg["steps"]):
                time.sleep(0.02)  # nothing to train on without the lost shard: wait for the replacement
                continue
            if replica == kill.get("replica") and not restart and step == kill.get("step"):
                q.store.set("killed_at", repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)  # no warning, no cleanup: a GPU falling off the bus
            t0 = time.perf_counter()
            loss = tr.step(step, q.members, replica)
            step, stepped = step + 1, True
            # a floor under the step time: a real model's step outlasts a replacement's start-up
            time.sleep(max(0.0, cfg.get("min_step_s", 0.0) - (time.perf_counter() - t0)))
            shares = list(range(replicas)) if policy != "shrink" else q.members
            log["steps"].append({"step": step, "loss": loss, "shares": shares, "time": time.time()})
            if policy == "peer":
                log["snapshot_s"].append(snap.take(step, tr.tensors()))
                log["disk_save_s"].append(ck.save(step, {"local": {"own": snap.own}}).blocking_s)
        except RuntimeError as e:  # a peer is gone (gloo: the connection closed)
            failure = str(e)[:200]
        else:
            continue
        # Out of the except block: its traceback holds the failed collective's work, and with it the
        # group's sockets; freed, the other survivors' collectives fail now instead of at the timeout.
        if ck is not None:
            _close_quietly(ck)
            ck = None
        if replica == cfg.get("stall", {}).get("replica"):
            q.stall(cfg["stall"]["s"])
        if not _fail(q, failure, step, log):
            step, ck = _grow(q, tr, snap, ck, step, log, None)
            continue
        stepped = False
        if policy != "peer":
            tr.opt.zero_grad(set_to_none=True)
            step = _live_recovery(tr, step)  # survivors agree on one state, whoever stepped
    if ck is not None:
        ck.close()
    torch.save({k: v.detach().clone() for k, v in tr.tensors().items()}, f"{out}/replica{replica}.pt")
    log["end"] = time.time()
    with open(f"{out}/.replica{replica}.json", "w") as f:  # renamed into place: the launcher polls for it
        json.dump(log, f)
    os.replace(f"{out}/.replica{replica}.json", f"{out}/replica{replica}.json")
    q.leave()
    return log


def _close_quietly(ck) -> None:
    try:
        ck.close()
    except Exception:  # noqa: BLE001 - its group went with the lost peer; the lock is what matters
        if ck.lock is not None:
            ck.lock.release()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="One worker of labkit's elastic replicas (started by elastic_launch).")
    ap.add_argument("--config", required=True)
    ap.add_argument("--replica", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    with open(args.config) as f:
        run(json.load(f), args.replica, args.port, args.out)


if __name__ == "__main__":
    main()
