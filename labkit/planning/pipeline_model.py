"""A pipeline as the planner sees it: the layers of each stage, which rank holds which, what each
rank keeps in flight, and how long the fill and drain take.

* **Stages** (:func:`chunk_layers`). ``pp`` ranks hold ``pp x v`` model chunks (``v`` per rank:
  one for GPipe and 1F1B, ``v`` for the interleaved schedule, two for ZB-V). The layers are split as
  torchtitan splits them (``_generate_llm_fqn_per_model_part``): the embedding counts as
  ``first_less`` layers and the output layer with its loss as ``last_less``, the total shared as
  evenly as possible, earlier chunks taking the remainder. With one each, 126 layers on 16 x 8
  chunks give Llama 3's split: "the first model chunk on the first stage has only the embedding,
  and the last model chunk on the last stage has only output projection and loss calculation"
  (Dubey et al. 2024, section 3.3.2).
* **Placement** (:func:`rank_chunks`): chunk ``c`` on rank ``c mod pp`` (the interleaved "loop"), or
  in a V for ZB-V (rank ``r`` holds chunks ``r`` and ``2 pp - 1 - r``; Qi et al. 2024).
* **In flight** (:func:`in_flight`): the activations a rank keeps, in layer-micro-batches, at its
  peak, from the order of torch.distributed.pipelining's schedules in torch 2.13 (the test replays
  torch's own generator): 1F1B's rank ``r`` holds ``min(pp - r, m)`` micro-batches; the interleaved
  schedule warms up ``(v - 1) m_r + 2 (pp - 1 - r)`` chunk forwards (``m_r``: micro-batches per
  round, ``m / max(1, m // pp)``), which on rank 0 is Korthikanti et al.'s ``L (1 + (pp-1)/(pp v))``
  layers (2022, section 4.2.3) and, when ``m v`` forwards are fewer, all of them; GPipe all ``m``;
  ZB-V ``2 pp`` chunk forwards on every rank (its weight gradients wait for the bubble).
* **Time** (:func:`pipeline_seconds`): ``m`` micro-batches at the pace of the busiest rank plus the
  fill and drain, ``(pp - 1) / v`` of a mean rank's micro-batch (Narayanan et al. 2021, section
  2.2.2: the bubble ``(p - 1) / (v m)`` of the ideal time); ZB-V fills its bubble with the weight
  gradients it deferred, leaving ``(pp - 1) max(0, t_F + t_B - 2 t_W)`` of a chunk (Qi et al. 2024,
  ZB-H2's bound, which ZB-V reaches with 1F1B's memory).
"""
from __future__ import annotations

import functools

from labkit.core.checks import one_of
from labkit.parallel.pipeline.split import stage_bounds

SCHEDULES = ("1f1b", "gpipe", "interleaved", "zbv")
V_SHAPED = ("zbv",)


def chunks_per_rank(schedule: str, v: int = 1) -> int:
    """Model chunks each rank holds under ``schedule``: ``v`` when interleaved, else fixed."""
    one_of("schedule", schedule, SCHEDULES, "schedules")
    return {"1f1b": 1, "gpipe": 1, "zbv": 2}.get(schedule, v)


def chunk_layers(n_layer: int, n_chunks: int, first_less: int = 0, last_less: int = 0) -> list[int]:
    """Layers of each of ``n_chunks`` chunks in pipeline order: the training loop's own split
    (:func:`labkit.parallel.pipeline.stages.stage_bounds`, torchtitan's)."""
    return [hi - lo for lo, hi in stage_bounds(n_layer, n_chunks, first_less, last_less)]


def rank_chunks(rank: int, pp: int, v: int, schedule: str) -> list[int]:
    """The chunks rank ``rank`` holds, in the order it runs them forward."""
    if schedule in V_SHAPED:
        return [rank, 2 * pp - 1 - rank]
    return [rank + k * pp for k in range(v)]


def interleaved_warmup(rank: int, pp: int, v: int, m: int, warm_factor: int = 2) -> int:
    """Chunk forwards rank ``rank`` runs before its first backward under torch's interleaved
    schedule, were there as many micro-batches as it wants: ``(v - 1) m_r + 2 (pp - 1 - rank)``."""
    per_round = m // max(1, m // pp)
    return (v - 1) * per_round + warm_factor * (pp - 1 - rank)


@functools.lru_cache(maxsize=4096)
def _interleaved_order(rank: int, pp: int, v: int, m: int, warm_factor: int) -> tuple[tuple, tuple, int]:
    """torch's ``ScheduleInterleaved1F1B``: local chunk of every forward and backward, and its warm-up."""
    per_round = m // max(1, m // pp)
    warmup = min(interleaved_warmup(rank, pp, v, m, warm_factor), m * v)
    fwd = tuple((k // per_round) % v for k in range(m * v))
    bwd = tuple(v - 1 - (k // per_round) % v for k in range(m * v))
    return fwd, bwd, warmup


@functools.lru_cache(maxsize=4096)
def _zbv_order(rank: int, pp: int, m: int) -> tuple[tuple[int, int], ...]:
    """torch's ``ScheduleZBVZeroBubble`` on one rank, as (local chunk, +1 forward / -1 weight gradient):
    a chunk's activations are freed by its weight gradient (W), which ZB-V defers. torch lays out
    ``max(2 pp - 1, m)`` micro-batches and drops the actions of those past ``m``."""
    n = max(2 * pp - 1, m)
    kinds = [(0, "F")] * (2 * (pp - rank) - 1) + [k for _ in range(rank) for k in ((1, "F"), (0, "F"))]
    kinds += [k for _ in range(pp - rank) for k in ((1, "F"), (1, "W"))]
    f0, f1 = 2 * (pp - rank) - 1 + rank, pp
    while f1 < f0 or f0 < n:
        if f0 < n:
            kinds.append((0, "F"))
            f0 += 1
        kinds += [(0, "W"), (1, "F"), (1, "W")]
        f1 += 1
    kinds += [(0, "W")] * (pp - rank) + [(1, "W")] * rank + [(0, "W")] * rank  # the cool-down's deferred W
    count, ops = {}, []
    for chunk, kind in kinds:
        mb = count.get((chunk, kind), 0)
        count[chunk, kind] = mb + 1
        if mb < m:
            ops.append((chunk, 1 if kind == "F" else -1))
    return tuple(ops)


def in_flight(rank: int, pp: int, m: int, schedule: str, layers: list[int] | tuple[int, ...]) -> float:
    """Layer-micro-batches of activations ``rank`` keeps at its peak: each forward of a chunk adds its
    layers until that chunk's backward (for ZB-V, its weight gradient) frees them. ``layers``: the
    layers of every chunk, in pipeline order (:func:`chunk_layers`)."""
    return _in_flight(rank, pp, m, schedule, tuple(layers))


@functools.lru_cache(maxsize=65536)
def _in_flight(rank: int, pp: int, m: int, schedule: str, layers: tuple[int, ...]) -> float:
    v = len(layers) // pp
    mine = [layers[c] for c in rank_chunks(rank, pp, v, schedule)]
    if pp == 1 or schedule == "gpipe":
        return m * sum(mine)
    if schedule == "1f1b":
        return min(pp - rank, m) * mine[0]
    if schedule == "zbv":
        live = peak = 0
        for chunk, sign in _zbv_order(rank, pp, m):
            live += sign * mine[chunk]
            peak = max(peak, live)
        return peak
    fwd, bwd, warmup = _interleaved_order(rank, pp, v, m, 2)
    live = peak = sum(mine[c] for c in fwd[:warmup])
    for k in range(warmup, m * v):  # steady state: one forward, then one backward
        live += mine[fwd[k]]
        peak = max(peak, live)
        live -= mine[bwd[k - warmup]]
    return peak


def pipeline_seconds(work: list[float], m: int, v: int, schedule: str, zb: tuple[float, float, float] | None = None
                     ) -> tuple[float, float]:
    """(time of the micro-batches, the bubble), in seconds: ``work`` is each rank's seconds for one
    micro-batch through all its chunks, ``v`` the chunks per rank; ``zb`` the forward, input-gradient
    and weight-gradient seconds of one chunk, for ZB-V (module docstring)."""
    pp = len(work)
    busy = m * max(work)
    if pp == 1:
        return busy, 0.0
    mean = sum(work) / pp
    if schedule == "zbv" and zb is not None:
        f, b, w = zb
        return busy, (pp - 1) * max(0.0, f + b - 2 * w)
    return busy, (pp - 1) / v * mean
