"""labkit: the working implementations behind the Training at Scale labs.

One technique per module; notebooks import these and only orchestrate and plot.
"""
__version__ = "0.1.0"
