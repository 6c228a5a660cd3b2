"""The book's schematics, drawn from labkit's own code so that a figure cannot disagree with it.
* :func:`zero_holdings`: what each rank holds under DDP and ZeRO 1-3, sharding as the calculator's.
* :func:`tp_split`: Megatron-LM's column- then row-parallel MLP with its ``f`` and ``g`` operators.
* :func:`pp_schedules`: ideal GPipe and 1F1B, each stage's order from ``schedule_order``.
* :func:`device_mesh`: 2-D and 3-D meshes and the ranks of each group (4-D: :mod:`labkit.labs.schematics_mesh`).
* :func:`memory_70b`: the memory chapter's 70B scenario as stacked bars, every number the calculator's.
* :func:`labkit.labs.collective_figures.collectives`: the seven collectives, before and after.
:func:`write_all` writes them and ``schematics_mesh``'s and ``schematics_failures``' to ``book/images``.
"""
from __future__ import annotations

import sys
from itertools import accumulate, product
from pathlib import Path

from labkit.labs.collective_figures import collectives
from labkit.labs.schematics_failures import FIGURES as FAILURES
from labkit.labs.schematics_mesh import FIGURES as MESH
from labkit.labs.svg import ALERT, INK, OWNER_FILL, OWNER_STROKE, RANK_FILL, RANK_STROKE, Svg, num
from labkit.memory.calculator import GB, estimate_memory, model_state_breakdown
from labkit.parallel.pipeline.stages import schedule_order
from labkit.parallel.pipeline.timeline import bubble_formula
from labkit.planning.accelerators import ACCELERATORS

IMAGES = Path(__file__).resolve().parents[2] / "book" / "images"
STAGE_NAMES = ("DDP: all replicated", "ZeRO-1: optimizer states sharded", "ZeRO-2: + gradients sharded",
               "ZeRO-3: + parameters sharded")
# (label, bytes per parameter, the ModelStates field it belongs to) of mixed-precision Adam
STATE_ROWS = (("fp16 params", 2, "params"), ("fp16 grads", 2, "grads"), ("fp32 params", 4, "optimizer"),
              ("fp32 momentum", 4, "optimizer"), ("fp32 variance", 4, "optimizer"))


def _holdings_panel(svg: Svg, x: float, y: float, stage: int, n: int, labels: bool) -> None:
    """One stage: a column per rank, a row per state; a row is cut into ``n`` shards."""
    psi = 1000 * n
    full, mine = model_state_breakdown(psi, 1, stage), model_state_breakdown(psi, n, stage)
    col, gap, u = 60, 8, 7
    svg.text(x + (n * col + (n - 1) * gap) / 2, y, STAGE_NAMES[stage], anchor="middle", size=14, weight="bold")
    for r in range(n):
        svg.rank_box(x + r * (col + gap), y + 10, col, 24, f"rank {r}")
    top = y + 42
    for label, width, part in STATE_ROWS:
        sharded = getattr(mine, part) < getattr(full, part)
        if labels:
            svg.text(x - 10, top + width * u / 2 + 4.5, label, anchor="end")
        for r, k in product(range(n), range(n)):
            held = not sharded or k == r
            fill, stroke = (OWNER_FILL[r % 4], OWNER_STROKE[r % 4]) if held else ("white", "#aaa")
            svg.rect(x + r * (col + gap) + k * col / n, top, col / n, width * u, fill=fill, stroke=stroke,
                     stroke_width=0.8, stroke_dasharray=None if held else "3 2", data_stage=stage)
        top += width * u + 4
    svg.text(x + (n * col + (n - 1) * gap) / 2, top + 16, f"each rank: {num(mine.total / psi)}Ψ bytes",
             anchor="middle")


def zero_holdings(n: int = 4) -> str:
    """What each of ``n`` ranks holds under DDP and ZeRO stages 1, 2, 3 (Rajbhandari et al. 2020,
    "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", Figure 1): 16 bytes per
    parameter Ψ of mixed-precision Adam, a row per state drawn as tall as its bytes."""
    svg = Svg(720, 480, f"What each of {n} ranks holds under DDP and ZeRO stages 1, 2 and 3")
    for stage in range(4):
        _holdings_panel(svg, 120 + (stage % 2) * 320, 24 + (stage // 2) * 222, stage, n, stage % 2 == 0)
    svg.swatch(20, 466, "held (shade: the rank that owns it)", OWNER_FILL[0], OWNER_STROKE[0])
    svg.swatch(290, 466, f"held by another rank (each row is cut into N = {n} shards)", "white", "#aaa",
               stroke_dasharray="3 2")
    return svg.render()


def _tp_lane(svg: Svg, r: int, y: float) -> None:
    """Rank ``r``'s lane: X times its columns of A, GELU, times its rows of B: a partial sum Zᵣ."""
    sub = "₀₁"[r]
    svg.rect(150, y, 470, 80, rx=8)
    svg.text(610, y + 17, f"rank {r}", anchor="end", fill=RANK_STROKE)
    for x, w, label in ((176, 112, f"X · A{sub}"), (326, 66, "GELU"), (430, 112, f"Y{sub} · B{sub}")):
        svg.rect(x, y + 26, w, 44, fill="white", stroke=INK, rx=4)
        svg.text(x + (w / 2 if w < 100 else 36), y + 53, label, anchor="middle")
    for x in (288, 392):
        svg.arrow(x, y + 48, x + 36, y + 48)
    svg.text(410, y + 42, f"Y{sub}", anchor="middle", fill=INK)
    # A (h x 4h) split by columns, B (4h x h) split by rows: this rank's part shaded
    svg.rect(242, y + 38, 40, 20, fill="white", stroke=INK, stroke_width=0.8)
    svg.rect(242 + 20 * r, y + 38, 20, 20, fill=OWNER_FILL[r], stroke=OWNER_STROKE[r], stroke_width=0.8)
    svg.rect(516, y + 30, 20, 36, fill="white", stroke=INK, stroke_width=0.8)
    svg.rect(516, y + 30 + 18 * r, 20, 18, fill=OWNER_FILL[r], stroke=OWNER_STROKE[r], stroke_width=0.8)


def tp_split() -> str:
    """Megatron-LM's MLP on two ranks (Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion
    Parameter Language Models Using Model Parallelism", section 3, Figure 3a): A split by columns,
    B by rows; ``f`` is the identity forward and an all-reduce backward, ``g`` the reverse."""
    svg = Svg(820, 330, "Tensor parallelism: Megatron-LM's column-parallel then row-parallel MLP on two ranks")
    svg.box(20, 122, 70, 40, "X", size=14)
    svg.text(55, 180, "replicated", anchor="middle", fill=INK)
    for r, y in ((0, 20), (1, 184)):
        _tp_lane(svg, r, y)
    for name, cx in (("f", 122), ("g", 672)):
        svg.add("circle", cx=float(cx), cy=142.0, r=16.0, fill="#fbe0c3", stroke="#c0701f")
        svg.text(cx, 147, name, anchor="middle", size=14, weight="bold", font_style="italic")
    svg.arrow(90, 142, 104, 142)
    for y, sub in ((68, "₀"), (232, "₁")):
        svg.arrow(132, 130 if y < 142 else 154, 174, y)
        svg.arrow(542, y, 660, 130 if y < 142 else 154)
        svg.text(640, 110 if y < 142 else 186, f"Z{sub}", anchor="middle", fill=INK)
    svg.arrow(688, 142, 718, 142)
    svg.box(720, 122, 90, 40, "Z = Z₀ + Z₁")
    notes = ("A (h × 4h) is split by columns, B (4h × h) by rows; the shaded part is the rank's. GELU needs "
             "no message.", "f: forward identity (X to every rank); backward all-reduce (sum of the ranks' dX).",
             "g: forward all-reduce (sum of the partial Zᵣ); backward identity (dZ to every rank).")
    for i, line in enumerate(notes):
        svg.text(20, 288 + 17 * i, line)
    return svg.render()


def ideal_timeline(schedule: str, p: int, m: int, t_f: int = 1, t_b: int = 2) -> list[tuple[int, str, int, int, int]]:
    """``(stage, kind, microbatch, start, end)`` of every action when each stage runs the order of
    :func:`~labkit.parallel.pipeline.stages.schedule_order` as soon as its input has arrived: equal
    stages, a forward taking ``t_f``, a backward ``t_b``, messages free."""
    orders = [schedule_order(schedule, p, s, m) for s in range(p)]
    pos, free, done, out = [0] * p, [0] * p, {}, []
    while any(pos[s] < len(orders[s]) for s in range(p)):
        moved = False
        for s in (s for s in range(p) if pos[s] < len(orders[s])):
            kind, i = orders[s][pos[s]]
            dep = (kind, s - 1 if kind == "F" else s + 1, i)  # the message this action waits for
            if dep[1] not in (-1, p) and dep not in done:
                continue
            start = max(free[s], done.get(dep, 0))
            free[s] = done[(kind, s, i)] = start + (t_f if kind == "F" else t_b)
            out.append((s, kind, i, start, free[s]))
            pos[s], moved = pos[s] + 1, True
        if not moved:
            raise RuntimeError(f"schedule {schedule!r} deadlocks with p={p}, m={m}")
    return out


def _schedule_grid(svg: Svg, y: float, schedule: str, p: int, m: int, unit: float) -> None:
    events = ideal_timeline(schedule, p, m)
    end = max(e[4] for e in events)
    idle = 1 - sum(e[4] - e[3] for e in events) / (p * end)
    name = "GPipe" if schedule == "gpipe" else "1F1B (PipeDream-Flush)"
    svg.text(90, y, f"{name}: bubble (p−1)/(m+p−1) = {bubble_formula(p, m):.0%} of every stage's time "
             f"(idle here: {idle:.0%})", weight="bold")
    svg.text(90 + end * unit + 14, y, "activations held", fill=INK)
    for s in range(p):
        top = y + 10 + 26 * s
        svg.text(80, top + 16, f"stage {s}", anchor="end")
        svg.rect(90, top, end * unit, 22, fill="#eeeeee", stroke=None)
        peak = max(accumulate(1 if kind == "F" else -1 for kind, _ in schedule_order(schedule, p, s, m)))
        svg.text(90 + end * unit + 14, top + 16, f"up to {peak}")
    for s, kind, i, start, stop in events:
        fill, stroke = (RANK_FILL, RANK_STROKE) if kind == "F" else ("#fbe0c3", "#c0701f")
        top = y + 10 + 26 * s
        svg.rect(90 + start * unit, top, (stop - start) * unit, 22, fill=fill, stroke=stroke, stroke_width=0.8)
        svg.text(90 + (start + stop) / 2 * unit, top + 16, str(i), anchor="middle")


def pp_schedules(p: int = 4, m: int = 8) -> str:
    """The ideal GPipe (Huang et al. 2019, "GPipe: Efficient Training of Giant Neural Networks using
    Pipeline Parallelism", Figure 2) and 1F1B (Narayanan et al. 2021, "Efficient Large-Scale Language
    Model Training on GPU Clusters Using Megatron-LM", Figure 4 top) schedules of ``p`` stages and
    ``m`` microbatches, a backward taking twice a forward; grey is the bubble."""
    svg = Svg(820, 352, f"Ideal GPipe and 1F1B schedules, {p} stages and {m} microbatches")
    for k, schedule in enumerate(("gpipe", "1f1b")):
        _schedule_grid(svg, 24 + k * (p * 26 + 50), schedule, p, m, unit=18)
    y = 24 + 2 * (p * 26 + 50) - 12
    svg.swatch(90, y, "forward of microbatch i", RANK_FILL, RANK_STROKE, w=18)
    svg.swatch(290, y, "backward (twice as long)", "#fbe0c3", "#c0701f", w=36)
    svg.swatch(520, y, "idle: the bubble", "#eeeeee", None, w=18)
    svg.text(90, y + 22, "Same bubble, same step time; 1F1B starts backwards early, so stage s holds at most "
             "p − s microbatches' activations.", fill=INK)
    return svg.render()


def mesh_groups(shape: dict[str, int]) -> dict[str, list[list[int]]]:
    """The ranks of every group along each dimension of a device mesh, ranks numbered row-major
    over ``shape``'s dimensions in order (as ``init_device_mesh`` numbers them; the last varies fastest)."""
    names, sizes = list(shape), list(shape.values())
    coords = list(product(*(range(n) for n in sizes)))  # rank r sits at coords[r]
    groups = {}
    for d, name in enumerate(names):
        keyed: dict[tuple, list[int]] = {}
        for rank, c in enumerate(coords):
            keyed.setdefault(c[:d] + c[d + 1:], []).append(rank)
        groups[name] = list(keyed.values())
    return groups


def _mesh_panel(svg: Svg, x: float, y: float, rows: list[list[int]], title: str) -> None:
    """GPUs a row per tensor group (dashed), the rows' data groups linked in green."""
    svg.text(x, y, title, weight="bold")
    for d, row in enumerate(rows):
        top = y + 14 + d * 52
        svg.rect(x - 6, top - 6, len(row) * 64 + 2, 42, fill="none", stroke=OWNER_STROKE[1], rx=10,
                 stroke_dasharray="5 3")
        for t, rank in enumerate(row):
            if d:
                svg.arrow(x + t * 64 + 28, top - 22, x + t * 64 + 28, top, stroke=OWNER_STROKE[2], width=3, head=False)
            svg.rank_box(x + t * 64, top, 56, 30, f"GPU {rank}")


def _group_lines(svg: Svg, x: float, y: float, groups: dict[str, list[list[int]]]) -> None:
    names = {"pp": "pipeline groups", "dp": "data groups", "tp": "tensor groups"}
    for k, (dim, gs) in enumerate(groups.items()):
        svg.text(x, y + 17 * k, f"{names[dim]}: " + " ".join("{" + ",".join(map(str, g)) + "}" for g in gs))


def device_mesh() -> str:
    """A 2-D mesh of 8 GPUs (data 2 x tensor 4) and a 3-D mesh of 16 (pipeline 2 x data 2 x tensor
    4), with tensor parallelism inside a node and pipeline stages across nodes as Narayanan et al.
    2021 place them (section 3); every group's ranks from :func:`mesh_groups`."""
    svg = Svg(820, 420, "Device meshes: 8 GPUs as data x tensor, 16 GPUs as pipeline x data x tensor")
    flat, deep = mesh_groups({"dp": 2, "tp": 4}), mesh_groups({"pp": 2, "dp": 2, "tp": 4})
    _mesh_panel(svg, 30, 24, flat["tp"], "2-D mesh (dp 2 × tp 4): 8 GPUs, one node")
    _group_lines(svg, 30, 152, flat)
    svg.text(30, 218, "3-D mesh (pp 2 × dp 2 × tp 4): 16 GPUs, two nodes", weight="bold")
    for s in range(2):
        _mesh_panel(svg, 30 + s * 420, 240, deep["tp"][2 * s:2 * s + 2], f"node {s}: pipeline stage {s}")
    svg.arrow(290, 294, 432, 294, width=2)
    svg.text(361, 286, "activations", anchor="middle", fill=INK)
    hop = deep["pp"][0][1] - deep["pp"][0][0]
    svg.text(361, 312, f"GPU r → GPU r + {hop}", anchor="middle", fill=INK)
    _group_lines(svg, 30, 370, deep)
    legend = ((OWNER_STROKE[1], "dashed box: a tensor group, inside a node (fast links)"),
              (OWNER_STROKE[2], "green link: a data group (gradients all-reduced)"),
              (INK, "arrow: a pipeline group, stage to stage"))
    for k, (color, line) in enumerate(legend):
        svg.swatch(330, 47 + 22 * k, line, color, None)
    svg.text(330, 130, "Ranks numbered as init_device_mesh does: the last dimension (tp) fastest.", fill=INK)
    return svg.render()


MEMORY_PARTS = (("params", "fp16 parameters", OWNER_FILL[0]), ("grads", "fp16 gradients", OWNER_FILL[1]),
                ("optimizer", "optimizer states", OWNER_FILL[3]), ("activations", "activations", OWNER_FILL[2]))
MEMORY_CONFIGS = (("DDP", {"stage": 0}), ("ZeRO-1", {"stage": 1}), ("ZeRO-2", {"stage": 2}), ("ZeRO-3", {"stage": 3}),
                  ("ZeRO-3 + full recompute + optimizer offload",
                   {"stage": 3, "recompute": "full", "offload_optimizer": True}))


def memory_70b_numbers(model: str = "llama2-70b", devices: int = 8, device_type: str = "a100-80gb") -> dict:
    """The GB per device the 70B figure draws, from :func:`labkit.memory.estimate_memory` with the
    defaults of ``python -m labkit.planning memory`` (micro-batch 1, the model's context, mixed precision)."""
    dev = ACCELERATORS[device_type]
    bars = {}
    for label, kw in MEMORY_CONFIGS:
        e = estimate_memory(model, micro_batch=1, world_size=devices, device_memory_gb=dev.memory_gb, **kw)
        bars[label] = {"params": e.params / GB, "grads": e.grads / GB, "optimizer": e.optimizer / GB,
                       "activations": (e.activations + e.head) / GB, "host": e.host_bytes / GB}
    return {"model": model, "devices": devices, "device": dev.name, "device_gb": dev.memory_gb, "bars": bars}


def memory_70b(numbers: dict | None = None) -> str:
    """Per-device memory of the memory chapter's 70B scenario under DDP and ZeRO stages 1-3
    (Rajbhandari et al. 2020, section 3), each bar's parts from :func:`memory_70b_numbers`,
    against the device's memory."""
    nb = numbers or memory_70b_numbers()
    bars, x0, scale, pitch, bottom = nb["bars"], 190, 0.45, 54, 44 + 54 * len(nb["bars"])
    svg = Svg(820, bottom + 40, f"Memory per GPU of {nb['model']} on {nb['devices']} x {nb['device']}")
    top = max(sum(p[q] for q, _, _ in MEMORY_PARTS) for p in bars.values())
    for gb in range(0, int(top) + 1, 200):
        svg.add("path", d=f"M{num(x0 + gb * scale)},40 L{num(x0 + gb * scale)},{bottom}", stroke="#ddd")
        svg.text(x0 + gb * scale, bottom + 16, f"{gb:,}", anchor="middle", fill=INK)
    svg.text(x0 - 10, bottom + 16, "GB per GPU", anchor="end", fill=INK)
    for k, (part, label, fill) in enumerate(MEMORY_PARTS):
        svg.swatch(x0 + 140 * k, 25, label, fill)
    for k, (name, parts) in enumerate(bars.items()):
        y, x = 48 + pitch * k, x0
        for i, line in enumerate(name.rsplit(" + ", 1) if len(name) > 24 else [name]):
            svg.text(x0 - 10, y + 16 + 16 * i, ("+ " if i else "") + line, anchor="end")
        for part, _, fill in MEMORY_PARTS:
            svg.rect(x, y, parts[part] * scale, 22, fill=fill, stroke=INK, stroke_width=0.6, data_config=name,
                     data_part=part, data_gb=f"{parts[part]:.1f}")
            x += parts[part] * scale
        total = sum(parts[p] for p, _, _ in MEMORY_PARTS)
        terms = ", ".join(f"{parts[p]:.1f}" for p, _, _ in MEMORY_PARTS)
        host = f"; optimizer states ({parts['host']:.1f} GB) in host memory" if parts["host"] else ""
        svg.text(x0, y + 36, f"{total:,.1f} GB in all: {terms}{host}", fill=INK, data_total_gb=f"{total:.1f}")
    line = x0 + nb["device_gb"] * scale
    for y in range(44, bottom, pitch):  # the device line, broken where the numbers are written
        svg.add("path", d=f"M{num(line)},{y} L{num(line)},{y + 28}", stroke=ALERT, stroke_width=2,
                stroke_dasharray="5 3")
    svg.text(line + 6, bottom + 32, f"{nb['device_gb']:.0f} GB: one {nb['device']}", fill=ALERT)
    return svg.render()


FIGURES = {"zero_holdings.svg": zero_holdings, "tp_split.svg": tp_split, "pp_schedules.svg": pp_schedules,
           "device_mesh.svg": device_mesh, "memory_70b.svg": memory_70b, "collectives.svg": collectives, **MESH,
           **FAILURES}


def write_all(out_dir: str | Path = IMAGES) -> list[Path]:
    """Write every schematic into ``out_dir`` (default ``book/images``); the paths written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, draw in FIGURES.items():
        (out / name).write_text(draw(), encoding="utf-8")
    return [out / name for name in FIGURES]


if __name__ == "__main__":
    print(*write_all(sys.argv[1] if len(sys.argv) > 1 else IMAGES), sep="\n")
