"""Collectives: what they cost, written by hand, counted on the real ones, timed and traced.

* :mod:`labkit.comm.ring`: the ring all-reduce from point-to-point messages, and its bytes per rank.
* :mod:`labkit.comm.p2p`: point-to-point exchanges that cannot deadlock under NCCL, and their checker.
* :mod:`labkit.comm.counter`: :class:`~labkit.comm.counter.CommCounter`, calls and payload bytes of
  every collective any strategy issues (per process group too), and the ring-model volume they imply.
* :mod:`labkit.comm.bench`: every collective timed over message sizes, nccl-tests' algbw and busbw
  (``torchrun ... -m labkit.comm.bench``).
* :mod:`labkit.comm.all_to_all`: what an all-to-all sends inside a node and out of it (the planner's
  and the expert-parallel lab's one formula).
* :mod:`labkit.comm.alpha_beta`: the latency-bandwidth model fitted to those times.
* :mod:`labkit.comm.trace`: a profiler trace as compute and communication lanes; exposed communication.
* :mod:`labkit.comm.slow_link`: a slower link, emulated by a DDP communication hook.
"""
