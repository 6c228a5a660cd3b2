"""``python -m labkit`` is the lab runner (see :mod:`labkit.labs.cli`)."""
import sys

from labkit.labs.cli import main

sys.exit(main())
