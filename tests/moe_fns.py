"""The MoE GPT and the training runs that tests/test_moe.py holds against each other (spawned ranks
import them from here).

Until ``GPTConfig`` has the ``moe_*`` fields (the model patch), :class:`MoEConfig` and :class:`MoEGPT`
do from outside what the patch does inside: every block's MLP a :class:`MoEMLP`, and the loss plus
``moe_aux_weight`` x the sum of the blocks' auxiliary losses. Once the patch is in, they are GPT's own.
"""
from __future__ import annotations

import math
import warnings
from contextlib import nullcontext
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from labkit.comm.counter import CommCounter
from labkit.core.data import get_batch, load_corpus, train_val_split
from labkit.core.checks import positive_int
from labkit.core.model import GPT, GPTConfig
from labkit.core.moe import MoEMLP
from labkit.core.moe_routing import update_router_biases
from labkit.parallel.data_parallel import SyncOnRequest
from labkit.parallel.experts.nodes import on_nodes
from labkit.parallel.experts.nodes_check import placement_vs_one_process
from labkit.parallel.experts.placement import ExpertParallelPlacement, place_experts, record_all_to_all
from labkit.parallel.layout.mesh import Degrees, ParallelDims

PATCHED = "moe_experts" in {f.name for f in fields(GPTConfig)}

if PATCHED:
    MoEConfig, MoEGPT = GPTConfig, GPT
else:
    @dataclass(frozen=True)
    class MoEConfig(GPTConfig):
        moe_experts: int = 4
        moe_top_k: int = 2
        moe_capacity_factor: float = 1.25
        moe_aux_weight: float = 0.01

    class MoEGPT(GPT):
        def __init__(self, cfg: MoEConfig) -> None:
            super().__init__(cfg)
            for block in self.blocks:
                block.mlp = MoEMLP.from_config(cfg)
                block.mlp.apply(self._init_weights)
                for name, p in block.mlp.named_parameters():
                    if name.endswith("proj.weight"):
                        nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

        def forward(self, idx, targets=None):
            logits, loss = super().forward(idx, targets)
            if loss is not None:
                loss = loss + self.config.moe_aux_weight * sum(b.mlp.aux_loss for b in self.blocks)
            return logits, loss

        def moe_stats(self):
            return [b.mlp.stats for b in self.blocks]


class HandSyncedEP(SyncOnRequest):
    """labkit's one expert placement (:func:`place_experts`) over ``ep`` ranks, the rest of the model
    data parallel with its gradients reduced by hand, not by FSDP2 as on labkit's mesh: the placement
    and its all-to-alls held against one process alone. Call :meth:`finish_gradient_sync` after
    backward."""

    def __init__(self, module: nn.Module, ep: int, a2a=None, make=ExpertParallelPlacement) -> None:
        super().__init__(module)
        positive_int("ep", ep)
        world = dist.get_world_size()
        if world % ep:
            raise ValueError(f"ep={ep} must divide the world size {world}")
        self.dims = ParallelDims(Degrees(dp_replicate=world // ep, dp_shard=ep, ep=ep))
        self.expert_params = place_experts(module, self.dims, a2a, make)

    def expert_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.module.parameters() if id(p) in self.expert_params]

    def finish_gradient_sync(self) -> None:
        """Every gradient becomes (sum over the ranks' contributions) / world: non-expert ones summed
        over all ranks, expert ones over their replica group (see the module's docstring)."""
        world = dist.get_world_size()
        shared = [p for p in self.module.parameters() if id(p) not in self.expert_params]
        _reduce_grads(shared, None, world)
        replicas = self.dims.group("dp_replicate")
        _reduce_grads(self.expert_parameters(), replicas, world, skip=replicas is None)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """One process's state dict, on every rank (a collective over the EP group): this rank's
        entries plus the experts its group's other ranks hold, on the CPU."""
        mine = {k: v.detach().cpu().clone() for k, v in self.module.state_dict().items()}
        if self.dims.degrees.ep == 1:
            return mine
        parts: list = [None] * self.dims.degrees.ep
        dist.all_gather_object(parts, {k: v for k, v in mine.items() if ".experts." in k}, group=self.dims.group("ep"))
        for part in parts:
            mine.update(part)
        return mine

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load one process's state dict: each rank takes its own experts and the shared entries."""
        own = self.module.state_dict().keys()
        self.module.load_state_dict({k: v for k, v in state.items() if k in own})

    def groups_of(self, p: torch.Tensor) -> tuple:
        """For :func:`labkit.parallel.clipping.clip_grad_norm_`: expert gradients are split over the
        EP group (each counted once there); the rest are replicated."""
        return (self.dims.group("ep"),) if id(p) in self.expert_params else ()


def _reduce_grads(params: list[nn.Parameter], group, world: int, skip: bool = False) -> None:
    """Sum ``params``' gradients over ``group`` in one flat all-reduce, then divide by ``world``."""
    for p in params:
        if p.grad is None:  # an expert no token reached on any rank of its group
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params]
    if not grads:
        return
    if not skip:
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=group)
        for g, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(reduced)
    for g in grads:
        g.div_(world)


def build(cfg: MoEConfig, seed: int = 0) -> MoEGPT:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return MoEGPT(cfg)


def train_moe(cfg: MoEConfig, steps: int, batch: int, lr: float = 1e-3, ep: int = 0, a2a: str = "scratch",
              count_steps: int = 0, per_node: int = 0) -> dict:
    """AdamW steps on this rank's rows (all rows alone); global losses, this rank's parameters, and
    per step: each block's routing stats and this rank's all-to-all traffic (and, for the first
    ``count_steps``, what :class:`CommCounter` saw: its first use imports torch._dynamo, ~3 s)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    data = train_val_split(load_corpus()).train
    model = build(cfg)
    fn = None
    if a2a == "torch":
        import torch.distributed.nn.functional as dnn

        def fn(x, out_splits, in_splits, group):  # the library's differentiable all-to-all (deprecated)
            out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                return dnn.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    make = on_nodes(per_node) if per_node else ExpertParallelPlacement  # two hops across "nodes"
    net = HandSyncedEP(model, ep, fn, make) if ep else model
    opt = torch.optim.AdamW(net.parameters(), lr=lr)
    out = {"loss": [], "stats": [], "a2a": [], "counter": []}
    for step in range(steps):
        x, y = get_batch(data, step, batch, cfg.block_size, rank=rank, world_size=world)
        with record_all_to_all() as log, CommCounter() if step < count_steps else nullcontext() as cc:
            loss = net(x, y)[1]
            loss.backward()
        if ep:
            net.finish_gradient_sync()
        opt.step()
        update_router_biases(model)  # DeepSeek-V3's bias step, where the config asks for it
        opt.zero_grad(set_to_none=True)
        loss = loss.detach()
        if world > 1:
            dist.all_reduce(loss)
            loss /= world
        out["loss"].append(loss.item())
        out["stats"].append(model.moe_stats())
        out["a2a"].append(log)
        out["counter"].append(dict(cc.bytes) if cc is not None else None)
    out["params"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if ep:
        out["full"] = net.full_state_dict()
        net.load_full_state_dict(out["full"])  # a round trip changes nothing
        assert all(torch.equal(v, out["params"][k]) for k, v in model.state_dict().items())
    out["rank"], out["world"] = rank, world
    return out


def ep_suite(runs: list[dict]) -> list[dict]:
    """Several runs in one launch (each a dict of ``train_moe``'s keyword arguments)."""
    torch.set_num_threads(1)
    return [train_moe(**kw) for kw in runs]



def node_suite(configs: list[dict]) -> list[dict]:
    """:func:`placement_vs_one_process` for several layouts in one launch."""
    return [placement_vs_one_process(**kw) for kw in configs]
