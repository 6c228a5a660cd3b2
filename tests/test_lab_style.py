"""Lab pages a reader can read: every line of code fits the book's page column."""
import jupytext
import pytest

from labkit.labs import LABS_DIR, list_labs

MAX_CODE_LINE = 90  # characters: wider lines scroll sideways on the rendered page


@pytest.mark.parametrize("lab", list_labs())
def test_every_code_line_fits_the_page_column(lab):
    nb = jupytext.read(LABS_DIR / f"{lab}.md")
    too_long = [f"cell {i}, line {j}: {len(line)} characters: {line[:60]}..."
                for i, cell in enumerate(nb.cells) if cell.cell_type == "code"
                for j, line in enumerate(cell.source.splitlines(), 1)
                if len(line) > MAX_CODE_LINE]
    assert not too_long, f"{lab}: lines over {MAX_CODE_LINE} characters:\n" + "\n".join(too_long)
