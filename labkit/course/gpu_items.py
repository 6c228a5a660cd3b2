"""What ``python -m labkit.gpu_check`` checks, one function per item (:mod:`labkit.course.gpu_check` runs them).

* ``environment`` (in :mod:`labkit.course.gpu_machine`): versions, every GPU's name, SMs, memory, MIG
  mode and datasheet, what torch.compile needs, the optional packages.
* ``strategies``: every strategy of :data:`labkit.train.STRATEGIES` on all the node's GPUs (tensor and
  pipeline degrees that fit), each loss curve held against one process on the same data; on one GPU
  none (each would train without a collective; ``fsdp2`` is FSDP2 itself on one rank).
* ``precision``: bf16 and fp16 autocast (fp16 with loss scaling), FSDP2's bf16 parameters, TF32
  matmuls, each against its single-process twin and against fp32 (on one GPU: one process's).
* ``speed``: the GPT at GPT-2 small's shape in bf16 on one GPU: tokens/s and MFU against the
  datasheet peak (:mod:`labkit.planning.accelerators`), and the CUDA allocator's bytes after a
  step against the memory calculator's model states.
* ``determinism``: ``deterministic=True`` run twice, and a run stopped half-way and resumed from its
  checkpoint: equal bit for bit, and what determinism costs in step time.

Each returns :class:`Item` records. A package an item needs and the machine lacks makes it ``skip``
with the package's name, never a traceback; anything else that goes wrong is a ``fail`` with one line.
"""
from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass, field, replace
from typing import Any

# Every package outside the standard library that labkit or a lab may import, but the training loop
# does not need: the GPU image may lack any of them (NOTES.md: it has torch and numpy).
OPTIONAL = ("numpy", "matplotlib", "pandas", "deepspeed", "papermill", "jupytext", "myst_nb", "nbformat", "tqdm",
            "cloudpickle", "xxhash", "peft", "trl", "bitsandbytes", "submitit")
# Loss agreement over a few steps. fp32 on GPUs sums in other orders than one process does (and
# than on CPU), so the bar sits above the CPU tests' 1e-5; 16-bit autocast rounds every matmul.
LOSS_TOL = {"fp32": 1e-4, "16-bit": 1e-2, "vs fp32": 5e-2}
MEMORY_TOL = 0.05  # CUDA allocator vs the calculator's model states (the 5%)
MFU_GOAL = 0.45
# labkit.planning.cost.flops_per_token, as every run's MFU counts: PaLM's would count all the scores
MFU_CONVENTION = "6 FLOPs per parameter + the causal half of 12 L h s per token"
# What every strategy's metrics must carry (the run's, and each rank's)
RUN_KEYS = ("tokens_per_s", "median_step_s", "model_tflops_per_s", "mfu", "hfu", "peak_tflops", "step_time_s")
RANK_KEYS = ("peak_memory_bytes", "cuda_allocated_after_step", "model_state_bytes")


@dataclass
class Item:
    name: str
    status: str  # "pass", "fail" or "skip"
    detail: str  # one line: for a failure, its cause
    figures: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    error: str = ""  # a failure's whole error: the failing rank's traceback, or the lab's


@dataclass(frozen=True)
class Setting:
    """Where the check runs: ``device`` ("cuda", or "cpu" to check the check itself), ``world`` ranks."""

    device: str
    world: int
    steps: int
    strategies: tuple[str, ...] | None = None  # None: every strategy


# Where each finished Item goes as soon as it is done (the check's parent process reads them from a
# child's output as they come: an item stopped at its time budget keeps the parts it finished)
SINK = None
_SENT: set[int] = set()


def emit(items: list[Item]) -> list[Item]:
    """Hand ``items`` to :data:`SINK` (each once); return them."""
    for it in items:
        if SINK is not None and id(it) not in _SENT:
            _SENT.add(id(it))
            SINK(it)
    return items


def has(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def _version(package: str) -> str | None:
    if not has(package):
        return None
    try:
        from importlib.metadata import version

        return version(package.replace("_", "-"))
    except Exception:  # noqa: BLE001 - a package without metadata still imports
        return "present"


def model_for(s: Setting):
    """The check's GPT: layers for one pipeline stage per rank, heads that every degree up to 8 divides."""
    from labkit.core.model import GPTConfig

    if s.device == "cpu":
        return GPTConfig(n_layer=max(2, s.world), n_head=4, n_embd=64, block_size=32)
    return GPTConfig(n_layer=max(4, s.world), n_head=8, n_embd=512, block_size=256)


def _divisor(n: int, limit: int) -> int:
    return max(d for d in range(1, limit + 1) if limit % d == 0 and n % d == 0)


def strategy_configs(s: Setting) -> tuple[dict, list[str]]:
    """``{strategy: TrainConfig}`` for every strategy this node can run, and lines naming the others."""
    from labkit.train import STRATEGIES, TrainConfig

    cfg_model = model_for(s)
    base = TrainConfig(device=s.device, steps=s.steps, batch_size=8 * s.world, lr=3e-3, seed=0, count_comm="none")
    configs, skipped = {}, []
    for name, spec in STRATEGIES.items():
        if name == "single" or (s.strategies and name not in s.strategies):
            continue
        if s.world < 2:  # fsdp too: on one rank labkit trains without FSDP2 (the item "fsdp2 alone" wraps it)
            skipped.append(f"{name}: needs >= 2 GPUs (on one it runs without a single collective"
                           + ("; see the item 'fsdp2 alone')" if name == "fsdp" else ")"))
            continue
        if spec.deepspeed and not has("deepspeed"):
            skipped.append(f"{name}: needs the package 'deepspeed'")
            continue
        extra: dict = {}
        if "tp" in spec.options:
            extra["tp"] = _divisor(cfg_model.n_head, s.world)
            if name == "tp_scratch" and extra["tp"] != s.world:
                skipped.append(f"{name}: needs tp = world size, and {s.world} does not divide the heads")
                continue
        if "pp" in spec.options:
            extra.update(pp=s.world, microbatches=2 * s.world, pp_schedule="1f1b")
        if name == "hsdp":
            if s.world % 2:
                skipped.append(f"{name}: needs an even number of ranks (two replicas), and there are {s.world}")
                continue
            extra["dp_replicate"] = 2
        if ("ep", "ep") in spec.degrees and len(spec.degrees) == 1:  # the experts item trains it
            skipped.append(f"{name}: trains a mixture-of-experts model; see the item 'experts'")
            continue
        if len(spec.degrees) > 1:  # any layout: the composing lab's, fitted to this node
            from labkit.labs.parameters import fit_layout

            extra = dict(fit_layout(s.world, cfg_model.n_head, cfg_model.n_layer), microbatches=2 * s.world)
        configs[name] = replace(base, strategy=name, **extra)
    return configs, skipped


def _max_dev(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b)) if a and len(a) == len(b) else float("inf")


def strategies(s: Setting) -> list[Item]:
    from labkit.launch import launch
    from labkit.train import TrainConfig, train, train_many

    configs, skipped = strategy_configs(s)
    model, runs = model_for(s), []
    if configs:  # on one GPU none: no reference to train, no rank to start
        ref = train(TrainConfig(device=s.device, steps=s.steps, batch_size=8 * s.world, lr=3e-3, seed=0), model)
        runs = launch(train_many, list(configs.values()), model, world_size=s.world, device=s.device, quiet=True,
                      timeout=1200)[0]
    items = []
    for (name, cfg), run in zip(configs.items(), runs):
        dev = _max_dev(run["loss"], ref["loss"])
        layout = {k: run[k] for k in ("tp", "dp", "pp") if k in run}
        where = " ".join([f"{s.world} rank(s)", *(f"{k}={v}" for k, v in layout.items())])
        missing = [k for k in RUN_KEYS if k not in run] + [k for k in RANK_KEYS for r in run["ranks"] if k not in r]
        items.append(Item(f"strategy {name}", "pass" if dev < LOSS_TOL["fp32"] and not missing else "fail",
                          f"{where}: max |loss - one process| {dev:.1e} over {s.steps} steps (bar {LOSS_TOL['fp32']:g})"
                          + (f"; metrics lack {sorted(set(missing))}" if missing else ""),
                          {"max_loss_dev": dev, "loss": run["loss"], "tokens_per_s": run["tokens_per_s"], **layout}))
    items += [Item(f"strategy {line.split(':')[0]}", "skip", line.split(": ", 1)[1]) for line in skipped]
    return items


# item -> (strategy, TrainConfig fields, bar against one process in the same precision)
PRECISIONS = {
    "bf16 autocast (ddp)": ("ddp", dict(precision="bf16"), LOSS_TOL["16-bit"]),
    "fp16 autocast + loss scaling (ddp)": ("ddp", dict(precision="fp16"), LOSS_TOL["16-bit"]),
    "fp16 autocast + loss scaling (fsdp)": ("fsdp", dict(precision="fp16"), LOSS_TOL["16-bit"]),
    "bf16 parameters (fsdp)": ("fsdp", dict(precision="bf16", fsdp_bf16=True), LOSS_TOL["16-bit"]),
    # DeepSpeed's bf16 casts the weights (LayerNorm and loss run in bf16): its own recipe, held to fp32's bar
    "bf16 (DeepSpeed zero2)": ("zero2", dict(precision="bf16"), LOSS_TOL["vs fp32"]),
    # DeepSpeed's fp16: fp16 weights, fp32 master copies, its own dynamic loss scaler (CUDA only)
    "fp16 + loss scaling (DeepSpeed zero2)": ("zero2", dict(precision="fp16"), LOSS_TOL["vs fp32"]),
    "tf32 matmuls (ddp)": ("ddp", dict(tf32=True), LOSS_TOL["16-bit"]),
    # Recomputation changes no number: its twin is the same precision without it (one GPU exercises it too)
    "full recomputation, bf16 autocast (fsdp)": ("fsdp", dict(precision="bf16", activation_checkpointing="full"),
                                                 LOSS_TOL["16-bit"]),
}


def precision(s: Setting) -> list[Item]:
    from labkit.launch import launch
    from labkit.train import TrainConfig, train, train_many

    model = model_for(s)
    base = TrainConfig(device=s.device, steps=s.steps, batch_size=8 * s.world, lr=3e-3, seed=0, count_comm="none")
    items, cases = [], {}
    for name, (strat, extra, _) in PRECISIONS.items():
        if s.world == 1 and strat != "ddp":  # FSDP2 and DeepSpeed would not shard; ddp's rows run as one process
            items.append(Item(f"precision {name}", "skip", "needs >= 2 GPUs (on one, nothing is sharded"
                              + ("; the item 'fsdp2 alone' runs FSDP2's bf16 parameters)" if strat == "fsdp" else ")")))
        elif extra.get("tf32") and s.device != "cuda":
            items.append(Item(f"precision {name}", "skip", "needs CUDA (TF32 is a CUDA feature)"))
        elif strat == "zero2" and extra["precision"] == "fp16" and s.device != "cuda":
            items.append(Item(f"precision {name}", "skip", "needs CUDA (DeepSpeed's fp16 optimizer)"))
        elif strat == "zero2" and not has("deepspeed"):
            items.append(Item(f"precision {name}", "skip", "needs the package 'deepspeed'"))
        else:
            cases[name] = replace(base, strategy=strat if s.world > 1 else "single", **extra)
    fp32 = train(base, model)["loss"]
    # One process in the same precision (TF32 and autocast included; FSDP2's bf16 parameters and
    # DeepSpeed's bf16 weights are their own recipes: their twin is bf16 autocast)
    refs = {n: train(replace(base, precision=c.precision, tf32=c.tf32), model)["loss"] for n, c in cases.items()}
    runs = launch(train_many, list(cases.values()), model, world_size=s.world, device=s.device, quiet=True,
                  timeout=1200)[0]
    for (name, cfg), run in zip(cases.items(), runs):
        twin, drift, bar = _max_dev(run["loss"], refs[name]), _max_dev(run["loss"], fp32), PRECISIONS[name][2]
        ok = twin < bar and drift < LOSS_TOL["vs fp32"]
        label = name if s.world > 1 else name.replace("(ddp)", "(one process)")  # on one GPU: its drift only
        items.append(Item(f"precision {label}", "pass" if ok else "fail",
                          f"max |loss - one process, same precision| {twin:.1e} (bar {bar:g}); "
                          f"|loss - fp32| {drift:.1e} (bar {LOSS_TOL['vs fp32']:g})",
                          {"max_loss_dev": twin, "max_dev_vs_fp32": drift}))
    return items


def speed(s: Setting) -> list[Item]:
    """One GPU, bf16 autocast, TF32 on: the GPT at GPT-2 small's shape (the labs' ``gpu`` model)."""
    from labkit.core.model import GPT, GPTConfig
    from labkit.memory.calculator import model_state_breakdown
    from labkit.train import TrainConfig, train

    cuda = s.device == "cuda"
    model = GPTConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024) if cuda else model_for(s)
    cfg = TrainConfig(device=s.device, steps=max(s.steps, 12) if cuda else s.steps, batch_size=16 if cuda else 8,
                      lr=6e-4, precision="bf16", tf32=cuda, count_comm="none")
    r = train(cfg, model)
    n = GPT.count_params(model)
    predicted = model_state_breakdown(n, 1, 0, "fp32").total  # fp32 master weights, grads and AdamW states
    measured = r["ranks"][0]["model_state_bytes"]["total"]
    allocated = r["ranks"][0]["cuda_allocated_after_step"][-1]
    mem_err = abs(allocated / predicted - 1) if allocated else None  # None on CPU
    figs = {k: r[k] for k in ("tokens_per_s", "median_step_s", "model_tflops_per_s", "mfu", "hfu", "peak_tflops")}
    figs |= {"n_params": n, "batch_size": cfg.batch_size, "block_size": model.block_size,
             "peak_memory_bytes": r["ranks"][0]["peak_memory_bytes"], "predicted_model_state_bytes": predicted,
             "measured_model_state_bytes": measured, "cuda_allocated_after_step": allocated,
             "memory_rel_err": mem_err}
    mfu = r["mfu"]
    speed_line = f"{r['tokens_per_s']:,.0f} tokens/s, {r['model_tflops_per_s']:.1f} model TFLOP/s"
    if mfu is not None:
        speed_line += (f", MFU {mfu:.1%} of {r['peak_tflops']:g} TFLOP/s ({MFU_CONVENTION}; "
                       f"{r['mfu_palm']:.1%} counting every score, as PaLM, Megatron-LM and torchtitan publish): "
                       f"goal {MFU_GOAL:.0%} " + ("met" if mfu >= MFU_GOAL else "NOT met"))
    figs["mfu_convention"] = MFU_CONVENTION
    shape = "GPT-2 small's shape" if cuda else "the CPU check's small GPT"
    items = [Item("speed", "pass" if r["tokens_per_s"] else "fail",
                  f"{shape}, {n / 1e6:.1f} M parameters, bf16, batch {cfg.batch_size} x {model.block_size}: "
                  f"{speed_line}", figs)]
    # What the memory chapter's calculator says one process holds, against the CUDA allocator (on a
    # CPU, against the bytes of the tensors themselves: :func:`labkit.memory.probe.measured_model_states`)
    held, what = (allocated, "CUDA allocated after a step") if allocated else (measured, "tensor bytes after a step")
    err = abs(held / predicted - 1)
    items.append(Item("memory vs calculator", "pass" if err <= MEMORY_TOL else "fail",
                      f"{what} {held / 2**30:.4f} GiB vs model states {predicted / 2**30:.4f} GiB (16 B/parameter): "
                      f"{err:.1%} off (bar {MEMORY_TOL:.0%})"))
    return items


def determinism(s: Setting) -> list[Item]:
    """``deterministic=True`` twice and a run killed half-way and resumed: equal bit for bit, and the
    speed that determinism costs against the default algorithms (on GPUs: atomics in backward kernels)."""
    import tempfile

    from labkit.train import TrainConfig, train

    model = model_for(s)
    base = TrainConfig(device=s.device, steps=2 * s.steps, batch_size=8, lr=3e-3, seed=0, count_comm="none",
                       precision="bf16" if s.device == "cuda" else "fp32")
    det = replace(base, deterministic=True)
    free, a, b = train(base, model), train(det, model), train(det, model)
    with tempfile.TemporaryDirectory() as d:
        train(replace(det, steps=s.steps, checkpoint_dir=d), model)  # stopped half-way: a checkpoint at the end
        resumed = train(replace(det, checkpoint_dir=d), model)
    rerun_equal = a["loss"] == b["loss"]
    resume_equal = resumed["loss"] == a["loss"] and resumed["start_step"] == s.steps
    cost = a["median_step_s"] / free["median_step_s"] if free["median_step_s"] else None
    return [Item("determinism", "pass" if rerun_equal and resume_equal else "fail",
                 f"two deterministic runs {'equal' if rerun_equal else 'DIFFER'} bit for bit; resumed at step "
                 f"{resumed['start_step']}: {'equal' if resume_equal else 'DIFFERS'}; step time x{cost:.2f} of the "
                 "default algorithms", {"rerun_equal": rerun_equal, "resume_equal": resume_equal,
                                         "step_time_ratio": cost, "default_run_differs": free["loss"] != a["loss"]})]


def log(line: str) -> None:
    print(line, flush=True, file=sys.stdout)
