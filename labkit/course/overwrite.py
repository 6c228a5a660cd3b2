"""Autograde's cell restore, silent for a cell handed in exactly as it was released.

nbgrader's ``generate_assignment`` stores every locked cell's checksum in the gradebook
(``SaveCells``) before it takes the hidden tests out (``ClearHiddenTests``), so the release's
hidden-tests cell never matches its stored checksum. ``autograde``'s ``OverwriteCells`` restores each
locked cell from the gradebook and warns "Attribute 'checksum' for cell ... has changed!" whenever
the checksums differ: for every student, including one who changed nothing. An instructor told that
a test was tampered with suspects the student.

:class:`OverwriteCellsAsReleased` first compares a locked cell with its released form (the source
with the hidden tests taken out, as the release did). When they are equal the cell is restored
silently; a cell the student did edit is still restored and still warned about. The course's
``nbgrader_config.py`` names it in ``Autograde.sanitize_preprocessors``.
"""
from __future__ import annotations

from nbformat.notebooknode import NotebookNode
from nbgrader import utils
from nbgrader.api import MissingEntry
from nbgrader.preprocessors import ClearHiddenTests, OverwriteCells


class OverwriteCellsAsReleased(OverwriteCells):
    """nbgrader's :class:`OverwriteCells`, without the false alarm of the hidden-tests cell."""

    def preprocess_cell(self, cell: NotebookNode, resources: dict, cell_index: int):
        grade_id = cell.metadata.get("nbgrader", {}).get("grade_id")
        if grade_id and utils.is_locked(cell):
            try:
                source = self.gradebook.find_source_cell(grade_id, self.notebook_id, self.assignment_id)
            except MissingEntry:
                source = None
            if source is not None and source.locked:
                released = NotebookNode(cell_type=source.cell_type, source=source.source, metadata={})
                ClearHiddenTests(parent=self)._remove_hidden_test_region(released)
                if released.source == cell.source:  # as released: nothing to report
                    cell.source = source.source
        return super().preprocess_cell(cell, resources, cell_index)
