"""A few SVG primitives in the style of the book's hand-drawn ``book/images/ring_allreduce.svg``.

Sans-serif at 13-14 px, ranks as rounded boxes filled ``#dbe9f6`` and stroked ``#2a6fb0``, arrows
in ``#444`` with the ring figure's arrowhead, a ``<title>``. Coordinates print with at most two
decimals, so the same drawing always gives the same bytes (:mod:`labkit.labs.schematics` relies
on it: its test regenerates every figure and compares).
"""
from __future__ import annotations

from xml.sax.saxutils import escape, quoteattr

INK = "#444"
RANK_FILL, RANK_STROKE = "#dbe9f6", "#2a6fb0"
OWNER_FILL = ("#8fb8e0", "#f3c08a", "#9fd3a9", "#cdb3e0")  # one shade per rank: who owns a shard
OWNER_STROKE = ("#2a6fb0", "#c0701f", "#2f8a4c", "#7d4fa0")
ALERT = "#c0392b"
_ARROW = ('  <defs>\n    <marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" '
          'markerHeight="7" orient="auto">\n      <path d="M0,0 L10,5 L0,10 z" fill="#444"/>\n'
          '    </marker>\n  </defs>\n')


def num(x: float) -> str:
    """A coordinate or a value as text: at most two decimals, no trailing zeros, never ``-0``."""
    s = f"{x:.2f}".rstrip("0").rstrip(".")
    return "0" if s == "-0" else s


def _attrs(attrs: dict) -> str:
    out = []
    for key, value in attrs.items():
        if value is None:
            continue
        value = num(value) if isinstance(value, float) else str(value)
        out.append(f" {key.rstrip('_').replace('_', '-')}={quoteattr(value)}")
    return "".join(out)


class Svg:
    """An SVG document built element by element; :meth:`render` gives its text."""

    def __init__(self, width: int, height: int, title: str, font_size: int = 13) -> None:
        self.width, self.height, self.title, self.font_size = width, height, title, font_size
        self.parts: list[str] = []

    def add(self, tag: str, text: str | None = None, **attrs: object) -> None:
        """One element; ``data_gb=1.5`` becomes ``data-gb="1.5"``, ``class_`` becomes ``class``."""
        if text is None:
            self.parts.append(f"  <{tag}{_attrs(attrs)}/>")
        else:
            self.parts.append(f"  <{tag}{_attrs(attrs)}>{escape(text)}</{tag}>")

    def comment(self, text: str) -> None:
        self.parts.append(f"  <!-- {text.replace('--', '-')} -->")

    def rect(self, x: float, y: float, w: float, h: float, fill: str = RANK_FILL, stroke: str | None = RANK_STROKE,
             rx: float | None = None, **attrs: object) -> None:
        self.add("rect", x=float(x), y=float(y), width=float(w), height=float(h), rx=rx, fill=fill,
                 stroke=stroke, **attrs)

    def text(self, x: float, y: float, s: str, anchor: str | None = None, size: int | None = None,
             weight: str | None = None, fill: str | None = None, **attrs: object) -> None:
        self.add("text", s, x=float(x), y=float(y), text_anchor=anchor, font_size=size, font_weight=weight,
                 fill=fill, **attrs)

    def arrow(self, x1: float, y1: float, x2: float, y2: float, stroke: str = INK, width: float = 1.5,
              head: bool = True, **attrs: object) -> None:
        """A straight line, with the ring figure's arrowhead at its end unless ``head=False``."""
        self.add("path", d=f"M{num(x1)},{num(y1)} L{num(x2)},{num(y2)}", stroke=stroke, stroke_width=width,
                 fill="none", marker_end="url(#arrow)" if head else None, **attrs)

    def rank_box(self, x: float, y: float, w: float, h: float, label: str, size: int | None = None) -> None:
        """A rank as the ring figure draws one: a rounded blue box with its name in the middle."""
        self.rect(x, y, w, h, rx=6)
        self.text(x + w / 2, y + h / 2 + 4.5, label, anchor="middle", size=size)

    def box(self, x: float, y: float, w: float, h: float, label: str, **text_attrs: object) -> None:
        """An operation or a tensor: a white box outlined in ink, its label in the middle."""
        self.rect(x, y, w, h, fill="white", stroke=INK, rx=4)
        self.text(x + w / 2, y + h / 2 + 5, label, anchor="middle", **text_attrs)

    def swatch(self, x: float, y: float, label: str, fill: str, stroke: str | None = INK, w: float = 14,
               **attrs: object) -> None:
        """A legend entry: a small box of ``fill`` whose text baseline is ``y``."""
        self.rect(x, y - 11, w, 12, fill=fill, stroke=stroke, stroke_width=0.8, **attrs)
        self.text(x + w + 6, y, label)

    def render(self) -> str:
        head = (f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {self.width} {self.height}" '
                f'font-family="sans-serif" font-size="{self.font_size}">\n  <title>{escape(self.title)}</title>\n')
        body = '  <rect width="100%" height="100%" fill="white"/>\n' + "\n".join(self.parts)
        return head + _ARROW + body + "\n</svg>\n"
