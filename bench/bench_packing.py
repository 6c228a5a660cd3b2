"""Packers side by side: rows and seconds on the same lengths, as ratios to ``labkit.feeding.packing.pack``.

    .venv/bin/python bench/bench_packing.py                       # 100k and 1M lognormal lengths
    .venv/bin/python bench/bench_packing.py --n 20000 --dist article --capacity 2048

Packers:

* ``labkit bfd``: ``labkit.feeding.packing.pack``, best-fit decreasing over the whole data set.
* ``trl bfd``: TRL's ``pack_dataset(ds, capacity, strategy="bfd")`` as people call it; it runs
  through ``Dataset.map(batched=True)``, whose default batch is 1,000 rows, so it packs each block of
  1,000 sequences on its own.
* ``trl bfd, one batch``: the same with ``map_kwargs={"batch_size": n}``: BFD over the whole set.
* ``ffd (scan)``: first-fit decreasing written the common way, a scan over the open rows for each
  sequence (vectorized with numpy); O(n x rows), so skipped above ``--max-scan`` sequences.
* ``next-fit``: the sequences in data-set order, a new row whenever the next one does not fit
  (concatenate-and-cut without cutting).

Every packer's rows are checked (all tokens kept, no row over capacity) before they are counted.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from labkit.feeding.packing import lower_bound, pack


def lengths_for(dist: str, n: int, capacity: int, seed: int) -> np.ndarray:
    """``lognormal``: median e^5 ~ 148 tokens, clipped to [1, capacity]; ``article``: lognormal with
    median ~ 120, clipped to the article's 50-512 range; ``uniform``: integers in [50, 512]."""
    rng = np.random.default_rng(seed)
    if dist == "lognormal":
        return np.clip(np.round(rng.lognormal(5.0, 1.0, n)), 1, capacity).astype(np.int64)
    if dist == "article":
        return np.clip(np.round(rng.lognormal(4.8, 0.8, n)), 50, 512).astype(np.int64)
    if dist == "uniform":
        return rng.integers(50, 513, n).astype(np.int64)
    raise ValueError(f"dist={dist!r} is unknown; valid: lognormal, article, uniform")


def ffd_scan(lengths: np.ndarray, capacity: int) -> list[int]:
    """First-fit decreasing, scanning the open rows for each item; returns the row fills."""
    rooms = np.empty(len(lengths), dtype=np.int64)
    n_rows = 0
    for n in np.sort(lengths)[::-1].tolist():
        fits = rooms[:n_rows] >= n
        j = int(fits.argmax()) if n_rows else 0
        if n_rows and fits[j]:
            rooms[j] -= n
        else:
            rooms[n_rows] = capacity - n
            n_rows += 1
    return (capacity - rooms[:n_rows]).tolist()


def next_fit(lengths: np.ndarray, capacity: int) -> list[int]:
    fills, cur = [], 0
    for n in lengths.tolist():
        if cur + n > capacity:
            fills.append(cur)
            cur = 0
        cur += n
    return fills + [cur]


def trl_bfd(lengths: np.ndarray, capacity: int, batch_size: int | None) -> tuple[list[int], float]:
    """Row fills from TRL's ``pack_dataset``, and the seconds ``pack_dataset`` took (not the set-up)."""
    import datasets
    import pyarrow as pa
    import pyarrow.compute as pc
    from datasets.table import InMemoryTable
    from trl import pack_dataset

    datasets.disable_progress_bars()
    offsets = pa.array(np.r_[0, np.cumsum(lengths)].astype(np.int64))
    tokens = pa.array(np.zeros(int(lengths.sum()), dtype=np.int8))  # the token values do not matter
    ds = datasets.Dataset(InMemoryTable(pa.table({"input_ids": pa.LargeListArray.from_arrays(offsets, tokens)})))
    kwargs = {} if batch_size is None else {"map_kwargs": {"batch_size": batch_size}}
    t = time.perf_counter()
    out = pack_dataset(ds, capacity, strategy="bfd", **kwargs)
    seconds = time.perf_counter() - t
    return pc.list_value_length(out.data.column("input_ids")).to_numpy().tolist(), seconds


def run(n: int, capacity: int, dist: str, seed: int, max_scan: int, trl: bool = True) -> list[dict]:
    L = lengths_for(dist, n, capacity, seed)
    total, bound = int(L.sum()), lower_bound(L, capacity)
    results = []

    def record(name, fills, seconds):
        fills = np.asarray(fills)
        if fills.sum() != total or fills.max() > capacity:
            raise AssertionError(f"{name}: rows hold {fills.sum()} of {total} tokens, fullest {fills.max()}")
        results.append(dict(packer=name, n=n, rows=len(fills), seconds=seconds, lower_bound=bound,
                            over_bound=len(fills) / bound - 1, efficiency=total / (len(fills) * capacity)))

    t = time.perf_counter()
    rows = pack(L, capacity)
    seconds = time.perf_counter() - t
    flat = sorted(i for r in rows for i in r)
    if flat != list(range(n)):
        raise AssertionError("labkit bfd: not every sequence exactly once")
    record("labkit bfd", [int(L[r].sum()) for r in rows], seconds)
    if trl:
        record("trl bfd", *trl_bfd(L, capacity, None))
        record("trl bfd, one batch", *trl_bfd(L, capacity, n))
    if n <= max_scan:
        t = time.perf_counter()
        fills = ffd_scan(L, capacity)
        record("ffd (scan)", fills, time.perf_counter() - t)
    t = time.perf_counter()
    fills = next_fit(L, capacity)
    record("next-fit", fills, time.perf_counter() - t)
    ref = results[0]
    for r in results:
        r["rows_vs_labkit"] = r["rows"] / ref["rows"]
        r["time_vs_labkit"] = r["seconds"] / ref["seconds"]
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, nargs="+", default=[100_000, 1_000_000], help="sequences per run")
    ap.add_argument("--capacity", type=int, default=2048, help="tokens per packed row")
    ap.add_argument("--dist", default="lognormal", choices=["lognormal", "article", "uniform"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-scan", type=int, default=200_000, help="largest n for the O(n x rows) FFD scan")
    ap.add_argument("--no-trl", action="store_true", help="leave TRL out (it needs trl and datasets)")
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args(argv)
    if any(n <= 0 for n in args.n) or args.capacity <= 0:
        ap.error("--n and --capacity must be positive")
    everything = []
    for n in args.n:
        res = run(n, args.capacity, args.dist, args.seed, args.max_scan, trl=not args.no_trl)
        everything += res
        print(f"\n{n:,} sequences ({args.dist}), capacity {args.capacity}: lower bound "
              f"{res[0]['lower_bound']:,} rows = max(ceil(total/capacity), #longer than capacity/2)")
        print(f"{'packer':20} {'rows':>10} {'over bound':>11} {'efficiency':>11} {'seconds':>9} "
              f"{'rows/labkit':>12} {'time/labkit':>12}")
        for r in res:
            print(f"{r['packer']:20} {r['rows']:>10,} {r['over_bound']:>11.4%} {r['efficiency']:>11.4%} "
                  f"{r['seconds']:>9.3f} {r['rows_vs_labkit']:>12.4f} {r['time_vs_labkit']:>12.1f}")
        if n > args.max_scan:
            print(f"(ffd (scan) skipped: O(n x rows) above --max-scan={args.max_scan:,})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(everything, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
