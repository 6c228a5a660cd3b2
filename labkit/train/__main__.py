"""``python -m labkit.train``, ``torchrun -m labkit.train``, ``deepspeed --module labkit.train``."""
import sys

from labkit.train.cli import main

sys.exit(main())
