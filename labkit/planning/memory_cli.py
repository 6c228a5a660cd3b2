"""``python -m labkit.planning memory``: memory per device, a strategy, and the price of a run, in a terminal.

    python -m labkit.planning memory --model llama2-70b --devices 8 --device-type a100-80gb
    python -m labkit.planning memory --model 10b --devices 256 --tokens 1e12 --device-type h100-80gb
    python -m labkit.planning memory --model llama2-70b --finetune qlora --lora-rank 16 --devices 1 --device-type h200
    python -m labkit.planning memory --model path/to/config.json --device-gb 48 --finetune lora --json
    python -m labkit.planning memory --hidden 4096 --layers 32 --heads 32 --kv-heads 8 --intermediate 14336 --devices 8
"""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict

from labkit.core.checks import at_most, positive_int, positive_number
from labkit.core.cli import ArgumentParser
from labkit.memory.architecture import FAMILIES, ModelShape
from labkit.memory.calculator import GB, MODELS, RECOMPUTE, estimate_memory, model_shape
from labkit.memory.finetune import FINETUNE, TRAINED_BYTES, estimate_finetune
from labkit.planning.accelerators import ACCELERATORS
from labkit.planning.choose import choose_strategy
from labkit.planning.commands import degrees, launch
from labkit.planning.cost import DEFAULT_PREEMPTIONS_PER_DAY, price_run
from labkit.planning.hardware import HARDWARE
from labkit.planning.memory_report import choose_finetune, report
from labkit.planning.published import spread

SHAPE_FLAGS = ("hidden", "layers", "heads", "kv_heads", "intermediate", "vocab", "experts", "experts_per_token")
# The largest value each shape flag takes, and why: far past any model trained, and small enough that
# a shape within them is counted and searched in seconds (the search's work grows with the layers and
# the experts: 10,000 layers took minutes), its parameters at most MAX_COUNT (ModelShape.from_dims).
SHAPE_LIMITS = {"hidden": (10**6, "the widest models trained are about 20,000 wide"),
                "layers": (1000, "the deepest are about 130 layers"),
                "heads": (10**6, "heads divide --hidden"), "kv_heads": (10**6, "key/value heads divide --heads"),
                "intermediate": (10**7, "MLPs are a few times --hidden"),
                "vocab": (10**7, "the largest vocabularies hold about 256,000 tokens"),
                "experts": (2 * 10**6, "the most published are about a million, PEER's"),
                "experts_per_token": (2 * 10**6, "at most --experts")}
LORA_FLAGS = ("lora_rank", "lora_targets", "lora_dropout")


def _shape_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model shape", "instead of --model: any transformer by its dimensions "
                             "(--hidden, --layers and --heads at least)")
    g.add_argument("--family", choices=FAMILIES, default=None, help="llama (SwiGLU MLP, RMSNorm, untied; the "
                   "default, also Mistral/Mixtral), qwen2 (llama + Q/K/V biases) or gpt (GPT-2: GELU 4h MLP, biases)")
    for flag, what in (("hidden", "hidden size"), ("layers", "transformer layers"), ("heads", "attention heads"),
                       ("kv-heads", "key/value heads (grouped-query attention; default: --heads)"),
                       ("intermediate", "MLP width (default: 4 x hidden for gpt, LLaMA's 8h/3 rounded up to 256 "
                                        "otherwise)"),
                       ("vocab", "vocabulary size (default 32000)"), ("experts", "MLP experts per layer (MoE; default 1)"),
                       ("experts-per-token", "experts each token runs through (default 2 with --experts)")):
        g.add_argument(f"--{flag}", type=int, default=None, help=what)
    g.add_argument("--tied-embeddings", action="store_true", help="output layer shares the token embedding "
                   "(the gpt family always does)")


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m labkit.planning memory", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help=f"a preset ({', '.join(sorted(MODELS))}; default llama2-7b) or a "
                   "Hugging Face config.json, or the folder holding it (llama, mistral, mixtral, qwen2, gpt2)")
    _shape_flags(p)
    p.add_argument("--devices", type=int, default=8, help="number of accelerators")
    # the devices the planner has a node model for (the datasheet table has more variants, for MFU)
    p.add_argument("--device-type", default=None, choices=sorted(HARDWARE), help="default a100-80gb")
    p.add_argument("--device-gb", type=float, default=None, help="device memory in GB (10^9 bytes), for any "
                   "device; overrides --device-type's (whose peak and prices --tokens still uses)")
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=None, help="default: the model's context length")
    p.add_argument("--precision", default=None, choices=list(TRAINED_BYTES), help="bytes/param of the trained "
                   "weights, gradients, Adam states: mixed (2, 2, 12; the default) ... bf16_adam32 (2, 2, 8: "
                   "QLoRA's bf16 adapters with fp32 moments, the default for --finetune qlora)")
    p.add_argument("--recompute", default="none", choices=list(RECOMPUTE))
    p.add_argument("--cp", type=int, default=1, help="context-parallel degree: each sequence split over this many "
                   "devices, activations divided by it (ring attention)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel degree (mixture-of-experts models): the "
                   "experts' weights and optimizer states divided over this many devices")
    f = p.add_argument_group("fine-tuning", "LoRA (Hu et al. 2021) and QLoRA (Dettmers et al. 2023): see "
                             "labkit.memory.finetune for the bytes of each kind")
    f.add_argument("--finetune", default=None, choices=FINETUNE, help="full (every weight trained), lora (bf16 "
                   "frozen base + adapters) or qlora (NF4 frozen base with double quantisation + adapters)")
    f.add_argument("--lora-rank", type=int, default=None, help="LoRA's r (default 16)")
    f.add_argument("--lora-targets", default=None, help="projections to adapt, comma-separated: q,k,v,o,gate,up,"
                   "down (gpt: qkv,o,up,down), or all (the default), attention, mlp")
    f.add_argument("--lora-dropout", action="store_true", help="count the inputs LoRA dropout keeps for backward")
    p.add_argument("--json", action="store_true", help="print the same result as one JSON object: fits, bytes per "
                   "device by kind, the recommendation with its degrees and the labkit.train command that runs it")
    p.add_argument("--train-device", choices=("cuda", "cpu"), default="cuda", help="where the printed labkit.train "
                   "command runs: cuda (one GPU per rank, NCCL) or cpu (gloo processes, to try a layout out)")
    p.add_argument("--tokens", type=float, default=None, help="training tokens, to price the run: steps of the "
                   "recommended layout (its global batch) x its predicted step (labkit.planning.step_model)")
    p.add_argument("--preemptions-per-day", type=float, default=DEFAULT_PREEMPTIONS_PER_DAY,
                   help="spot preemptions per 8-GPU instance per day (default: 10%% of instances interrupted "
                        "a month, the middle of AWS's bands; labkit.planning.cost.preemptions_per_day converts a band)")
    return p


def _check(a) -> None:
    """The flags' own checks, naming the flag (the calculator's messages name its parameters)."""
    positive_int("--devices", a.devices)
    positive_int("--micro-batch", a.micro_batch)
    positive_int("--cp", a.cp)
    positive_int("--ep", a.ep)
    if a.finetune and (a.cp > 1 or a.ep > 1):
        raise ValueError("--cp and --ep apply to training from scratch here, not to --finetune")
    for flag in ("seq_len", "lora_rank"):
        if getattr(a, flag) is not None:
            positive_int("--" + flag.replace("_", "-"), getattr(a, flag))
    check_shape_flags(a)
    if a.device_gb is not None:
        at_most("--device-gb", positive_number("--device-gb", a.device_gb), 1e6, "a million GB on one device")
    if a.tokens is not None:  # Llama 3 405B: 15.6e12 tokens
        at_most("--tokens", positive_number("--tokens", a.tokens), 1e15, "about 60 times Llama 3's training set")
    at_most("--preemptions-per-day", positive_number("--preemptions-per-day", a.preemptions_per_day), 1440,
            "one a minute")
    given = [f for f in LORA_FLAGS if getattr(a, f) not in (None, False)]
    if given and a.finetune is None:
        raise ValueError(f"--{given[0].replace('_', '-')} applies to --finetune lora or qlora")


def check_shape_flags(a) -> None:
    """Each shape flag given: a whole number of at least 1 (0 is not "the default") and at most its
    :data:`SHAPE_LIMITS`; a ValueError naming the flag otherwise."""
    for flag in SHAPE_FLAGS:
        if getattr(a, flag) is not None:
            name = "--" + flag.replace("_", "-")
            top, why = SHAPE_LIMITS[flag]
            at_most(name, positive_int(name, getattr(a, flag)), top, why)


def _shape(a) -> ModelShape:
    flags = [f for f in (*SHAPE_FLAGS, "family") if getattr(a, f) is not None] + (["tied_embeddings"]
                                                                               if a.tied_embeddings else [])
    if not flags:
        return model_shape(a.model or "llama2-7b")
    if a.model is not None:
        raise ValueError(f"--model and --{flags[0].replace('_', '-')}: give a model or its shape, not both")
    missing = [f"--{f}" for f in ("hidden", "layers", "heads") if getattr(a, f) is None]
    if missing:
        raise ValueError(f"a model shape needs --hidden, --layers and --heads; missing: {', '.join(missing)}")
    # `is None`, not `or`: a 0 given is the caller's mistake, refused by the checks, not the default
    experts = 1 if a.experts is None else a.experts
    return ModelShape.from_dims(a.family or "llama", a.hidden, a.layers, a.heads, 32000 if a.vocab is None else a.vocab,
                                4096 if a.seq_len is None else a.seq_len, a.kv_heads, a.intermediate, experts,
                                min(2, experts) if a.experts_per_token is None else a.experts_per_token,
                                tied=a.tied_embeddings or None, note="from the shape flags")


def _plan(a) -> dict:
    """Everything the command prints, computed first: a bad argument stops it before any output."""
    _check(a)
    shape = _shape(a)
    dev_type = a.device_type or "a100-80gb"
    dev = ACCELERATORS[dev_type]
    memory_gb = a.device_gb or dev.memory_gb
    name = dev.name if a.device_gb is None else (f"{dev.name} at {memory_gb:g} GB" if a.device_type else
                                                 "custom device")
    if a.finetune:
        lora = {"rank": a.lora_rank or 16, "targets": a.lora_targets or "all", "lora_dropout": a.lora_dropout}
        common = dict(micro_batch=a.micro_batch, seq_len=a.seq_len, precision=a.precision, **lora)
        stages = [estimate_finetune(shape, a.finetune, world_size=a.devices, stage=s, recompute=a.recompute,
                                    device_memory_gb=memory_gb, **common) for s in range(4)]
        if a.finetune == "full":  # what pretraining holds: the planner's layouts (TP, PP, offload) apply
            rec = choose_strategy(shape, a.devices, memory_gb, a.micro_batch, a.seq_len, device=dev_type)
        else:
            rec = choose_finetune(shape, a.finetune, a.devices, memory_gb, a.recompute, **common)
    else:
        precision = a.precision or "mixed"
        stages = [estimate_memory(shape, a.micro_batch, a.devices, s, precision, a.recompute,
                                  device_memory_gb=memory_gb, seq_len=a.seq_len, cp=a.cp, ep=a.ep) for s in range(4)]
        rec = choose_strategy(shape, a.devices, memory_gb, a.micro_batch, a.seq_len, device=dev_type)
    price = steps = None
    chosen = getattr(rec, "chosen", None)
    if a.tokens and chosen is not None:  # the recommended layout's steps at its predicted step time
        seq = a.seq_len or shape.seq_len
        steps = math.ceil(a.tokens / (chosen.plan.global_batch * seq))
        price = price_run(shape.n_params, a.tokens, a.devices, dev_type, recompute=_recompute(chosen.plan.recompute),
                          preemptions_per_instance_per_day=a.preemptions_per_day,
                          hours=steps * chosen.prediction["total"] / 3600)
    model_name = a.model or ("custom shape" if shape.note == "from the shape flags" else "llama2-7b")
    return {"name": model_name, "shape": shape, "device": dev, "device_type": dev_type, "device_name": name,
            "memory_gb": memory_gb, "stages": stages, "recommendation": rec, "price": price, "steps": steps,
            "finetune": a.finetune}


def _recompute(policy: str) -> str:  # what cost.training_flops counts: a whole forward again, or none
    return "full" if policy == "full" else "none"


def _print_finetune(a, r) -> None:
    first, rec = r["stages"][0], r["recommendation"]
    if a.finetune == "full":
        print(f"full fine-tuning: every weight trained ({first.precision}: {'+'.join(map(str, TRAINED_BYTES[first.precision]))} "
              "bytes/param of weights, gradients, Adam states)" + (" (--lora-* ignored)" if a.lora_rank or a.lora_targets else ""))
    else:
        base = "bf16 (2 bytes/param)" if a.finetune == "lora" else "NF4 + double quantisation (4.127 bits/param)"
        print(f"{a.finetune}: rank {first.rank} on {','.join(first.targets)}: {first.trainable_params / 1e6:,.1f} M trained "
              f"parameters ({first.trainable_params / r['shape'].n_params:.2%}); frozen base {base}; adapters "
              f"{first.precision} ({'+'.join(map(str, TRAINED_BYTES[first.precision]))} bytes/param)")
    print(f"{'stage':>6} {'frozen':>9} {'trained':>9} {'grads':>9} {'optim':>9} {'activ':>9} {'total GB':>9}  fits")
    for stage, e in enumerate(r["stages"]):
        cells = [*e.bytes_by_kind().values(), e.total]
        print(f"{stage:>6} " + " ".join(f"{c / GB:9.1f}" for c in cells) + f"  {'yes' if e.fits else 'no'}")
    print(f"\nrecommended: {rec.strategy or 'nothing fits'}\n  {rec.reason}")
    if a.finetune == "full":
        print(f"rule of thumb says {rec.rule_of_thumb}" + ("" if rec.rule_fits else " (which does not fit here)"))


def _planning_command(a, r) -> str:
    """The ``python -m labkit.planning layouts`` command for the same model, devices and global batch."""
    model = [f"--model {a.model}"] if a.model else [f"--{f.replace('_', '-')} {getattr(a, f)}" for f in SHAPE_FLAGS
                                                   if getattr(a, f) is not None]
    seq = [f"--seq-len {a.seq_len}"] if a.seq_len else []
    tokens = a.micro_batch * a.devices * (a.seq_len or r["shape"].seq_len)
    return " ".join(["python -m labkit.planning layouts", *model, *seq, f"--devices {a.devices}",
                     f"--device-type {r['device_type']}", f"--global-batch {tokens}"])


def _run(a, r) -> dict | None:
    """The recommended layout as a labkit.train run (None for LoRA, QLoRA, or when nothing fits)."""
    chosen = getattr(r["recommendation"], "chosen", None)
    if a.finetune in ("lora", "qlora") or chosen is None:
        return None
    out = launch(chosen.train_args, r["shape"], a.devices, device=a.train_device, steps=r["steps"])
    d = degrees(chosen.plan)
    return {"degrees": asdict(d), "degrees_label": d.label(), **out}


def _print_pretraining(a, r) -> None:
    rec, shape = r["recommendation"], r["shape"]
    print(f"{'stage':>6} {'params':>9} {'grads':>9} {'optim':>9} {'activ':>9} {'total GB':>9}  fits")
    for stage, e in enumerate(r["stages"]):
        cells = [e.params, e.grads, e.optimizer, e.activations + e.head, e.total]
        print(f"{stage:>6} " + " ".join(f"{c / GB:9.1f}" for c in cells) + f"  {'yes' if e.fits else 'no'}")
    seq = a.seq_len or shape.seq_len
    print(f"\nranked for {a.micro_batch} x {seq:,}-token sequence(s) per device, {a.micro_batch * a.devices:,} a step "
          f"(labkit.planning.step_model; bf16 mixed precision)")
    print(f"recommended: {rec.strategy or 'nothing fits'}\n  {rec.reason}")
    if rec.chosen is not None:
        s = spread(rec.chosen.plan)
        print(f"  published runs of its kind ({s['kind'] if s['same_kind'] else 'nearest: ' + s['kind']}, {s['n']}): "
              f"the model was {s['low']:+.0%}..{s['high']:+.0%} of what they measured")
    slower = rec.rule_slowdown()
    verdict = ("which does not fit here" if not rec.rule_fits else
               f"{slower:+.0%} a step" if slower is not None and abs(slower) >= 0.005 else "as fast")
    print(f"rule of thumb says {rec.rule_of_thumb}: {rec.rule.label} ({verdict})")
    print(f"  to rank layouts for another global batch: {_planning_command(a, r)}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    try:
        r = _plan(a)
    except ValueError as e:
        parser.error(str(e))
    run = _run(a, r)
    if a.json:
        print(json.dumps(report(r, a) | {"run": run}, indent=2))
        return 0
    shape, c = r["shape"], r["price"]
    active = f" ({shape.active_params / 1e9:.2f} B active)" if shape.experts > 1 else ""
    print(f"{r['name']}: {shape.n_params / 1e9:.2f} B parameters{active}, {shape.n_layer} layers, hidden "
          f"{shape.hidden}; {a.devices} x {r['device_name']} ({r['memory_gb']:g} GB)")
    if a.finetune:
        _print_finetune(a, r)
    else:
        _print_pretraining(a, r)
    if run is not None:
        print(f"\nrun it ({run['degrees_label']}):\n  {run['command']}")
        if run["nodes"] > 1:
            print(f"  or under Slurm:\n  {run['sbatch']}")
        if run["warning"]:
            print(f"  note: {run['warning']}")
    if c is not None:
        chosen, dev = r["recommendation"].chosen, r["device"]
        print(f"\n{a.tokens:.3g} tokens: {r['steps']:,} steps of {chosen.plan.global_batch:,} x {shape.seq_len:,} tokens "
              f"at {chosen.prediction['total']:.2f} s predicted: {c.hours:,.0f} h on {a.devices} devices "
              f"({c.gpu_hours:,.0f} GPU-hours, {c.mfu:.0%} MFU of 6ND)")
        print(f"  on demand ${c.cost_on_demand:,.0f} at ${dev.price_on_demand}/GPU-h (assumed)")
        print(f"  spot ${c.cost_spot:,.0f} at ${dev.price_spot}/GPU-h (assumed): a preemption every "
              f"{c.mtbf_hours:.1f} h, checkpoints every {c.checkpoint_interval_hours * 60:.0f} min, "
              f"{c.spot_hours:,.0f} h expected")
    elif a.tokens and a.finetune in ("lora", "qlora"):
        print("\n--tokens: not priced for LoRA or QLoRA: the step model has no frozen base (no weight gradients)")
    return 0
