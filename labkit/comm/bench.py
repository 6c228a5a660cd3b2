"""A collective benchmark with the shape of NVIDIA's nccl-tests, for torch.distributed on any backend.

``torchrun --nproc-per-node 2 -m labkit.comm.bench --op all_reduce --min-bytes 1K --max-bytes 16M``
prints one row per message size: bytes, time (us), algorithm and bus bandwidth (GB/s), as
nccl-tests' ``all_reduce_perf`` does; ``--device cuda`` runs the same over NCCL, one GPU per rank,
and ``--json OUT`` writes the rows. Each size is timed over enough iterations to last
``--target-ms`` (after ``--warmup`` untimed ones), between two barriers, with the device
synchronised; the time reported is the slowest rank's mean, as a collective is only done when its
last rank is.

Sizes and bandwidths follow nccl-tests' ``doc/PERFORMANCE.md``: ``algbw = S / t`` with ``S`` the
bytes of the whole array (the gathered output of an all-gather, the input of a reduce-scatter, one
rank's buffer for all-to-all and send/recv), and ``busbw = algbw x factor``, the factor that makes
the number comparable to the link's own rate whatever the rank count: 2(n-1)/n for all-reduce,
(n-1)/n for all-gather, reduce-scatter and all-to-all, 1 for broadcast, reduce and send/recv.
"""
from __future__ import annotations

import json
import math
import os
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from labkit.comm.p2p import exchange
from labkit.core.checks import at_most, one_of, output_file, positive_int, positive_number
from labkit.core.cli import ArgumentParser
from labkit.core.devices import DEVICE_TYPES, available_bytes, backend_for, rank_device, synchronize, torchrun_env

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all", "sendrecv")


def busbw_factor(op: str, n: int) -> float:
    """nccl-tests' correction from algorithm to bus bandwidth for ``op`` on ``n`` ranks."""
    one_of("op", op, OPS, "ops")
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0


@dataclass
class Row:
    op: str
    bytes: int  # S: the whole array, as nccl-tests counts it
    count: int  # fp32 elements of S
    time_us: float  # the slowest rank's mean per call
    algbw_gbps: float  # S / t, GB/s (1e9 bytes)
    busbw_gbps: float  # algbw x busbw_factor
    iters: int
    ranks: int


_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str | int) -> int:
    """``"1K"`` -> 1024, ``"16M"`` -> 16 MiB (nccl-tests' ``-b``/``-e`` units); ints pass through."""
    if isinstance(text, int) and not isinstance(text, bool):
        return positive_int("size", text)
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)B?\s*", str(text), re.IGNORECASE)
    if not m:
        raise ValueError(f"size {text!r} is not a byte count; write e.g. 8, 1K, 16M or 1G")
    return at_most("size", positive_int("size", int(m.group(1)) * _UNITS[m.group(2).upper()]), 2**50,
                   "a PiB in one message")


def message_sizes(min_bytes: int, max_bytes: int, factor: int = 2, ranks: int = 1) -> list[int]:
    """Sizes from ``min_bytes`` to ``max_bytes``, each ``factor`` times the last, rounded up to whole
    fp32 elements that split evenly over ``ranks`` (what all-gather and reduce-scatter need)."""
    positive_int("min_bytes", min_bytes)
    positive_int("max_bytes", max_bytes)
    if factor < 2:
        raise ValueError(f"factor must be an integer >= 2, got {factor!r}")
    if max_bytes < min_bytes:
        raise ValueError(f"max_bytes={max_bytes} is below min_bytes={min_bytes}")
    unit = 4 * ranks
    out, s = [], min_bytes
    while s <= max_bytes:
        out.append(math.ceil(s / unit) * unit)
        s *= factor
    return sorted(set(out))


def _operation(op: str, nbytes: int, device: torch.device, group: dist.ProcessGroup | None) -> Callable[[], None]:
    """A closure that runs ``op`` once on buffers of ``nbytes`` (allocated once, here)."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    count = nbytes // 4
    full = torch.ones(count, device=device)
    part = torch.ones(count // n, device=device)
    if op == "all_reduce":
        return lambda: dist.all_reduce(full, group=group)
    # torch 2.13 renames these (all_gather_single, reduce_scatter_single); 2.11 has only the old names
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    if op == "all_gather":
        return lambda: gather(full, part, group=group)
    if op == "reduce_scatter":
        return lambda: scatter(part, full, group=group)
    root = dist.get_global_rank(group, 0) if group is not None else 0
    if op == "broadcast":
        return lambda: dist.broadcast(full, root, group=group)
    if op == "reduce":
        return lambda: dist.reduce(full, root, group=group)
    if op == "all_to_all":
        out = torch.empty_like(full)
        return lambda: dist.all_to_all_single(out, full, group=group)
    # send/recv: a shift round the ring, every rank sending S and receiving S, paired (NCCL-safe)
    peer = (lambda r: dist.get_global_rank(group, r)) if group is not None else (lambda r: r)
    nxt, prv, got = peer((rank + 1) % n), peer((rank - 1) % n), torch.empty_like(full)
    return lambda: exchange([(full, nxt)], [(got, prv)], group)


def _slowest(seconds: float, device: torch.device, group: dist.ProcessGroup | None) -> float:
    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def time_op(op: str, nbytes: int, device: torch.device, warmup: int = 5, target_ms: float = 50.0,
            min_iters: int = 3, max_iters: int = 1000, repeats: int = 5,
            group: dist.ProcessGroup | None = None) -> tuple[float, int]:
    """Seconds per call of ``op`` on ``nbytes`` and the iterations timed; a collective. The ranks agree
    on the iterations, sized from one timed call so that ``repeats`` rounds last ``target_ms``; each
    round runs between barriers and its time is the slowest rank's mean. The fastest round is
    returned, as ``timeit`` does: other processes on a shared machine only ever add time."""
    run = _operation(op, nbytes, device, group)
    for _ in range(warmup):
        run()
    synchronize(device)
    t0 = time.perf_counter()
    run()
    synchronize(device)
    one = _slowest(time.perf_counter() - t0, device, group)
    iters = int(min(max_iters, max(min_iters, math.ceil(target_ms / 1e3 / max(one, 1e-9) / repeats))))
    rounds = []
    for _ in range(repeats):
        dist.barrier(group=group)
        synchronize(device)
        t0 = time.perf_counter()
        for _ in range(iters):
            run()
        synchronize(device)
        rounds.append(_slowest((time.perf_counter() - t0) / iters, device, group))
    return min(rounds), iters * repeats


def bench(ops: list[str] | tuple[str, ...], sizes: list[int], device: torch.device, warmup: int = 5,
          target_ms: float = 50.0, group: dist.ProcessGroup | None = None) -> list[Row]:
    """Time every op at every size on the ranks of ``group``; a collective, every rank gets the rows."""
    n = dist.get_world_size(group)
    rows = []
    for op in ops:
        one_of("op", op, OPS, "ops")
        for s in sizes:
            if s % (4 * n):
                raise ValueError(f"size {s} must be whole fp32 elements that split over {n} ranks "
                                 f"(a multiple of {4 * n}); message_sizes() rounds them")
            t, iters = time_op(op, s, device, warmup, target_ms, group=group)
            algbw = s / t / 1e9
            rows.append(Row(op, s, s // 4, t * 1e6, algbw, algbw * busbw_factor(op, n), iters, n))
    return rows


def bench_on_rank(ops: list[str], sizes: list[int], device: str = "cpu", warmup: int = 5,
                  target_ms: float = 50.0) -> list[dict]:
    """:func:`bench` on this rank's device (``labkit.launch.launch(bench_on_rank, ...)`` from a lab);
    the rows as dicts."""
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    return [asdict(r) for r in bench(ops, sizes, dev, warmup, target_ms)]


def mismatched_collective(timeout_s: float = 30.0) -> str:
    """What ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` reports when ranks disagree: rank 0 all-reduces 4
    elements, the others 8, on a new group whose collectives the debug wrapper checks (PyTorch docs,
    "Debugging torch.distributed applications"). Without it the ranks would hang until the timeout
    or read garbage; with it each raises at once. Returns this rank's error message."""
    from labkit.core.devices import side_group

    os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    dist.set_debug_level_from_env()  # the level is read when a group is made: this one gets the wrapper
    group = side_group(timeout_s)
    try:
        dist.all_reduce(torch.ones(4 if dist.get_rank() == 0 else 8), group=group)
    except RuntimeError as e:
        return str(e)
    finally:
        os.environ.pop("TORCH_DISTRIBUTED_DEBUG", None)
        dist.set_debug_level_from_env()
    return "no error: the collectives matched"


def format_rows(rows: list[Row]) -> str:
    """The rows as nccl-tests prints them."""
    lines = [f"# {'op':>14} {'size (B)':>12} {'count':>10} {'time (us)':>11} {'algbw (GB/s)':>13} "
             f"{'busbw (GB/s)':>13}"]
    lines += [f"  {r.op:>14} {r.bytes:>12} {r.count:>10} {r.time_us:>11.1f} {r.algbw_gbps:>13.3f} "
              f"{r.busbw_gbps:>13.3f}" for r in rows]
    return "\n".join(lines)


def _parser() -> ArgumentParser:
    ap = ArgumentParser(prog="python -m labkit.comm.bench",
                        description="Time torch.distributed collectives over message sizes (nccl-tests' shape). "
                                    "Run it under torchrun, one process per rank.")
    ap.add_argument("--op", default="all_reduce",
                    help=f"comma-separated collectives, or 'all'; of {list(OPS)} (default all_reduce)")
    ap.add_argument("--min-bytes", default="1K", help="smallest message, bytes (suffixes K, M, G; default 1K)")
    ap.add_argument("--max-bytes", default="16M", help="largest message, bytes (default 16M)")
    ap.add_argument("--step-factor", type=int, default=2, help="each size is this many times the last (default 2)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed calls per size (default 5)")
    ap.add_argument("--target-ms", type=float, default=50.0,
                    help="time each size over this many milliseconds of calls (default 50)")
    ap.add_argument("--device", default="cpu", help=f"where the buffers live, of {list(DEVICE_TYPES)}: cpu "
                    "runs gloo, cuda NCCL with one GPU per rank (default cpu)")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows to this file (rank 0)")
    return ap


def _check(ap: ArgumentParser, a) -> tuple[list[str], int, int]:
    try:
        ops = list(OPS) if a.op == "all" else [one_of("--op", o, OPS, "ops") for o in a.op.split(",")]
        lo, hi = parse_size(a.min_bytes), parse_size(a.max_bytes)
        if hi < lo:
            raise ValueError(f"--max-bytes {a.max_bytes} is below --min-bytes {a.min_bytes}")
        if a.step_factor < 2:
            raise ValueError(f"--step-factor must be an integer >= 2, got {a.step_factor}")
        at_most("--warmup", positive_int("--warmup", a.warmup + 1) - 1, 10**6, "a million untimed calls per size")
        positive_number("--target-ms", a.target_ms)
        one_of("--device", a.device, DEVICE_TYPES, "devices")
        if a.json is not None:
            if not a.json.parent.is_dir():
                raise ValueError(f"--json {a.json}: the folder {a.json.parent} does not exist")
            output_file("--json", a.json)
    except ValueError as e:
        ap.error(str(e))
    return ops, lo, hi


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    a = ap.parse_args(argv)
    ops, lo, hi = _check(ap, a)
    if "RANK" not in os.environ:
        ap.error("run it under torchrun, one process per rank: torchrun --nproc-per-node 2 -m labkit.comm.bench ...")
    try:
        _, world, local, local_world = torchrun_env()
    except ValueError as e:
        ap.error(str(e))
    # each rank holds up to three buffers of the largest message (all_to_all, send/recv: in, out and
    # a part); on a CPU the node's ranks share its memory
    need, room = 3 * hi * (local_world or world if a.device == "cpu" else 1), available_bytes(a.device, local)
    if room is not None and need > room:
        ap.error(f"--max-bytes {a.max_bytes}: {need / 2**30:,.1f} GiB of buffers, more than the "
                 f"{room / 2**30:,.1f} GiB available; give a smaller --max-bytes")
    if a.device == "cuda" and torch.cuda.device_count() <= local:
        ap.error(f"--device cuda but local rank {local} has no GPU ({torch.cuda.device_count()} visible)")
    device = rank_device(a.device, local)
    dist.init_process_group(backend_for(a.device),
                            **({"device_id": device} if device.type == "cuda" else {}))
    try:
        rows = bench(ops, message_sizes(lo, hi, a.step_factor, dist.get_world_size()), device, a.warmup, a.target_ms)
        if dist.get_rank() == 0:
            print(f"# {dist.get_world_size()} ranks, {dist.get_backend()} on {a.device}; "
                  f"busbw = algbw x factor (nccl-tests)", flush=True)
            print(format_rows(rows), flush=True)
            if a.json is not None:
                a.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
