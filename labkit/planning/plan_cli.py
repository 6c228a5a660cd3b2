"""``python -m labkit.planning``: the layouts that fit a global batch, ranked by predicted step time.

    python -m labkit.planning --model llama3-405b --devices 16384 --device-type h100-80gb --global-batch 16M
    python -m labkit.planning --model llama3-8b --devices 64 --device-type a100-80gb --global-batch 512k --top 3
    python -m labkit.planning --hidden 4096 --layers 32 --heads 32 --kv-heads 8 --devices 8 --global-batch 1M
    python -m labkit.planning --published
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re

from labkit.core.checks import at_most, positive_count, positive_int, positive_number
from labkit.core.cli import ArgumentParser
from labkit.planning.cli import _shape, _shape_flags
from labkit.planning.hardware import HARDWARE, hardware
from labkit.planning.published import compare, compare_memory, median_abs_error
from labkit.planning.search import search, why

# Binary, as batch sizes in tokens are quoted: Llama 3's "16M" is 2,048 sequences of 8,192 = 2^24.
SUFFIX = {"": 1, "k": 2**10, "K": 2**10, "m": 2**20, "M": 2**20, "g": 2**30, "G": 2**30}


def tokens(text: str) -> int:
    """``16M`` (2^24), ``512k`` (2^19), ``4e6`` or ``4194304`` tokens, as an integer."""
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([kKmMgG]?)\s*", str(text))
    try:
        value = float(m[1]) * SUFFIX[m[2]] if m else float("nan")
    except ValueError:
        value = float("nan")
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"--global-batch={text!r} must be a positive number of tokens, such as 4M, 512k or 4e6")
    return int(value)


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m labkit.planning", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a preset (labkit.memory.MODELS: llama3-8b, llama3-70b, "
                   "llama3-405b, gpt3-175b, ...) or a Hugging Face config.json; default llama3-8b")
    _shape_flags(p)
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the model's)")
    p.add_argument("--devices", type=int, default=8, help="number of accelerators")
    p.add_argument("--device-type", default="h100-80gb", choices=sorted(HARDWARE))
    p.add_argument("--device-gb", type=float, default=None, help="memory per device, GB (default: the device's)")
    p.add_argument("--global-batch", default=None, help="tokens per optimizer step, e.g. 4M (k and M are "
                   "2^10 and 2^20; default: 512 sequences)")
    p.add_argument("--top", type=int, default=5, help="how many layouts to print")
    p.add_argument("--published", action="store_true", help="instead: the model against published runs")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    return p


def _published(as_json: bool) -> int:
    rows, memory = compare(), compare_memory()
    if as_json:
        print(json.dumps({"runs": rows, "median_abs_error": median_abs_error(rows), "memory": memory}, indent=1))
        return 0
    print(f"{'run':36} {'unit':>14} {'published':>10} {'predicted':>10} {'error':>7} {'MFU':>6}")
    for r in rows:
        unit = "TFLOP/s/GPU" if r["unit"] == "tflops" else "tokens/s/GPU"
        print(f"{r['run']:36} {unit:>14} {r['measured']:>10,.0f} {r['predicted']:>10,.0f} "
              f"{r['error'] * 100:>+6.1f}% {r['mfu'] * 100:>5.1f}%")
    print(f"median |error| {median_abs_error(rows) * 100:.1f}% over {len(rows)} runs "
          "(sources and assumptions: labkit.planning.published)")
    print(f"\n{'peak memory per GPU':36} {'published':>14} {'predicted':>10} {'error':>7}")
    for r in memory:
        print(f"{r['run']:36} {r['measured_gib']:>10.1f} GiB {r['predicted_gib']:>6.1f} GiB {r['error'] * 100:>+6.1f}%")
    print("(published: the allocator's peak reservation; predicted: live tensors at the peak)")
    return 0


MAX_DEVICES = 10**6


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    if a.published:
        return _published(a.json)
    try:
        # the search enumerates the divisors of the device count: a million devices takes seconds
        at_most("--devices", positive_int("--devices", a.devices), MAX_DEVICES, "the largest runs use ~1e5")
        positive_int("--top", a.top)
        if a.device_gb is not None:
            at_most("--device-gb", positive_number("--device-gb", a.device_gb), 1e6, "a million GB on one device")
        shape = _shape(argparse.Namespace(**{**vars(a), "model": a.model if any(
            getattr(a, f) is not None for f in ("hidden", "layers", "heads")) else (a.model or "llama3-8b")}))
        if a.seq_len is not None:
            shape = dataclasses.replace(shape, seq_len=positive_count("--seq-len", a.seq_len))
        batch = tokens(a.global_batch) if a.global_batch is not None else 512 * shape.seq_len
        positive_count("--global-batch" if a.global_batch is not None else "the default --global-batch "
                       "(512 sequences of --seq-len)", batch)
        if batch % shape.seq_len:
            raise ValueError(f"--global-batch={a.global_batch} must be a whole number of {shape.seq_len}-token "
                             f"sequences (for example {max(1, batch // shape.seq_len) * shape.seq_len:,})")
    except ValueError as e:
        parser.error(str(e))
    hw = hardware(a.device_type)
    from labkit.planning.accelerators import accelerator

    memory_gb = a.device_gb or accelerator(a.device_type).memory_gb
    ranked = search(shape, hw, a.devices, batch, memory_gb)
    top = ranked[:a.top]
    if a.json:
        print(json.dumps({"layouts": [{"label": r.label, "prediction": r.prediction, "memory_bytes": r.memory_bytes,
                                       "train_args": r.train_args} for r in top]}, indent=1))
        return 0
    print(f"{shape.note or 'model'}: {shape.n_params / 1e9:.1f}B parameters, {a.devices:,} x {hw.name}, "
          f"{batch:,} tokens a step ({batch // shape.seq_len:,} sequences of {shape.seq_len:,})")
    if not top:
        print("no layout fits: more devices, a smaller global batch or more memory per device")
        return 0
    print(f"{'#':>2} {'layout':58} {'step s':>7} {'MFU':>6} {'tok/s/GPU':>10} {'GB/GPU':>7}")
    for i, r in enumerate(top, 1):
        p = r.prediction
        print(f"{i:>2} {r.label:58} {p['total']:>7.2f} {p['mfu'] * 100:>5.1f}% {p['tokens_per_s_per_device']:>10,.0f} "
              f"{r.memory_bytes / 1e9:>7.1f}")
    if len(top) > 1:
        print(f"#1 over #2: {why(top[0], top[1])}")
    print("run #1: torchrun ... -m labkit.train " + " ".join(top[0].train_args))
    print("predicted by labkit.planning.step_model with the constants (and sources) of labkit.planning.hardware")
    return 0
