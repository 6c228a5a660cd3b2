"""Command lines whose errors are one line: ``prog: error: ...`` and exit status 2, never a traceback."""
from __future__ import annotations

import argparse
import sys
from typing import NoReturn


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` that reports a bad argument in one line (no usage block): the line
    names the parameter and what would be valid; ``--help`` shows the usage."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)
