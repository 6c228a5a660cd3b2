"""``python -m labkit`` is the lab runner (see ``labkit.labs``)."""
import sys

from labkit.labs import main

sys.exit(main())
