"""``python -m labkit.planning layouts``: the layouts that fit a global batch, ranked by predicted step time.

    python -m labkit.planning layouts --model llama3-405b --devices 16384 --device-type h100-80gb --global-batch 16M
    python -m labkit.planning layouts --model llama3-8b --devices 64 --device-type a100-80gb --global-batch 512k --top 3
    python -m labkit.planning layouts --hidden 4096 --layers 32 --heads 32 --kv-heads 8 --devices 8 --global-batch 1M
    python -m labkit.planning layouts --published
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re

from labkit.core.checks import at_most, positive_count, positive_int, positive_number
from labkit.core.cli import ArgumentParser
from labkit.planning.memory_cli import _shape, _shape_flags, check_shape_flags
from labkit.planning.accelerators import accelerator
from labkit.planning.commands import launch
from labkit.planning.hardware import HARDWARE, hardware
from labkit.planning.published import compare, compare_memory, median_abs_error, spread
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
    p = ArgumentParser(prog="python -m labkit.planning layouts", description=__doc__.splitlines()[0])
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
    p.add_argument("--headroom", type=float, default=0.1, help="share of device memory kept free for temporaries, "
                   "communication buffers and fragmentation (default 0.1)")
    p.add_argument("--train-device", choices=("cuda", "cpu"), default="cuda", help="where the printed command runs: "
                   "cuda (one GPU per rank, NCCL) or cpu (gloo processes, to try a layout out)")
    p.add_argument("--published", action="store_true", help="instead: the model against published runs")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    return p


def _published(as_json: bool) -> int:
    rows, memory = compare(), compare_memory()
    if as_json:
        print(json.dumps({"runs": rows, "median_abs_error": median_abs_error(rows), "memory": memory}, indent=1))
        return 0
    print(f"{'run':40} {'kind':20} {'unit':>12} {'published':>9} {'predicted':>9} {'error':>7} {'MFU':>6}")
    for r in rows:
        unit = "TFLOP/s/GPU" if r["unit"] == "tflops" else "tokens/s/GPU"
        print(f"{r['run']:40} {r['kind']:20} {unit:>12} {r['measured']:>9,.0f} {r['predicted']:>9,.0f} "
              f"{r['error'] * 100:>+6.1f}% {r['mfu'] * 100:>5.1f}%")
    print(f"median |error| {median_abs_error(rows) * 100:.1f}% over {len(rows)} runs, the worst "
          f"{max(abs(r['error']) for r in rows) * 100:.0f}% (sources and assumptions: labkit.planning.published)")
    print(f"\n{'peak memory per GPU':40} {'published':>14} {'predicted':>10} {'error':>7}")
    for r in memory:
        print(f"{r['run']:40} {r['measured_gib']:>10.1f} GiB {r['predicted_gib']:>6.1f} GiB {r['error'] * 100:>+6.1f}%")
    print("(published: the allocator's peak reservation; predicted: tensors alive at the fullest rank's peak)")
    return 0


MAX_DEVICES = 10**6


def _ranked(a, parser) -> tuple:
    """The model, hardware and ranking the flags ask for; a bad flag is one line (exit 2)."""
    try:
        # the search enumerates the divisors of the device count: a million devices takes seconds
        at_most("--devices", positive_int("--devices", a.devices), MAX_DEVICES, "the largest runs use ~1e5")
        positive_int("--top", a.top)
        if not 0 <= a.headroom < 1:
            raise ValueError(f"--headroom={a.headroom} must be in [0, 1): the share of memory kept free")
        if a.device_gb is not None:
            at_most("--device-gb", positive_number("--device-gb", a.device_gb), 1e6, "a million GB on one device")
        check_shape_flags(a)  # the flags by their names, before the shape's own checks name its fields
        if a.seq_len is not None:
            positive_count("--seq-len", a.seq_len)
        shape = _shape(argparse.Namespace(**{**vars(a), "model": a.model if any(
            getattr(a, f) is not None for f in ("hidden", "layers", "heads")) else (a.model or "llama3-8b")}))
        if a.seq_len is not None:
            shape = dataclasses.replace(shape, seq_len=a.seq_len)
        batch = tokens(a.global_batch) if a.global_batch is not None else 512 * shape.seq_len
        positive_count("--global-batch" if a.global_batch is not None else "the default --global-batch "
                       "(512 sequences of --seq-len)", batch)
        if batch % shape.seq_len:
            raise ValueError(f"--global-batch={a.global_batch} must be a whole number of {shape.seq_len}-token "
                             f"sequences (for example {max(1, batch // shape.seq_len) * shape.seq_len:,})")
    except ValueError as e:
        parser.error(str(e))
    hw = hardware(a.device_type)
    memory_gb = a.device_gb or accelerator(a.device_type).memory_gb
    return shape, hw, batch, search(shape, hw, a.devices, batch, memory_gb, a.headroom)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    if a.published:
        return _published(a.json)
    shape, hw, batch, ranked = _ranked(a, parser)
    top = ranked[:a.top]
    run = launch(top[0].train_args, shape, a.devices, hw.devices_per_node, a.train_device) if top else None
    if a.json:
        print(json.dumps({"layouts": [{"label": r.label, "prediction": r.prediction, "memory_bytes": r.memory_bytes,
                                       "train_args": r.train_args, "published_spread": spread(r.plan)} for r in top],
                          "run": run}, indent=1))
        return 0
    print(f"{shape.note or 'model'}: {shape.n_params / 1e9:.1f}B parameters, {a.devices:,} x {hw.name}, "
          f"{batch:,} tokens a step ({batch // shape.seq_len:,} sequences of {shape.seq_len:,})")
    if not top:
        print("no layout fits: more devices, a smaller global batch or more memory per device")
        return 0
    print(f"{'#':>2} {'layout':66} {'step s':>7} {'MFU':>6} {'tok/s/GPU':>10} {'GB/GPU':>7}")
    for i, r in enumerate(top, 1):
        p = r.prediction
        print(f"{i:>2} {r.label:66} {p['total']:>7.2f} {p['mfu'] * 100:>5.1f}% {p['tokens_per_s_per_device']:>10,.0f} "
              f"{r.memory_bytes / 1e9:>7.1f}")
    reason = why(top[0], top[1]) if len(top) > 1 else None
    if reason:
        print(f"#1 over #2: {reason}")
    elif len(top) > 1:
        print("#1 and #2: the same predicted step (within 0.1%)")
    s = spread(top[0].plan)
    print(f"published runs of its kind ({s['kind'] if s['same_kind'] else 'nearest: ' + s['kind']}, {s['n']}): the "
          f"model was {s['low']:+.0%}..{s['high']:+.0%} of what they measured (--published)")
    print(f"run #1 ({run['nodes']} node{'s' if run['nodes'] > 1 else ''} of {run['nproc_per_node']}):\n  {run['command']}")
    if run["nodes"] > 1:
        print(f"  or under Slurm:\n  {run['sbatch']}")
    if run["warning"]:
        print(f"  note: {run['warning']}")
    print("predicted by labkit.planning.step_model with the constants (and sources) of labkit.planning.hardware")
    return 0
