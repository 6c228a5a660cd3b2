"""The course's autograde settings, one function every nbgrader_config.py calls.

Two of nbgrader's autograde steps are swapped for the course's: the kernel runs in the sandbox
(:class:`SandboxedExecute`, :mod:`labkit.course.sandbox`) and locked cells are restored without the
false alarm on an untouched hidden-tests cell (:mod:`labkit.course.overwrite`). nbgrader's ``Execute``
sets ``kernel_manager_class`` itself, over any ``c.Execute.kernel_manager_class`` in a config
(``nbgrader/preprocessors/execute.py``), so the sandbox comes with a subclass in the preprocessor list,
not with that setting.
"""
from __future__ import annotations

from typing import Any

from nbgrader.preprocessors import Execute, OverwriteCells

from labkit.course.overwrite import OverwriteCellsAsReleased
from labkit.course.sandbox import SandboxedKernelManager


class SandboxedExecute(Execute):
    """nbgrader's :class:`Execute`, its kernels in the sandbox."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["kernel_manager_class"] = SandboxedKernelManager
        super().__init__(*args, **kwargs)


def sandboxed_grading(c: Any) -> None:
    """Set the nbgrader config ``c`` (``get_config()``) so that autograde runs each submission in the
    sandbox and warns only for a locked cell the student edited; nbgrader's other steps as they are."""
    from nbgrader.converters import Autograde

    defaults = {name: Autograde.class_traits()[name].make_dynamic_default()
                for name in ("autograde_preprocessors", "sanitize_preprocessors")}
    c.Autograde.autograde_preprocessors = [SandboxedExecute if p is Execute else p
                                           for p in defaults["autograde_preprocessors"]]
    c.Autograde.sanitize_preprocessors = [OverwriteCellsAsReleased if p is OverwriteCells else p
                                          for p in defaults["sanitize_preprocessors"]]
