"""Data-parallel replicas written out, so that faults can be put between their parts.

A step of data parallelism is: each replica's forward and backward on its *shares* of the global
batch (one share per replica normally; :mod:`labkit.fault_tolerance.elastic` hands a lost replica's
share to the survivors), one all-reduce of the summed gradients divided by the number of shares,
and the same AdamW step everywhere (Li et al. 2020, PyTorch DDP, without its buckets). The global
batch of ``batch_size`` rows is cut into ``replicas`` shares by :func:`labkit.core.data.get_batch`,
so share ``s`` of step ``t`` is the same rows whoever computes it.

:func:`replica_phases` runs that loop on every rank (under :func:`labkit.launch.launch`) with faults
put in on purpose: a bit flipped before the all-reduce, after it, in a parameter or in an Adam moment
(:func:`labkit.fault_tolerance.sdc.flip_bit`), checked each step by the cross-replica fingerprint,
and a delay in one rank's compute (:mod:`labkit.fault_tolerance.stragglers`).
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from labkit.core.data import get_batch, load_corpus
from labkit.core.devices import comm_device
from labkit.core.model import GPTConfig, build_model
from labkit.fault_tolerance.sdc import cross_check, fingerprint, flip_bit
from labkit.fault_tolerance.stragglers import PhaseTimer

WHERE = ("grad_local", "grad_reduced", "param", "adam")  # where a flipped bit can land


def build(cfg: dict, device: torch.device) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The GPT of ``cfg`` (seeded: every replica builds the same one) and its AdamW."""
    mcfg = GPTConfig(n_layer=cfg["n_layer"], n_head=cfg["n_head"], n_embd=cfg["n_embd"],
                     block_size=cfg["block_size"])
    model = build_model(mcfg, seed=cfg["seed"]).to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=cfg["lr"], betas=(0.9, 0.95), weight_decay=0.0)


def state_tensors(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every tensor replicas must hold bit-identical: the parameters, then Adam's moments (its step
    counters, host scalars beside GPU moments, count steps and are left out)."""
    out = dict(model.named_parameters())
    for name, p in model.named_parameters():
        for key, value in opt.state.get(p, {}).items():
            if value.shape == p.shape:
                out[f"adam.{key}.{name}"] = value
    return out


def local_backward(model: torch.nn.Module, data: torch.Tensor, cfg: dict, step: int, shares: list[int],
                   device: torch.device) -> torch.Tensor:
    """Forward and backward on ``shares`` of step ``step``'s global batch; gradients add up over the
    shares (each share's mean loss). Returns the sum of the shares' losses."""
    total = torch.zeros((), device=device)
    for s in shares:
        x, y = get_batch(data, step, cfg["batch_size"], cfg["block_size"], cfg["seed"], rank=s,
                         world_size=cfg["replicas"])
        loss = model(x.to(device), y.to(device))[1]
        loss.backward()
        total += loss.detach()
    return total


def all_reduce_grads(model: torch.nn.Module, n_shares: int, group: dist.ProcessGroup | None = None) -> None:
    """Sum every replica's gradients in one flat all-reduce, then divide by the shares summed."""
    params = [p for p in model.parameters() if p.grad is not None]
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat, group=group)
    flat /= n_shares
    offset = 0
    for p in params:
        p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
        offset += p.numel()


def _flip_here(phase: dict, where: str, step: int, rank: int, tensors: dict[str, torch.Tensor]) -> None:
    f = phase.get("flip")
    if f and f["where"] == where and f["step"] == step and f["rank"] == rank:
        name = f"adam.exp_avg.{f['tensor']}" if where == "adam" else f["tensor"]  # the parameter's moment
        if name not in tensors:
            raise ValueError(f"flip tensor={f['tensor']!r} is not a parameter: {sorted(_grads_names(tensors))}")
        flip_bit(tensors[name], f["index"], f["bit"])


def _grads_names(tensors: dict[str, torch.Tensor]) -> list[str]:
    return [k for k in tensors if not k.startswith("adam.")]


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in model.named_parameters()}


def _repair(tensors: dict[str, torch.Tensor], suspects: list[int], world: int) -> int:
    """Copy every replicated tensor from the lowest rank the vote kept; returns that rank."""
    src = min(set(range(world)) - set(suspects))
    for t in tensors.values():
        dist.broadcast(t, src=src)
    return src


def run_phase(cfg: dict, phase: dict, data: torch.Tensor, device: torch.device) -> dict:
    """One run of ``phase["steps"]`` steps from a fresh model (see the module docstring); this rank's
    losses, fingerprint checks, phase timings and final state."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt = build(cfg, device)
    timer, losses, checks = PhaseTimer(device), [], []
    delay = phase.get("delay") or {}
    for step in range(phase["steps"]):
        t0 = time.perf_counter()
        with timer.phase("compute"):
            loss = local_backward(model, data, cfg, step, [rank], device)
            if delay.get("rank") == rank:
                time.sleep(delay["ms"] / 1e3)  # a slow GPU, a throttled clock, a noisy neighbour
        _flip_here(phase, "grad_local", step, rank, _grads(model))
        with timer.phase("wait"):
            all_reduce_grads(model, world)
            dist.all_reduce(loss)
        _flip_here(phase, "grad_reduced", step, rank, _grads(model))
        opt.step()
        opt.zero_grad(set_to_none=False)
        tensors = state_tensors(model, opt)
        _flip_here(phase, "param", step, rank, tensors)
        _flip_here(phase, "adam", step, rank, tensors)
        losses.append(loss.item() / world)
        if phase.get("check", True):
            with timer.phase("check"):
                names = list(tensors)
                result = cross_check(fingerprint(list(tensors.values())))
            result["tensors"] = [names[i] for i in result["tensors"]]
            if not result["agree"] and phase.get("repair") and not result["tie"]:
                result["repaired_from"] = _repair(tensors, result["suspects"], world)
            checks.append({"step": step, **result})
        timer.current["step"] = time.perf_counter() - t0
        timer.end_step()
    final = {k: v.detach().cpu().clone() for k, v in state_tensors(model, opt).items()}
    return {"rank": rank, "loss": losses, "checks": checks, "timings": timer.steps, "state": final,
            "fingerprint_bytes": 8 * len(final) * world}


def replica_phases(cfg: dict, phases: list[dict]) -> list[dict]:
    """Every phase in turn on this rank (a rank function for :func:`labkit.launch.launch`)."""
    device = comm_device()
    data = load_corpus()
    out = []
    for phase in phases:
        dist.barrier()
        out.append(run_phase(cfg, phase, data, device))
    return out
