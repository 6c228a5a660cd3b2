"""The old import path of sequence packing; it lives in :mod:`labkit.feeding.packing`."""
from labkit.feeding.packing import OVERFLOW, check_lengths, lower_bound, pack  # noqa: F401
