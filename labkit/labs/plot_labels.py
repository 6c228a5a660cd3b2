"""Labels beside a scatter's points that neither overlap each other nor cover a point or a line.

A roofline plot puts ops with similar intensity and rate next to each other (the unfused attention's
two matmuls, a norm and the softmax), and fixed offsets print their names on top of one another. Each
label here takes the first of a few positions around its point whose box, measured by the renderer,
stays inside the axes and clear of the labels already placed, of every point and of the obstacles
given (samples of a drawn line). Far positions get a thin line back to their point.
"""
from __future__ import annotations

# Offsets in points, tried in order: right, left, above, below, the corners, then further out.
_NEAR = ((6, 0, "left"), (-6, 0, "right"), (0, 9, "center"), (0, -9, "center"), (6, 8, "left"),
         (6, -8, "left"), (-6, 8, "right"), (-6, -8, "right"))
_FAR = tuple((dx, dy, ha) for dy in (18, -18, 28, -28, 38, -38)
             for dx, ha in ((0, "center"), (12, "left"), (-12, "right")))


def _annotate(ax, name, xy, offset, fontsize):
    dx, dy, ha = offset
    far = offset in _FAR
    va = "center" if abs(dy) < 5 else ("bottom" if dy > 0 else "top")
    line = dict(arrowstyle="-", lw=0.5, color="0.5", shrinkA=0, shrinkB=4) if far else None
    return ax.annotate(name, xy, xytext=(dx, dy), textcoords="offset points", fontsize=fontsize, ha=ha,
                       va=va, arrowprops=line)


def annotate_apart(ax, xs, ys, names, obstacles=(), fontsize: float = 7, marker_px: float = 5.0) -> list:
    """Annotate point ``i`` at ``(xs[i], ys[i])`` with ``names[i]``; return the annotations. ``obstacles``
    are more ``(x, y)`` data points no label may cover. Positions are chosen in display space: call it
    once the axes' limits, scales and the figure's layout are final."""
    from labkit.labs.no_plots import installed

    if installed():  # no matplotlib here (labkit.labs.no_plots): no figure, nothing to place
        return []
    fig = ax.figure
    fig.canvas.draw()  # a renderer, and the final transforms of the axes
    renderer = fig.canvas.get_renderer()
    points = [ax.transData.transform(xy) for xy in [*zip(xs, ys), *obstacles]]
    frame = ax.get_window_extent(renderer)
    placed, out = [], []
    for x, y, name in zip(xs, ys, names):
        chosen = None
        for offset in _NEAR + _FAR:
            a = _annotate(ax, name, (x, y), offset, fontsize)
            box = a.get_window_extent(renderer).expanded(1.06, 1.2)
            inside = frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 and box.y1 <= frame.y1
            covers = any(box.x0 - marker_px < qx < box.x1 + marker_px and box.y0 - marker_px < qy < box.y1 + marker_px
                         for qx, qy in points)
            if inside and not covers and not any(box.overlaps(b) for b in placed):
                chosen = (a, box)
                break
            a.remove()
        if chosen is None:  # nowhere clear: the first position
            a = _annotate(ax, name, (x, y), _NEAR[0], fontsize)
            chosen = (a, a.get_window_extent(renderer))
        placed.append(chosen[1])
        out.append(chosen[0])
    return out
