"""``python -m labkit.memory``: the planning command line (:mod:`labkit.planning.cli`), under the name
the memory chapter teaches."""
import sys

from labkit.planning.cli import main

sys.exit(main())
