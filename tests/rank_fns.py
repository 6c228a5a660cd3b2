"""Functions the launch tests run on every rank (spawned ranks import them from this module)."""
from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from labkit.parallel.data_parallel import BucketedDataParallel, NaiveDataParallel


def rank_info(tag: str) -> dict:
    t = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(t)
    return {"tag": tag, "rank": dist.get_rank(), "world": dist.get_world_size(), "sum": t.item(),
            "pid": os.getpid()}


def fail_on(bad_rank: int) -> int:
    if dist.get_rank() == bad_rank:
        raise ValueError(f"deliberate failure on rank {bad_rank}")
    dist.barrier()  # the healthy ranks block here, as they would in a real collective
    return dist.get_rank()


def die_on(bad_rank: int) -> int:
    if dist.get_rank() == bad_rank:
        os._exit(3)  # no Python exception at all: a crash as the OS sees it
    time.sleep(1)
    return dist.get_rank()


def sleep_forever() -> None:
    time.sleep(3600)


class Toy(nn.Module):
    """Tied embedding/head and a frozen layer: the cases that break naive data parallels."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(11, 8)
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, 11, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(torch.tanh(self.mid(self.frozen(self.emb(x)))))


def toy_grads(wrapper: str, bucket_cap_mb: float = 1e-4) -> dict:
    model = Toy()
    if wrapper == "ddp":
        wrapped, finish = DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb), (lambda: None)
    else:
        wrapped = (NaiveDataParallel(model) if wrapper == "naive"
                   else BucketedDataParallel(model, bucket_cap_mb=bucket_cap_mb))
        finish = wrapped.finish_gradient_sync
    out = []
    for step in range(2):
        g = torch.Generator().manual_seed(100 * step + dist.get_rank())  # different data per rank
        x = torch.randint(0, 11, (4, 5), generator=g)
        wrapped(x).logsumexp(-1).mean().backward()
        finish()
        out.append({n: (p.grad.clone() if p.grad is not None else None) for n, p in model.named_parameters()})
        model.zero_grad(set_to_none=True)
    return {"grads": out, "n_buckets": len(getattr(wrapped, "buckets", []))}


def fsdp_losses_with_checkpointing(policy: str, steps: int = 3) -> list[float]:
    """FSDP2 (fully_shard per block, then the root) on a checkpointed GPT: apply, then shard."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from labkit.parallel.activation_checkpointing import apply
    from labkit.core.data import get_batch, load_corpus
    from labkit.core.model import GPTConfig, build_model

    cfg = GPTConfig(block_size=32)
    model = apply(build_model(cfg, seed=0), policy)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data, losses = load_corpus(), []
    for step in range(steps):
        x, y = get_batch(data, step, 8, 32, 0, dist.get_rank(), dist.get_world_size())
        loss = model(x, y)[1]
        loss.backward()
        opt.step()
        opt.zero_grad()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item() / dist.get_world_size())
    return losses


def deepspeed_checkpoint_grads(policy: str) -> dict:
    """DeepSpeed's activation checkpointing on the GPT: gradients against no checkpointing."""
    from labkit.core.model import GPTConfig, build_model
    from labkit.parallel.activation_checkpointing import apply
    from labkit.parallel.deepspeed_zero import init_distributed

    init_distributed(torch.device("cpu"))  # without the shared-memory op DeepSpeed would compile
    cfg = GPTConfig(block_size=32)
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(dist.get_rank()))
    ref = build_model(cfg)
    ref(x, x)[1].backward()
    out = {}
    try:
        model = apply(build_model(cfg), policy, backend="deepspeed")
        model(x, x)[1].backward()
        out["max_diff"] = max((a.grad - b.grad).abs().max().item()
                              for a, b in zip(ref.parameters(), model.parameters()))
    except ValueError as e:
        out["error"] = str(e)
    return out


def p2p_posts(what: str, **kw) -> list:
    """The point-to-point operations this rank posts while running ``what`` (through the real calls)."""
    from dataclasses import asdict

    from labkit.comm.p2p import P2PRecorder

    with P2PRecorder() as rec:
        if what == "ring":
            from labkit.comm.ring import ring_all_reduce

            ring_all_reduce(torch.ones(kw["numel"]))
        else:
            from labkit.core.model import GPTConfig
            from labkit.train import TrainConfig, train

            train(TrainConfig(strategy="pp_scratch", steps=1, batch_size=2 * kw["m"], microbatches=kw["m"],
                              pp_schedule=kw["schedule"]), GPTConfig(block_size=8, n_layer=4, n_embd=16))
    return [asdict(o) for o in rec.ops]


def counted_collectives() -> dict:
    """What CommCounter records for functional and coalesced collectives (8 floats, or 2 x 4, per rank)."""
    import torch.distributed._functional_collectives as fc

    from labkit.comm.counter import CommCounter

    out = {}
    calls = {"functional all-gather": lambda: fc.all_gather_tensor(torch.ones(8), 0, dist.group.WORLD),
             "functional reduce-scatter": lambda: fc.reduce_scatter_tensor(torch.ones(8), "sum", 0, dist.group.WORLD),
             "coalesced all-reduce": lambda: dist.all_reduce_coalesced([torch.ones(4), torch.ones(4)])}

    def coalesced(op):
        def run():
            with dist._coalescing_manager():
                for _ in range(2):
                    op()
        return run

    calls["coalesced all-gather"] = coalesced(lambda: dist.all_gather_into_tensor(torch.empty(8), torch.ones(4)))
    calls["coalesced reduce-scatter"] = coalesced(lambda: dist.reduce_scatter_tensor(torch.empty(4), torch.ones(8)))
    for name, call in calls.items():
        with CommCounter() as c:
            call()
        out[name] = dict(c.bytes)
    return out


def start_a_sleeper() -> int:
    """Start a grandchild of launch (what a DataLoader worker or a subprocess is) and leave it running."""
    import subprocess

    return subprocess.Popen(["sleep", "300"]).pid


def fail_fast_or_wait(bad_rank: int) -> int:
    """Rank ``bad_rank`` fails at once; the others wait for something from it that never comes (outside
    a collective, where gloo would notice the peer's death)."""
    if dist.get_rank() == bad_rank:
        raise ValueError("deliberate failure")
    time.sleep(3600)
    return dist.get_rank()


def count_with_bar(n: int) -> bool:
    """Rank 0 counts to ``n`` on a progress bar, as the training loop does (the caller draws it)."""
    from labkit.core import progress

    bar = progress.bar(n, "counting", progress.wanted(n) and dist.get_rank() == 0)
    for _ in range(n):
        bar.update()
        bar.set_postfix(loss="0.5000", refresh=False)
    bar.close()
    return isinstance(bar, progress._Forwarded)


def bench_without_2_13_collective_names() -> list:
    """The comm bench where torch has only 2.11's names (all_gather_into_tensor, reduce_scatter_tensor)."""
    import torch
    import torch.distributed as dist

    from labkit.comm.bench import bench

    for name in ("all_gather_single", "reduce_scatter_single"):
        if hasattr(dist, name):
            delattr(dist, name)
    return [r.op for r in bench(["all_gather", "reduce_scatter"], [4096], torch.device("cpu"), warmup=1,
                                target_ms=1.0)]


def first_gradients(cfg, model_cfg) -> dict:
    """The full gradients the loop hands the optimizer after step 0's backward (the optimizer's step
    replaced by a capture), by parameter name: this rank's, sharded ones gathered whole."""
    from torch.distributed.tensor import DTensor

    from labkit.core.data import get_batch, load_corpus, train_val_split
    from labkit.core.model import build_model
    from labkit.fault_tolerance.rng import seed_rngs
    from labkit.train.loop import make_setup, train_step
    from labkit.train.probe import Probe

    setup = make_setup(cfg, model_cfg)
    seed_rngs(cfg.seed, setup.dims.data_rank)
    setup.place(build_model(model_cfg, seed=cfg.seed))
    optimizer = setup.make_optimizer()
    setup.attach(optimizer, None, None)
    grads = {}

    def capture() -> None:
        for name, p in setup.module.named_parameters():
            if p.grad is not None:
                g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                grads[name] = g.detach().cpu().clone()

    optimizer.step = capture
    data = train_val_split(load_corpus(None)).train
    x, y = get_batch(data, 0, cfg.batch_size, model_cfg.block_size, cfg.seed, setup.dims.data_rank,
                     setup.dims.data_world)
    train_step(setup, x, y, Probe(setup, 1))
    return grads
