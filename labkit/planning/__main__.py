"""``python -m labkit.planning SUBCOMMAND``: plan a training run; the subcommand names the question.

    python -m labkit.planning memory --model llama2-70b --devices 8 --device-type a100-80gb
    python -m labkit.planning layouts --model llama3-405b --devices 16384 --global-batch 16M

``memory`` is :mod:`labkit.planning.memory_cli`, ``layouts`` :mod:`labkit.planning.layouts_cli`; each
takes its own flags (``SUBCOMMAND --help``). Without a subcommand: one line naming both, exit status 2.
"""
from __future__ import annotations

import importlib
import sys

PROG = "python -m labkit.planning"
# subcommand -> (its module, one line for --help)
SUBCOMMANDS = {
    "memory": ("labkit.planning.memory_cli", "memory per device, the strategy to run and its price, for a "
               "micro-batch per device"),
    "layouts": ("labkit.planning.layouts_cli", "the layouts that fit a global batch, ranked by predicted step time"),
}
NAMES = " or ".join(SUBCOMMANDS)


def usage() -> str:
    width = max(map(len, SUBCOMMANDS))
    lines = [f"usage: {PROG} {{{','.join(SUBCOMMANDS)}}} [flags]", "", __doc__.splitlines()[0].split(": ", 1)[1],
             "", "subcommands:"]
    lines += [f"  {name:{width}}  {what}" for name, (_, what) in SUBCOMMANDS.items()]
    return "\n".join([*lines, "", f"{PROG} SUBCOMMAND --help lists its flags."])


def main(argv: list[str] | None = None) -> int:
    """Run the subcommand ``argv[0]`` names on the rest of ``argv``. ``--help`` alone: the usage, exit 0;
    anything else without a subcommand first: one line naming the valid ones, exit status 2."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in SUBCOMMANDS:
        return importlib.import_module(SUBCOMMANDS[argv[0]][0]).main(argv[1:])
    if argv in (["-h"], ["--help"]):
        print(usage())
        return 0
    given = f"got {argv[0]!r}" if argv else "none given"
    print(f"{PROG}: error: a subcommand comes first: {NAMES} ({given}; {PROG} --help)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
