"""Lab pages a reader can read: every line of code, and every line a lab prints, fits the book's page
column."""
import json

import jupytext
import pytest

from labkit.labs import LABS_DIR, OUT_DIR, list_labs

MAX_CODE_LINE = 90  # characters: wider lines scroll sideways on the rendered page
# What a lab prints: a little wider than its code (labkit.labs.columns wraps at 90), never a 500-character
# line the reader scrolls for (issue 46, item 12).
MAX_OUTPUT_LINE = 100


@pytest.mark.parametrize("lab", list_labs())
def test_every_code_line_fits_the_page_column(lab):
    nb = jupytext.read(LABS_DIR / f"{lab}.md")
    too_long = [f"cell {i}, line {j}: {len(line)} characters: {line[:60]}..."
                for i, cell in enumerate(nb.cells) if cell.cell_type == "code"
                for j, line in enumerate(cell.source.splitlines(), 1)
                if len(line) > MAX_CODE_LINE]
    assert not too_long, f"{lab}: lines over {MAX_CODE_LINE} characters:\n" + "\n".join(too_long)


def _output_lines(lab: str) -> list[str]:
    nb = json.loads((OUT_DIR / f"{lab}.ipynb").read_text())
    return [f"cell {i}: {len(line)} characters: {line[:60]}..."
            for i, cell in enumerate(nb["cells"]) if cell["cell_type"] == "code"
            for out in cell.get("outputs", []) if out.get("output_type") == "stream"
            for line in "".join(out["text"]).splitlines() if len(line) > MAX_OUTPUT_LINE]


@pytest.mark.parametrize("lab", list_labs())
def test_every_printed_line_fits_the_page_column(lab, lab_metrics):
    """The executed lab (the ci profile, as the book shows it): no stream output line over the column."""
    assert lab in lab_metrics
    too_long = _output_lines(lab)
    assert not too_long, f"{lab}: printed lines over {MAX_OUTPUT_LINE} characters:\n" + "\n".join(too_long)


@pytest.mark.parametrize("lab", list_labs())
def test_every_lab_opens_with_one_setup_call(lab):
    """Issue 47: a lab's first cell after its parameters makes its profile, model and base run with one
    call (labkit.labs.start), not a dozen lines copied from lab to lab."""
    code = [c.source for c in jupytext.read(LABS_DIR / f"{lab}.md").cells if c.cell_type == "code"]
    assert code[1].count(f'start("{lab}", PROFILE, GPUS, OVERRIDES') == 1, code[1][:400]
    assert not any("resolve(" in c or "textwrap.fill(f\"profile" in c for c in code), lab


def test_the_labs_are_at_most_three_code_lines_to_one_of_prose():
    """Issue 47: thin labs. Over every lab, the non-blank, non-comment lines of code cells (exercises
    included) are at most three times the non-blank lines of markdown: the computation lives in labkit,
    and the page says what each cell measures and how to read it."""
    code = prose = 0
    for lab in list_labs():
        for cell in jupytext.read(LABS_DIR / f"{lab}.md").cells:
            lines = [ln.strip() for ln in cell.source.splitlines() if ln.strip()]
            if cell.cell_type == "code":
                code += sum(not ln.startswith("#") for ln in lines)
            elif cell.cell_type == "markdown":
                prose += len(lines)
    assert code <= 3 * prose, f"{code} code lines to {prose} of prose: {code / prose:.2f} to 1"
