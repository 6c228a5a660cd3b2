# JupyterHub's configuration for a class on one machine (`make hub`, book/instructors.md).
# `python -m labkit.course.hub serve` starts JupyterHub with this file and LABKIT_HUB_STATE set to the
# state folder, whose hub.json holds what was asked for (address, GPU pool, limits per server).
import os

from labkit.course.hub import configure

configure(get_config(), os.environ["LABKIT_HUB_STATE"])  # noqa: F821 - get_config: JupyterHub's
