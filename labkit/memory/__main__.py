"""``python -m labkit.memory`` is no command any more: the planner's command line is
``python -m labkit.planning memory`` (same flags, same output). One line saying so, exit status 2.
Nothing of :mod:`labkit.planning` is imported: the memory package sits below it."""
import sys

print("python -m labkit.memory: error: this command became `python -m labkit.planning memory` (same flags)",
      file=sys.stderr)
sys.exit(2)
