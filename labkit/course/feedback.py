"""Feedback a student may keep: nbgrader's report without the hidden tests.

nbgrader puts the hidden tests back before autograding and, by design, leaves them in the HTML
feedback (jupyter/nbgrader#917: "that's intentional"), so ``release_feedback`` would hand every
student the tests the release kept from them. ``course/nbgrader_config.py`` adds
:class:`FeedbackWithoutHiddenTests` to ``GenerateFeedback.preprocessors``.
"""
from __future__ import annotations

from nbgrader.preprocessors import ClearHiddenTests
from traitlets import default


class FeedbackWithoutHiddenTests(ClearHiddenTests):
    """nbgrader's :class:`ClearHiddenTests` (what ``generate_assignment`` runs) for the feedback: the
    region between ``### BEGIN HIDDEN TESTS`` and ``### END HIDDEN TESTS`` leaves the source, and a
    failed test's error keeps only its type: its traceback quotes the failing line, and an assertion's
    message may hold the test's inputs and the expected answer. A student's answer that happens to
    contain the delimiters costs that cell its text, not the student their feedback."""

    def preprocess_cell(self, cell, resources, cell_index):
        if self._remove_hidden_test_region(cell):
            for out in cell.get("outputs", []):
                if out.get("output_type") == "error":
                    out["evalue"] = "a hidden test failed"
                    out["traceback"] = [f"{out.get('ename', 'Error')}: a hidden test failed"]
        return cell, resources

    @default("enforce_metadata")
    def _no_enforcing(self) -> bool:
        return False
