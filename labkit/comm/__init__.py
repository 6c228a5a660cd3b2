"""Collectives: what they cost, written by hand, and counted on the real ones.

* :mod:`labkit.comm.ring`: the ring all-reduce from point-to-point messages, and its bytes per rank.
* :mod:`labkit.comm.counter`: :class:`~labkit.comm.counter.CommCounter`, calls and payload bytes of
  every collective any strategy issues, and the ring-model volume they imply.
"""
