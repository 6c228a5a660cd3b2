"""Lab output that fits the book's page column (tests/test_lab_style.py holds every line to 100).

:func:`fit` wraps prose-like lines at spaces, indenting what continues a line under its start, and
leaves short lines (tables) as they are; :func:`hard_wrap` cuts text that has no spaces to break at,
such as a character model's samples, into pieces of the column's width.
"""
from __future__ import annotations

import textwrap

WIDTH = 90  # the lab pages' code column; outputs are held to 100 characters


def fit(text: str, width: int = WIDTH, indent: str = "    ") -> str:
    """``text`` with every line longer than ``width`` wrapped at spaces; a continuation is indented by the
    line's own leading spaces plus ``indent``."""
    out = []
    for line in text.splitlines():
        if len(line) <= width:
            out.append(line)
            continue
        lead = line[:len(line) - len(line.lstrip())]
        out.append(textwrap.fill(line.strip(), width, initial_indent=lead, subsequent_indent=lead + indent,
                                 break_on_hyphens=False))
    return "\n".join(out)


def hard_wrap(text: str, width: int = WIDTH) -> str:
    """``text`` with every line cut into pieces of at most ``width`` characters (nothing dropped)."""
    return "\n".join(line[i:i + width] for line in text.splitlines() for i in range(0, max(len(line), 1), width))
