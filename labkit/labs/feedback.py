"""Feedback a student may keep: nbgrader's report without the hidden tests.

nbgrader puts the hidden tests back before autograding and, by design, leaves them in the HTML
feedback (jupyter/nbgrader#917: "that's intentional"), so ``release_feedback`` would hand every
student the tests the release kept from them. ``course/nbgrader_config.py`` adds
:class:`FeedbackWithoutHiddenTests` to ``GenerateFeedback.preprocessors``.
"""
from __future__ import annotations

from nbgrader.preprocessors import ClearHiddenTests


class FeedbackWithoutHiddenTests(ClearHiddenTests):
    """nbgrader's :class:`ClearHiddenTests` (what ``generate_assignment`` runs) for the feedback: the
    region between ``### BEGIN HIDDEN TESTS`` and ``### END HIDDEN TESTS`` leaves the source, and a
    failed test's traceback, which quotes the failing line, is cut to its last line (the error and its
    message: what the student needs to see why the answer lost its points)."""

    def preprocess_cell(self, cell, resources, cell_index):
        if self._remove_hidden_test_region(cell):
            for out in cell.get("outputs", []):
                if out.get("output_type") == "error":
                    out["traceback"] = [f"{out.get('ename', 'Error')}: {out.get('evalue', '')}"]
        return cell, resources
