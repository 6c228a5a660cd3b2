"""``python -m labkit.planning``: ranked layouts for a global batch (:mod:`labkit.planning.plan_cli`)."""
import sys

from labkit.planning.plan_cli import main

sys.exit(main())
