"""``python -m labkit.memory``: memory per device, a strategy, and the price of a run, in a terminal.

    python -m labkit.memory --model llama2-70b --devices 8 --device-type a100-80gb
    python -m labkit.memory --model 10b --devices 256 --tokens 1e12 --device-type h100-80gb --spot
"""
from __future__ import annotations

import argparse

from labkit.core.checks import fraction, positive_int, positive_number
from labkit.core.cli import ArgumentParser
from labkit.memory.calculator import (
    BYTES_PER_PARAM,
    GB,
    MODELS,
    RECOMPUTE,
    estimate_memory,
    model_shape,
)
from labkit.planning.accelerators import ACCELERATORS
from labkit.planning.choose import choose_strategy
from labkit.planning.cost import DEFAULT_PREEMPTIONS_PER_DAY, price_run


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m labkit.memory", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama2-7b", choices=sorted(MODELS))
    p.add_argument("--devices", type=int, default=8, help="number of accelerators")
    p.add_argument("--device-type", default="a100-80gb", choices=sorted(ACCELERATORS))
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=None, help="default: the model's context length")
    p.add_argument("--precision", default="mixed", choices=list(BYTES_PER_PARAM))
    p.add_argument("--recompute", default="none", choices=list(RECOMPUTE))
    p.add_argument("--tokens", type=float, default=None, help="training tokens, to price the run")
    p.add_argument("--mfu", type=float, default=None, help="model FLOPs utilisation you expect: of the model's "
                   "6ND, recomputation not counted (default 0.4)")
    p.add_argument("--hfu", type=float, default=None, help="or hardware FLOPs utilisation: of every FLOP the "
                   "devices run, 8ND with --recompute full")
    p.add_argument("--preemptions-per-day", type=float, default=DEFAULT_PREEMPTIONS_PER_DAY,
                   help="spot preemptions per 8-GPU instance per day (default: 10%% of instances interrupted "
                        "a month, the middle of AWS's bands; labkit.planning.cost.preemptions_per_day converts a band)")
    return p


def _check(a) -> None:
    """The flags' own checks, naming the flag (the calculator's messages name its parameters)."""
    positive_int("--devices", a.devices)
    positive_int("--micro-batch", a.micro_batch)
    if a.seq_len is not None:
        positive_int("--seq-len", a.seq_len)
    for flag in ("mfu", "hfu"):
        if getattr(a, flag) is not None:
            fraction(f"--{flag}", getattr(a, flag), low_open=True)
    if a.mfu is not None and a.hfu is not None:
        raise ValueError("--mfu and --hfu: give one; the other follows from it and --recompute")
    if a.tokens is not None:
        positive_number("--tokens", a.tokens)
    positive_number("--preemptions-per-day", a.preemptions_per_day)


def _plan(a) -> dict:
    """Everything the command prints, computed first: a bad argument stops it before any output."""
    _check(a)
    shape, dev = model_shape(a.model), ACCELERATORS[a.device_type]
    stages = [estimate_memory(shape, a.micro_batch, a.devices, stage, a.precision, a.recompute,
                              device_memory_gb=dev.memory_gb, seq_len=a.seq_len) for stage in range(4)]
    rec = choose_strategy(shape, a.devices, dev.memory_gb, a.micro_batch, a.seq_len, a.precision)
    price = None
    if a.tokens:
        price = price_run(shape.n_params, a.tokens, a.devices, a.device_type, a.mfu, a.recompute,
                          preemptions_per_instance_per_day=a.preemptions_per_day, hfu=a.hfu)
    return {"shape": shape, "device": dev, "stages": stages, "recommendation": rec, "price": price}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    try:
        r = _plan(a)
    except ValueError as e:
        parser.error(str(e))
    shape, dev, rec, c = r["shape"], r["device"], r["recommendation"], r["price"]
    print(f"{a.model}: {shape.n_params / 1e9:.2f} B parameters, {shape.n_layer} layers, hidden {shape.hidden}; "
          f"{a.devices} x {dev.name} ({dev.memory_gb:g} GB)")
    print(f"{'stage':>6} {'params':>9} {'grads':>9} {'optim':>9} {'activ':>9} {'total GB':>9}  fits")
    for stage, e in enumerate(r["stages"]):
        cells = [e.params, e.grads, e.optimizer, e.activations + e.head, e.total]
        print(f"{stage:>6} " + " ".join(f"{c / GB:9.1f}" for c in cells) + f"  {'yes' if e.fits else 'no'}")
    print(f"\nrecommended: {rec.strategy or 'nothing fits'}\n  {rec.reason}")
    print(f"rule of thumb says {rec.rule_of_thumb}" + ("" if rec.rule_fits else " (which does not fit here)"))
    if c is not None:
        print(f"\n{c.model_flops:.3g} model FLOPs ({c.flops:.3g} run, with recomputation) at {c.mfu:.0%} MFU "
              f"({c.hfu:.0%} HFU): {c.hours:,.0f} h on {a.devices} devices ({c.gpu_hours:,.0f} GPU-hours)")
        print(f"  on demand ${c.cost_on_demand:,.0f} at ${dev.price_on_demand}/GPU-h (assumed)")
        print(f"  spot ${c.cost_spot:,.0f} at ${dev.price_spot}/GPU-h (assumed): a preemption every "
              f"{c.mtbf_hours:.1f} h, checkpoints every {c.checkpoint_interval_hours * 60:.0f} min, "
              f"{c.spot_hours:,.0f} h expected")
    return 0
