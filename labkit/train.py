"""The one training loop every strategy uses, and its command line for torchrun and clusters.

From a notebook: ``labkit.launch.launch(train, TrainConfig(strategy="ddp"), world_size=2)``.
From a shell, the same loop::

    python -m labkit.train --strategy single --steps 20 --metrics out.json
    torchrun --nproc-per-node 2 -m labkit.train --strategy ddp --steps 20 --seed 0 --metrics out.json

The metrics JSON holds the global-batch loss per step, step times, and per-rank figures.
With ``--checkpoint-dir`` the run saves there (every ``--save-every`` steps, at the end, and when
SIGTERM or SIGUSR1 arrives: then it exits with code 75, "requeue me"), and a restarted run resumes
from the newest good checkpoint bit for bit (:mod:`labkit.fault_tolerance`, :mod:`labkit.resume`).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from labkit.activation_checkpointing import apply as apply_checkpointing
from labkit.activation_checkpointing import parse_policy
from labkit.comm import CommCounter, ring_volume
from labkit.data import check_shard, get_batch, load_corpus, train_val_split
from labkit.launch import check_device, init_from_env
from labkit.model import GPT, GPTConfig, build_model
from labkit.pipeline_parallel import SCHEDULES, train_pp
from labkit.tensor_parallel import train_tp
from labkit.preemption import REQUEUE_EXIT_CODE
from labkit.resume import CLI_HELP, Resumable, check_checkpointing, seed_rngs
from labkit.schedule import LR_SCHEDULES, lr_scheduler
from labkit.memory import model_state_breakdown
from labkit.memory_probe import measured_model_states
from labkit import zero
from labkit.zero_scratch import ZeroOneAdamW
from labkit.strategies import DEEPSPEED, STRATEGIES, ZERO_STAGE, check_strategy, wrap


PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass
class TrainConfig:
    strategy: str = "single"
    steps: int = 20
    batch_size: int = 8  # global batch: rows per step summed over all ranks
    grad_accum: int = 1  # micro-batches per rank per step: batch_size = micro x grad_accum x ranks
    lr: float = 3e-3
    weight_decay: float = 0.0
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping
    seed: int = 0
    device: str = "cpu"
    precision: str = "fp32"  # fp32 | bf16 (autocast) | fp16 (autocast + loss scaling, CUDA only)
    activation_checkpointing: str = "none"  # none | full | every:k | selective
    bucket_cap_mb: float = 25.0
    reshard_after_forward: bool = True  # fsdp: free gathered parameters after each block's forward
    cpu_offload: bool = False  # fsdp: keep parameter, gradient and optimizer shards in CPU memory
    fsdp_bf16: bool = False  # fsdp: MixedPrecisionPolicy with bf16 parameters, fp32 reductions
    offload_optimizer: bool = False  # zero1/2/3: Adam states and step on the CPU (ZeRO-Offload)
    lr_schedule: str = "constant"  # constant | cosine (to lr/10 at the last step), after warmup_steps
    warmup_steps: int = 0  # linear warmup from lr/warmup_steps
    checkpoint_dir: str | None = None  # save here and resume from here (labkit.fault_tolerance)
    save_every: int = 0  # steps between checkpoints; 0: only at the end and on preemption
    keep_last: int = 2  # checkpoints kept (the newest always)
    async_save: bool = False  # block only for the copy to host memory; write in the background
    resume: bool = True  # start from the newest good checkpoint in checkpoint_dir
    grace_s: float = 30.0  # SIGTERM/SIGUSR1 to SIGKILL: finish the step, save if it fits, exit 75
    reserve_s: float = 2.0  # of grace_s, kept back for leaving cleanly (no save may eat into it)
    step_log: str | None = None  # append one JSON line per step, checkpoint and restore (rank 0)
    tp: int = 0  # strategy tp: tensor-parallel degree; 0 = every rank (world/tp ranks are FSDP2 data parallel)
    pp: int = 0  # strategy pp: pipeline stages, one per rank; 0 = every rank
    microbatches: int = 4  # strategy pp: the global batch is cut into this many
    schedule: str = "1f1b"  # strategy pp: gpipe | 1f1b | interleaved
    progress: bool | None = None  # None: a bar when attached to a terminal and steps >= 50
    return_params: bool = False

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy={self.strategy!r} is unknown; valid strategies: {list(STRATEGIES)}")
        for name in ("steps", "batch_size", "grad_accum", "keep_last", "warmup_steps", "save_every", "tp", "pp",
                     "microbatches"):
            v, low = getattr(self, name), 0 if name in ("warmup_steps", "save_every", "tp", "pp") else 1
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                raise ValueError(f"{name} must be a {'positive' if low else 'non-negative'} integer, got {v!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule={self.schedule!r} is unknown; valid schedules: {list(SCHEDULES)}")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"lr_schedule={self.lr_schedule!r} is unknown; valid schedules: {list(LR_SCHEDULES)}")
        check_checkpointing(self)
        defaults = {f.name: f.default for f in fields(self)}
        for flag, valid in (("reshard_after_forward", ("fsdp",)), ("cpu_offload", ("fsdp",)),
                            ("fsdp_bf16", ("fsdp",)), ("offload_optimizer", ("zero1", "zero2", "zero3"))):
            if getattr(self, flag) != defaults[flag] and self.strategy not in valid:
                raise ValueError(f"{flag}={getattr(self, flag)} has no effect with strategy={self.strategy!r}; "
                                 f"it applies to strategy {' / '.join(map(repr, valid))}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr must be a positive finite number, got {self.lr!r}")
        if self.grad_clip < 0:
            raise ValueError(f"grad_clip must be >= 0 (0 disables clipping), got {self.grad_clip!r}")
        check_device(self.device, 1)
        if self.strategy == "zero3" and self.activation_checkpointing == "selective":
            # Measured: with ZeRO-3's patched linear and gathering hooks, PyTorch's selective
            # recomputation drifted from the reference by 4e-4 in loss within 3 steps (and so does
            # any later selective run in the same process); DeepSpeed has no op-level policy.
            raise ValueError("activation_checkpointing='selective' is not supported with strategy='zero3'; "
                             "use 'full' or 'every:k' (DeepSpeed's checkpointing), or strategy='fsdp'")
        if self.grad_accum > 1 and self.strategy in ("dp_naive", "dp_bucketed"):
            raise ValueError(f"grad_accum={self.grad_accum} is not implemented for strategy={self.strategy!r} "
                             "(the hand-written data parallel syncs every backward); use 'ddp'")
        try:
            parse_policy(self.activation_checkpointing)
        except ValueError as e:
            raise ValueError(f"activation_checkpointing: {e}") from None
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision={self.precision!r} is unknown; valid precisions: {list(PRECISIONS)}")
        if self.precision == "fp16" and self.device != "cuda":
            raise ValueError("precision='fp16' needs device='cuda' (fp16 loss scaling with GradScaler); "
                             "on CPU use precision='bf16'")


def _sync_gradients(model, strategy: str, sync: bool):
    """Skip the gradient all-reduce / reduce-scatter on all but the last micro-batch of a step."""
    if strategy == "ddp" and not sync:
        return model.no_sync()
    if strategy == "fsdp":
        model.set_requires_gradient_sync(sync)
    return nullcontext()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(cfg: TrainConfig, model_cfg: GPTConfig | None = None, corpus: str | None = None) -> dict:
    """Train on this process's rank (or alone); return losses, timings and per-rank figures."""
    model_cfg = model_cfg or GPTConfig()
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    check_strategy(cfg.strategy, world)
    if cfg.strategy == "tp":  # the model itself is split: its own loop, the same result dict
        return train_tp(cfg, model_cfg, corpus)
    if cfg.strategy == "pp":  # ... plus "bubble_fraction"; one process runs the stages by hand
        return train_pp(cfg, model_cfg, corpus, impl="torch" if world > 1 else "scratch")
    check_shard(cfg.batch_size, world)
    if (cfg.batch_size // world) % cfg.grad_accum:
        raise ValueError(f"grad_accum={cfg.grad_accum} must divide the {cfg.batch_size // world} rows each rank "
                         f"gets per step (batch_size={cfg.batch_size} over {world} ranks)")
    micro = cfg.batch_size // world // cfg.grad_accum
    device = torch.device("cuda", torch.cuda.current_device()) if cfg.device == "cuda" else torch.device("cpu")
    data = train_val_split(load_corpus(corpus)).train

    seed_rngs(cfg.seed, rank)  # dropout's masks; a resume restores the states the checkpoint holds
    model = build_model(model_cfg, seed=cfg.seed).to(device)
    ds_checkpointing = cfg.strategy in DEEPSPEED and cfg.activation_checkpointing.split(":")[0] in ("full", "every")
    if not ds_checkpointing:  # before any wrapper, as DDP/FSDP expect
        apply_checkpointing(model, cfg.activation_checkpointing)
    # Psi, before any strategy shards the parameters in place
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    model, finish_backward = wrap(model, cfg.strategy, device, cfg.bucket_cap_mb, cfg.reshard_after_forward,
                                  cfg.cpu_offload, cfg.fsdp_bf16)
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.strategy == "zero1_scratch" and world > 1:
        opt = ZeroOneAdamW(model, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay,
                           grad_clip=cfg.grad_clip)
    else:
        opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    sched = lr_scheduler(opt, cfg.lr_schedule, cfg.warmup_steps, cfg.steps)
    engine = None
    if cfg.strategy in DEEPSPEED:  # DeepSpeed takes over backward, clipping, step, zeroing and the schedule
        engine = zero.initialize(model, opt, zero.deepspeed_config(
            zero.STAGES[cfg.strategy], micro, world, cfg.grad_accum, cfg.grad_clip,
            cfg.precision, cfg.offload_optimizer), lr_scheduler=sched)
        model, opt = engine, engine.optimizer
        if ds_checkpointing:  # DeepSpeed's own checkpointing where it has the policy
            apply_checkpointing(engine.module, cfg.activation_checkpointing, backend="deepspeed")

    # Mixed precision (Micikevicius et al. 2018): matmuls in 16 bits under autocast, weights and
    # optimizer in fp32. fp16's narrow range needs the loss scaled so small gradients survive;
    # bf16 has fp32's exponent range and does not.
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.precision)
    scaler = torch.amp.GradScaler("cuda") if cfg.precision == "fp16" else None

    meta = {"strategy": cfg.strategy, "world_size": world, "seed": cfg.seed, "batch_size": cfg.batch_size,
            "model": model_cfg.to_dict()}
    ft = Resumable(cfg, meta, model, opt, sched, engine, scaler)
    start, losses = ft.start()
    show = cfg.progress if cfg.progress is not None else (sys.stderr.isatty() and cfg.steps >= 50)
    bar = tqdm(total=cfg.steps, initial=start, desc=f"{cfg.strategy} x{world}", disable=not show or rank != 0,
               mininterval=1.0)
    times, comm_by_op, calls_by_op, held, local_losses = [], [], [], [], []
    states = None
    try:
        for step in range(start, cfg.steps):
            x, y = (t.to(device) for t in get_batch(data, step, cfg.batch_size, model_cfg.block_size,
                                                      cfg.seed, rank, world))
            micros = list(zip(x.split(micro), y.split(micro)))  # grad_accum micro-batches of this rank's rows
            _sync(device)
            t0 = time.perf_counter()
            with CommCounter() as counter:
                last = step == cfg.steps - 1
                if engine is not None:  # DeepSpeed accumulates and steps at the boundary itself
                    # measured between backward and step, as the step frees gradients: a walk over
                    # the engine's buffers, so inside the timed step
                    loss, measured = zero.train_step(engine, micros, measure=True)
                else:
                    loss = torch.zeros((), device=device)
                    for i, (xm, ym) in enumerate(micros):
                        with _sync_gradients(model, cfg.strategy, i == cfg.grad_accum - 1):
                            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                                micro_loss = model(xm, ym)[1]  # drop the logits: only autograd needs what it saved
                            micro_loss = micro_loss / cfg.grad_accum  # the step's loss is the mean over micro-batches
                            (scaler.scale(micro_loss) if scaler else micro_loss).backward()
                        loss += micro_loss.detach()
                    finish_backward()
                    if scaler:
                        scaler.unscale_(opt)  # clip the true gradients, not the scaled ones
                    if cfg.grad_clip and not getattr(opt, "clips_gradients", False):
                        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
                    if scaler:
                        scaler.step(opt)
                        scaler.update()
                    else:
                        opt.step()
                    if sched is not None:
                        sched.step()
            _sync(device)
            times.append(time.perf_counter() - t0)
            if engine is None:  # counted outside the timed step; at its fullest: gradients not yet freed
                measured = measured_model_states(model, opt)
                opt.zero_grad(set_to_none=True)
            held.append(measured.total)
            states = measured if last else states
            comm_by_op.append(dict(counter.bytes))
            calls_by_op.append(dict(counter.calls))
            # Every rank computed the mean loss of its own shard; their mean is the global-batch loss.
            local = loss.detach()
            loss = local.clone()
            if world > 1:
                dist.all_reduce(loss)
                loss /= world
            mine_loss, global_loss = torch.stack([local, loss]).tolist()  # one device sync, not two
            local_losses.append(mine_loss)
            losses.append(global_loss)
            bar.update()
            bar.set_postfix(loss=f"{losses[-1]:.4f}", refresh=False)
            if ft.end_of_step(step + 1, losses):  # preempted: saved (if there was time); stop here
                break
    except BaseException:
        ft.abort()  # SIGTERM must stop a failed rank again, or torchrun waits out its grace period
        raise
    bar.close()
    faults = ft.finish()

    mine = {"rank": rank, "step_time_s": times,
            "allreduce_bytes_per_step": [b.get("allreduce", 0) for b in comm_by_op],
            "allreduce_calls_per_step": [c.get("allreduce", 0) for c in calls_by_op],
            "comm_bytes_per_step": comm_by_op, "comm_calls_per_step": calls_by_op,
            "comm_volume_per_step": [ring_volume(b, world) for b in comm_by_op],
            "model_state_bytes": asdict(states) | {"total": states.total} if states else None,
            "model_state_bytes_per_step": held, "local_loss": local_losses}
    ranks = [None] * world
    if world > 1:
        dist.all_gather_object(ranks, mine)
    else:
        ranks = [mine]
    inner = getattr(model, "module", model)
    result = {
        "strategy": cfg.strategy, "world_size": world, "device": cfg.device, "steps": cfg.steps,
        "precision": cfg.precision, "activation_checkpointing": cfg.activation_checkpointing,
        "seed": cfg.seed, "batch_size": cfg.batch_size, "model": model_cfg.to_dict(),
        "n_params": GPT.count_params(model_cfg),
        "grad_bytes": grad_bytes,
        "loss": losses, "step_time_s": times, "ranks": ranks, "start_step": start, **faults,
    }
    # DeepSpeed's ZeRO optimizers keep an fp32 master partition even when training in fp32
    precision = "fp32_master" if cfg.strategy in DEEPSPEED else "fp32"
    result["predicted_model_state_bytes"] = asdict(model_state_breakdown(
        result["n_params"], world, ZERO_STAGE[cfg.strategy], precision))
    if cfg.return_params:  # sharded parameters are gathered (a collective: every rank calls it)
        result["params"] = zero.full_state_dict(inner, zero3=cfg.strategy == "zero3")
    return result


def train_many(configs: list[TrainConfig], model_cfg: GPTConfig | None = None) -> list[dict]:
    """Several runs in one process group (one launch, one DeepSpeed op build), in order."""
    return [train(c, model_cfg) for c in configs]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m labkit.train",
        description="Train the lab GPT with a parallel strategy; run under torchrun for several ranks.",
    )
    choices = {"strategy": STRATEGIES, "device": ("cpu", "cuda"), "precision": PRECISIONS, "lr_schedule": LR_SCHEDULES,
               "schedule": SCHEDULES}
    for f in fields(TrainConfig):
        if f.name in ("progress", "return_params"):
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = ({"choices": choices[f.name]} if f.name in choices else {"action": argparse.BooleanOptionalAction}
                if isinstance(f.default, bool) else {"type": str if f.default is None else type(f.default)})
        p.add_argument(flag, default=f.default, help=CLI_HELP.get(f.name), **kind)
    for f in fields(GPTConfig):
        kind = ({"action": argparse.BooleanOptionalAction} if isinstance(f.default, bool)
                else {"type": type(f.default)})
        p.add_argument("--" + f.name.replace("_", "-"), default=f.default, **kind,
                       help=f"model: GPTConfig.{f.name}")
    p.add_argument("--corpus", default=None, help="text file to train on (default: shipped Shakespeare)")
    p.add_argument("--metrics", default=None, help="write the metrics JSON here (rank 0)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None)
    # The `deepspeed` launcher passes --local_rank; the rank is read from the environment anyway.
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = vars(parser.parse_args(argv))
    try:
        tc = TrainConfig(**{f.name: args[f.name] for f in fields(TrainConfig) if f.name in args})
        mc = GPTConfig(**{f.name: args[f.name] for f in fields(GPTConfig)})
    except ValueError as e:
        parser.error(str(e))  # exits 2 with the message, as for any other bad flag
    rank, world, _ = init_from_env(tc.device)
    try:
        result = train(tc, mc, corpus=args["corpus"])
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    preempted = result["preempted"] is not None
    if rank == 0:
        print(f"{tc.strategy} on {world} rank(s): steps {result['start_step']}..{len(result['loss'])}, loss "
              f"{result['loss'][0]:.4f} -> {result['loss'][-1]:.4f} in {sum(result['step_time_s']):.2f} s"
              + (f"; preempted by {result['preempted']['signal']}, exiting {REQUEUE_EXIT_CODE} to be requeued"
                 if preempted else ""))
        if args["metrics"]:
            out = Path(args["metrics"])
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps({"config": asdict(tc), **result}, indent=1))
            print(f"metrics written to {out}")
    return REQUEUE_EXIT_CODE if preempted else 0


if __name__ == "__main__":
    sys.exit(main())
