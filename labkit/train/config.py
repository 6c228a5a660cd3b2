"""What a training run is: one ``TrainConfig``, each field with its unit, valid values and help.

The same fields are the flags of ``python -m labkit.train`` (:mod:`labkit.train.cli` builds the
parser from them, grouped as below), so a notebook and a cluster job describe a run alike. A config
checks itself when it is made: a bad value, or an option the chosen strategy does not take, is a
``ValueError`` that names the field and what would be valid, before anything starts.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from labkit.core.checks import (
    MAX_COUNT,
    at_most,
    non_negative_int,
    non_negative_number,
    one_of,
    positive_count,
    positive_number,
)
from labkit.core.devices import DEVICE_TYPES, check_device
from labkit.fault_tolerance.preemption import check_grace
from labkit.parallel.activation_checkpointing import parse_policy
from labkit.parallel.pipeline.stages import PP_SCHEDULES
from labkit.train.lr_schedule import LR_SCHEDULES
from labkit.train.strategies import OPTIONS, Strategy, strategy, takes

# How the loop computes (Micikevicius et al. 2018): fp32 throughout; bf16 or fp16 autocast with fp32
# weights and optimizer states (fp16 with dynamic loss scaling, torch's GradScaler).
TRAIN_PRECISIONS = ("fp32", "bf16", "fp16", "fp8", "fp8-block")
GROUPS = ("strategy", "data and optimisation", "precision and memory", "checkpointing and preemption", "output")


def parse_steps(spec: str, steps: int) -> range:
    """``"A:B"`` -> steps A to B-1; a ValueError naming ``profile_steps`` otherwise."""
    try:
        a, b = (int(x) for x in spec.split(":"))
    except ValueError:
        raise ValueError(f"profile_steps={spec!r} must be 'A:B', the steps A to B-1 to record, e.g. '2:4'") from None
    if not 0 <= a < b <= steps:
        raise ValueError(f"profile_steps={spec!r} must satisfy 0 <= A < B <= steps={steps}")
    return range(a, b)


def _f(default: Any, group: str, help: str, choices: tuple | None = None) -> Any:
    return field(default=default, metadata={"group": group, "help": help, "choices": choices})


@dataclass
class TrainConfig:
    """One training run of the lab GPT; see the module docstring. Fields are the CLI's flags."""

    strategy: str = _f("auto", "strategy", "how the model and the data are split over the ranks "
                       "(python -m labkit.train --list-strategies describes each); auto: 'mesh' when a degree "
                       "flag is given, else 'single'")
    device: str = _f("cpu", "strategy", "cpu (gloo between ranks) or cuda (one GPU per rank, NCCL)", DEVICE_TYPES)
    bucket_cap_mb: float = _f(25.0, "strategy", "ddp, dp_bucketed: MiB of gradients per all-reduce bucket")
    reshard_after_forward: bool = _f(True, "strategy", "fsdp: free each block's gathered parameters after its "
                                     "forward (ZeRO-3); --no-reshard-after-forward keeps them until backward, "
                                     "as a pipeline (pp > 1) always does")
    cpu_offload: bool = _f(False, "strategy", "fsdp: keep parameter, gradient and optimizer shards in CPU memory")
    fsdp_bf16: bool = _f(False, "strategy", "fsdp: bf16 parameters for compute, fp32 shards and reductions")
    link_gbps: float = _f(0.0, "strategy", "ddp: emulate a slower link, each bucket's all-reduce held back for its "
                          "ring bytes over this many GB/s (0: the real link)")
    link_latency_ms: float = _f(0.0, "strategy", "ddp, with --link-gbps: the emulated link's fixed cost per "
                                "message (its alpha), paid by every bucket")
    sync_each_microbatch: bool = _f(False, "strategy", "ddp, dp_naive, dp_bucketed, fsdp, hsdp: synchronise "
                                    "gradients after every micro-batch, not only the last (what no_sync and "
                                    "set_requires_gradient_sync save)")
    offload_optimizer: bool = _f(False, "strategy", "zero1/zero2/zero3: Adam states and step on the CPU "
                                 "(ZeRO-Offload)")
    # The degrees, torchtitan's ParallelDims: -1 takes the ranks the others leave (one degree at most).
    # Unset (0), a preset's own degree is -1 (--strategy tp is --tp -1) and mesh's are 1 (dp_shard: -1).
    dp_replicate: int = _f(1, "strategy", "hsdp, mesh: data-parallel replicas of the model (HSDP's replicate "
                           "dimension, each replica sharded over the ranks left; mesh with --dp-shard 1 and no cp "
                           "or ep: plain replication; -1: the ranks the other degrees leave)")
    dp_shard: int = _f(0, "strategy", "mesh: data-parallel ranks FSDP2 shards each weight over, the cp ranks "
                       "joining them; the ep ranks are carved out of them (unset or -1: the ranks the other "
                       "degrees leave)")
    tp: int = _f(0, "strategy", "tp, tp_scratch, mesh: tensor-parallel degree, ranks per group (-1: the ranks "
                 "left; unset: -1 under tp, 1 under mesh); the other world/tp ranks are FSDP2 data parallel")
    sequence_parallel: bool = _f(False, "strategy", "tp, mesh: LayerNorms and dropout on s/tp tokens per rank "
                                 "(all-gather + reduce-scatter instead of all-reduce)")
    cp: int = _f(0, "strategy", "cp, mesh: context-parallel degree, ranks sharing each sequence (-1: the ranks "
                 "left; unset: -1 under cp, 1 under mesh); the other world/cp ranks are data parallel")
    ep: int = _f(0, "strategy", "ep, mesh: expert-parallel degree, ranks sharing one copy of the experts, carved "
                 "out of dp_shard as in torchtitan (--dp-shard 2 --ep 2 is 2 ranks) (-1: the ranks left; unset: -1 under "
                 "ep, 1 under mesh)")
    pp: int = _f(0, "strategy", "pp, pp_scratch, mesh: pipeline stages (-1: the ranks left; unset: -1 "
                 "under pp, 1 under mesh)")
    microbatches: int = _f(4, "strategy", "pp, pp_scratch, mesh: microbatches each data-parallel rank's rows are "
                           "cut into for the pipeline")
    pp_schedule: str = _f("1f1b", "strategy", "pp, pp_scratch, mesh: pipeline schedule", PP_SCHEDULES)
    pp_stages_per_rank: int = _f(0, "strategy", "pp, mesh: stages each rank holds under interleaved or zb (2 or "
                                 "more; 0: 2), torchtitan's virtual stages")
    pp_first_stage_less_layers: int = _f(0, "strategy", "pp, mesh: layers fewer on the first stage, which holds "
                                         "the embedding (torchtitan's; Llama 3 took 1)")
    pp_last_stage_less_layers: int = _f(0, "strategy", "pp, mesh: layers fewer on the last stage, which holds the "
                                        "output layer and the loss")
    steps: int = _f(20, "data and optimisation", "optimizer steps to train")
    batch_size: int = _f(8, "data and optimisation", "global batch in rows (sequences) per step, summed over "
                         "every rank: micro-batch x grad_accum x data-parallel ranks")
    grad_accum: int = _f(1, "data and optimisation", "micro-batches per rank per step (gradient accumulation)")
    lr: float = _f(3e-3, "data and optimisation", "peak learning rate of AdamW (betas 0.9, 0.95)")
    weight_decay: float = _f(0.0, "data and optimisation", "AdamW's decoupled weight decay")
    grad_clip: float = _f(1.0, "data and optimisation", "clip the global gradient norm to this; 0 disables")
    lr_schedule: str = _f("constant", "data and optimisation", "constant, or cosine decay to lr/10 at the last "
                          "step (after --warmup-steps)", LR_SCHEDULES)
    warmup_steps: int = _f(0, "data and optimisation", "steps of linear warmup from lr/warmup_steps")
    input_delay_ms: float = _f(0.0, "data and optimisation", "wait this long for every batch, inside the timed "
                               "step: a data loader that cannot keep up, emulated")
    seed: int = _f(0, "data and optimisation", "seeds the weights, the data order and every rank's RNGs")
    precision: str = _f("fp32", "precision and memory", "fp32; bf16 or fp16 autocast with fp32 weights "
                        "(fp16 adds loss scaling); fp8 or fp8-block: every linear's matmuls on FP8 operands, "
                        "emulated in fp32 (per-tensor scales, or DeepSeek-V3's tiles; labkit.device.fp8)",
                        TRAIN_PRECISIONS)
    activation_checkpointing: str = _f("none", "precision and memory", "recompute in backward: none, full, "
                                       "every:k (every k-th block), selective (op level: keep every matmul's output) or "
                                       "selective:alternate (keep every second one, as torchtitan)")
    tf32: bool = _f(False, "precision and memory", "cuda: fp32 matmuls on tensor cores in TF32 (10-bit mantissa)")
    deterministic: bool = _f(False, "precision and memory", "deterministic algorithms only (and cuBLAS's fixed "
                             "workspace): bit-exact reruns and resumes on GPUs too, at some speed")
    checkpoint_dir: str | None = _f(None, "checkpointing and preemption", "save checkpoints here and resume from "
                                    "the newest good one (labkit.fault_tolerance)")
    save_every: int = _f(0, "checkpointing and preemption", "steps between checkpoints; 0: only at the end and on "
                         "preemption")
    keep_last: int = _f(2, "checkpointing and preemption", "checkpoints to keep (the newest always)")
    async_save: bool = _f(False, "checkpointing and preemption", "block training only for the copy to host "
                          "memory; write in a background thread")
    resume: bool = _f(True, "checkpointing and preemption", "start from the newest good checkpoint in "
                      "--checkpoint-dir (--no-resume refuses a non-empty one)")
    restart_if_unusable: bool = _f(False, "checkpointing and preemption", "when --checkpoint-dir holds checkpoints "
                                   "and none verifies, start from step 0 anyway (default: stop and list them; "
                                   "nothing is deleted either way)")
    grace_s: float = _f(30.0, "checkpointing and preemption", "seconds from SIGTERM/SIGUSR1 to SIGKILL: finish "
                        "the step, save if it fits, exit 75 (requeue)")
    reserve_s: float = _f(2.0, "checkpointing and preemption", "seconds of --grace-s kept back for leaving "
                          "cleanly: a save that would eat into them is skipped")
    step_log: str | None = _f(None, "output", "append one JSON line per step, checkpoint, restore and preemption "
                              "(rank 0)")
    progress: bool | None = _f(None, "output", "a progress bar (default: in a notebook; on a terminal, for runs of "
                               "50 steps or more; LABKIT_PROGRESS=0|1 decides when set)")
    count_comm: str = _f("auto", "output", "count every collective's bytes: on every step, on the last only (the "
                         "others timed without the counter), or none; auto: every on CPU, last on CUDA",
                         ("auto", "every", "last", "none"))
    peak_tflops: float = _f(0.0, "output", "peak TFLOP/s of one device for MFU (0: the datasheet's, on a GPU the "
                            "table knows; on a CPU no MFU)")
    profile_steps: str = _f("", "output", "record steps A to B-1 with torch.profiler ('A:B'): one Chrome trace "
                            "per rank in --profile-dir, for Perfetto")
    profile_dir: str = _f("profile", "output", "where --profile-steps writes its traces")
    memory_snapshot: str | None = _f(None, "output", "cuda: record the allocator's history and write it to "
                                     "PATH.rank<r>.pickle for PyTorch's memory visualizer")
    return_params: bool = field(default=False, metadata={"group": None, "help": "return the full parameters "
                                                         "(gathered on every rank); not a CLI flag"})

    @property
    def pp_split(self):
        """The pipeline's split into stages (:class:`labkit.parallel.pipeline.stages.Split`)."""
        from labkit.parallel.pipeline.stages import Split

        return Split(self.pp_schedule, self.pp_stages_per_rank, self.pp_first_stage_less_layers,
                     self.pp_last_stage_less_layers)

    def __post_init__(self) -> None:
        for name in ("checkpoint_dir", "step_log", "profile_dir", "memory_snapshot"):
            if getattr(self, name) == "":  # an unset variable in a job script: never silently nothing
                raise ValueError(f"{name}='' is empty (an unset variable?): give a path, or leave it out")
        if self.strategy == "auto":  # degrees without a strategy: the layout they describe
            given = self.dp_replicate != 1 or any(getattr(self, d) for d in ("dp_shard", "tp", "pp", "cp", "ep"))
            self.strategy = "mesh" if given else "single"
        for name in ("steps", "batch_size", "grad_accum", "keep_last", "microbatches"):
            positive_count(name, getattr(self, name))
        for name in ("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep"):  # -1: the ranks the others leave
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < -1 or value > MAX_COUNT or (
                    name == "dp_replicate" and value == 0):
                raise ValueError(f"{name} must be a positive number of ranks or -1 (the ranks the other degrees "
                                 f"leave), got {value!r}")
        for name in ("warmup_steps", "save_every", "pp_stages_per_rank",
                     "pp_first_stage_less_layers", "pp_last_stage_less_layers"):
            at_most(name, non_negative_int(name, getattr(self, name)), MAX_COUNT, "past any run")
        non_negative_int("seed", self.seed)
        at_most("lr", positive_number("lr", self.lr), 1e3, "AdamW's steps are about lr each: it diverged long before")
        positive_number("bucket_cap_mb", self.bucket_cap_mb)
        at_most("weight_decay", non_negative_number("weight_decay", self.weight_decay), 1e3,
                "AdamW multiplies the weights by 1 - lr x weight_decay each step: past that they flip sign")
        non_negative_number("link_gbps", self.link_gbps)
        non_negative_number("link_latency_ms", self.link_latency_ms)
        if self.link_latency_ms and not self.link_gbps:
            raise ValueError(f"link_latency_ms={self.link_latency_ms:g} needs link_gbps > 0 (the emulated link)")
        non_negative_number("input_delay_ms", self.input_delay_ms)
        if self.input_delay_ms > 3.6e6:
            raise ValueError(f"input_delay_ms={self.input_delay_ms:g} is over an hour per batch; valid: 0 to 3.6e6")
        if self.seed >= 2 ** 63:
            raise ValueError(f"seed={self.seed} is too large; valid: 0 to 2**63 - 1")
        non_negative_number("grad_clip", self.grad_clip)
        one_of("pp_schedule", self.pp_schedule, PP_SCHEDULES, "pipeline schedules")
        one_of("lr_schedule", self.lr_schedule, LR_SCHEDULES, "schedules")
        one_of("precision", self.precision, TRAIN_PRECISIONS, "precisions")
        check_device(self.device, 1)
        try:
            parse_policy(self.activation_checkpointing)
        except ValueError as e:
            raise ValueError(f"activation_checkpointing: {e}") from None
        check_grace(self.grace_s, self.reserve_s)
        one_of("count_comm", self.count_comm, ("auto", "every", "last", "none"), "modes")
        non_negative_number("peak_tflops", self.peak_tflops)
        if self.profile_steps:
            parse_steps(self.profile_steps, self.steps)
        for name in ("tf32", "memory_snapshot"):
            if getattr(self, name) and self.device != "cuda":
                raise ValueError(f"{name} is not available with device={self.device!r}: it is a CUDA feature; leave it "
                                 "out on the CPU")
        check_config(self)  # what the chosen strategy takes, refuses, or cannot do


def defaults() -> dict[str, Any]:
    """Every field's default, by name."""
    return {f.name: f.default for f in fields(TrainConfig)}


def check_config(cfg: TrainConfig) -> None:
    """What no run of this strategy can do, refused before anything starts (``TrainConfig`` calls it)."""
    s = strategy(cfg.strategy)
    default = {f.name: f.default for f in fields(cfg)}
    for option in OPTIONS:
        if getattr(cfg, option) != default[option] and option not in s.options:
            raise ValueError(f"{option}={getattr(cfg, option)!r} has no effect with strategy={s.name!r}; it "
                             f"applies to strategy {' / '.join(map(repr, takes(option)))}")
    if cfg.precision not in s.precisions:
        raise ValueError(f"precision={cfg.precision!r} is not supported with strategy={s.name!r}; "
                         f"valid precisions: {list(s.precisions)}")
    if cfg.grad_accum > 1 and not s.grad_accum:
        raise ValueError(f"grad_accum={cfg.grad_accum} is not used with strategy={s.name!r}: its microbatches "
                         "are the accumulation; set grad_accum=1 and microbatches instead")
    if cfg.checkpoint_dir and s.cannot_checkpoint:
        raise ValueError(f"checkpoint_dir is not supported with strategy={s.name!r}: {s.cannot_checkpoint}")
    if s.pp_impl == "scratch" and cfg.pp_schedule == "interleaved":
        raise ValueError(f"pp_schedule='interleaved' needs torch pipelining (strategy 'pp'); the hand-written "
                         f"pipeline (strategy {s.name!r}) has 'gpipe' and '1f1b'")
    if s.deepspeed:
        _check_deepspeed(cfg, s)


def _check_deepspeed(cfg: TrainConfig, s: Strategy) -> None:
    if cfg.async_save:
        raise ValueError(f"async_save=True is not supported with strategy={s.name!r}: DeepSpeed writes its "
                         "checkpoints synchronously (engine.save_checkpoint); use async_save=False")
    if cfg.precision == "fp16" and cfg.device != "cuda":
        raise ValueError(f"precision='fp16' with strategy={s.name!r} needs device='cuda' (DeepSpeed's "
                         "fp16 optimizer); on CPU use precision='bf16' or strategy 'fsdp'")
    if s.zero_stage == 3 and cfg.activation_checkpointing.startswith("selective"):
        # Measured: with ZeRO-3's patched linear and gathering hooks, PyTorch's selective
        # recomputation drifted from the reference by 4e-4 in loss within 3 steps (and so does
        # any later selective run in the same process); DeepSpeed has no op-level policy.
        raise ValueError(f"activation_checkpointing={cfg.activation_checkpointing!r} is not supported with "
                         f"strategy={s.name!r}; use 'full' or 'every:k' (DeepSpeed's checkpointing), or strategy='fsdp'")
