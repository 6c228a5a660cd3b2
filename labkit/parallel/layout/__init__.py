"""What a layout is: its degrees, the device mesh and its groups, and what a layout cannot do or holds.

The foundation the techniques and :mod:`labkit.parallel.compose` stand on."""
