"""The seven collectives of the communication chapter, drawn before and after on four ranks.

Each panel shows every rank's buffer as four chunks. A letter names the rank the data came from
(A for rank 0, B for rank 1, ...), the digit the chunk; ``Σk`` is chunk ``k`` summed over the ranks.
Under each panel: what one rank sends under a ring algorithm, as a share of the buffer's S bytes,
which is nccl-tests' bus-bandwidth factor (NVIDIA nccl-tests, ``doc/PERFORMANCE.md``; Thakur,
Rabenseifner and Gropp 2005 for the algorithms).
"""
from __future__ import annotations

from labkit.labs.svg import INK, OWNER_FILL, OWNER_STROKE, Svg

N = 4
LETTERS = "ABCD"
SUM_FILL = "#c9c9c9"

def _own(r: int) -> list:
    return [(r, f"{LETTERS[r]}{k}") for k in range(N)]


def _sums() -> list:
    return [(None, f"Σ{k}") for k in range(N)]


def _only(k: int, cell) -> list:
    return [cell if j == k else None for j in range(N)]


# name -> (before, after, what a rank sends); before/after: a row of N cells per rank, each cell
# (owner rank, or None for a sum; its label), or None for an empty chunk
PANELS = {
    "broadcast": ([_own(0)] + [[None] * N] * (N - 1), [_own(0)] * N, "S from the root (pipelined): factor 1"),
    "reduce": ([_own(r) for r in range(N)], [_sums()] + [_own(r) for r in range(1, N)],
               "S towards the root: factor 1"),
    "all-reduce": ([_own(r) for r in range(N)], [_sums()] * N,
                   "2(n-1)/n x S: reduce-scatter + all-gather"),
    "reduce-scatter": ([_own(r) for r in range(N)], [_only(r, (None, f"Σ{r}")) for r in range(N)],
                       "(n-1)/n x S"),
    "all-gather": ([_only(r, (r, f"{LETTERS[r]}{r}")) for r in range(N)],
                   [[(k, f"{LETTERS[k]}{k}") for k in range(N)]] * N, "(n-1)/n x S"),
    "all-to-all": ([_own(r) for r in range(N)], [[(j, f"{LETTERS[j]}{r}") for j in range(N)] for r in range(N)],
                   "(n-1)/n x S: chunk j goes to rank j"),
    "send/recv": ([_own(r) for r in range(N)], [_own((r - 1) % N) for r in range(N)],
                  "S to the next rank, S from the last: factor 1"),
}


def _buffers(svg: Svg, x: float, y: float, rows: list, cell: float) -> None:
    for r, row in enumerate(rows):
        for k, c in enumerate(row):
            cx, cy = x + k * cell, y + r * (cell + 4)
            if c is None:
                svg.rect(cx, cy, cell, cell, fill="white", stroke="#aaa", stroke_width=0.8, stroke_dasharray="3 2")
                continue
            owner, label = c
            fill, stroke = (SUM_FILL, INK) if owner is None else (OWNER_FILL[owner], OWNER_STROKE[owner])
            svg.rect(cx, cy, cell, cell, fill=fill, stroke=stroke, stroke_width=0.8)
            svg.text(cx + cell / 2, cy + cell / 2 + 4, label, anchor="middle", size=10)


def _panel(svg: Svg, x: float, y: float, name: str) -> None:
    before, after, sends = PANELS[name]
    cell = 22
    svg.text(x + 150, y, name, anchor="middle", size=14, weight="bold")
    for r in range(N):
        svg.text(x + 40, y + 22 + r * (cell + 4) + cell / 2, f"rank {r}", anchor="end", size=11)
    _buffers(svg, x + 48, y + 14, before, cell)
    mid = y + 14 + 2 * (cell + 4) - 2
    svg.arrow(x + 48 + N * cell + 10, mid, x + 48 + N * cell + 50, mid)
    _buffers(svg, x + 48 + N * cell + 60, y + 14, after, cell)
    svg.text(x + 150, y + 14 + N * (cell + 4) + 16, f"a rank sends {sends}", anchor="middle", size=11, fill=INK)


def collectives() -> str:
    """The seven collectives of ``torch.distributed`` the chapter times, before and after, on 4 ranks."""
    svg = Svg(980, 560, "Seven collectives on four ranks: every rank's buffer before and after")
    names = list(PANELS)
    for i, name in enumerate(names):
        _panel(svg, 20 + (i % 3) * 320, 24 + (i // 3) * 175, name)
    lx, ly = 660, 24 + 2 * 175 + 30
    for r in range(N):
        svg.swatch(lx, ly + r * 20, f"data from rank {r} ({LETTERS[r]}0-{LETTERS[r]}3: its four chunks)",
                   OWNER_FILL[r], OWNER_STROKE[r])
    svg.swatch(lx, ly + N * 20, "Σk: chunk k summed over every rank", SUM_FILL)
    svg.swatch(lx, ly + (N + 1) * 20, "nothing (or not yet)", "white", "#aaa", stroke_dasharray="3 2")
    return svg.render()
