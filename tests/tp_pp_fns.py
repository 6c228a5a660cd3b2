"""Rank functions of the tensor- and pipeline-parallel tests (spawned ranks import them from here)."""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist

from labkit.comm.counter import CommCounter
from labkit.core.model import GPTConfig, build_model
from labkit.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear, parallelize_dtensor


def mlp_three_ways(seed: int = 0) -> dict:
    """One GPT MLP run whole, split by the hand-written layers, and split by DTensor, on the same input:
    outputs, input gradients and the collectives each split issued in forward and in backward."""
    from torch.distributed.device_mesh import init_device_mesh

    cfg = GPTConfig(n_embd=32, n_head=2, n_layer=1)
    tp, rank = dist.get_world_size(), dist.get_rank()
    x = torch.randn(2, 8, cfg.n_embd, generator=torch.Generator().manual_seed(seed))
    out = {}
    for how in ("whole", "scratch", "dtensor"):
        model = build_model(cfg, seed)
        mlp = model.blocks[0].mlp
        if how == "scratch":
            mlp.fc, mlp.proj = ColumnParallelLinear(mlp.fc, None, tp, rank), RowParallelLinear(mlp.proj, None, tp, rank)
        elif how == "dtensor":
            parallelize_dtensor(model, init_device_mesh("cpu", (tp,)))
        xi = x.clone().requires_grad_()
        with CommCounter() as fwd:
            y = mlp(xi)
        with CommCounter() as bwd:
            y.pow(2).sum().backward()
        out[how] = {"y": y.detach(), "dx": xi.grad, "fwd": dict(fwd.calls), "bwd": dict(bwd.calls),
                    "fwd_bytes": dict(fwd.bytes), "bwd_bytes": dict(bwd.bytes)}
    return out


def tp_suite(configs, model_cfg, dropout_cfg=None) -> dict:
    """The TP training runs and the MLP check in one launch (a launch costs seconds on two cores);
    ``dropout_cfg`` runs once more on the model with dropout."""
    from dataclasses import replace

    from labkit.train import train, train_many

    out = {"runs": train_many(configs, model_cfg), "mlp": mlp_three_ways()}
    if dropout_cfg is not None:
        out["dropout"] = train(dropout_cfg, replace(model_cfg, dropout=0.1))
    return out


@contextmanager
def one_thread():
    """The single-process reference in the pytest process: 2 OpenMP threads on 2 shared cores spin
    against the ranks (measured: up to 10x slower under load)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def pp_on_torch_2_11_stages(cfg, model_cfg) -> dict:
    """Train with ``PipelineStage`` as torch 2.11 has it: no ``output_grads`` / ``input_grads`` arguments."""
    import torch.distributed.pipelining as pipelining

    from labkit.train import train

    real = pipelining.PipelineStage

    class PipelineStage211(real):
        def __init__(self, submodule, stage_index, num_stages, device, input_args=None, output_args=None,
                     group=None, dw_builder=None):
            super().__init__(submodule, stage_index, num_stages, device, input_args=input_args,
                             output_args=output_args, group=group, dw_builder=dw_builder)

    pipelining.PipelineStage = PipelineStage211
    try:
        return train(cfg, model_cfg)
    finally:
        pipelining.PipelineStage = real
