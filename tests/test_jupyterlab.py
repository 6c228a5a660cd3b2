"""The labs as a student meets them: JupyterLab from .venv, driven in a real browser.

One JupyterLab serves a copy of ``labs/`` (as ``make lab-ui`` does; the copy keeps the repository's
files as they are when the notebook is saved). Chromium, through Playwright, opens the released
student notebook of the memory lab's graded exercise, answers it, and validates it with nbgrader's
Validate button, right and wrong; and a link to a lab's markdown opens it as a notebook. A lab run
to its exercise in the browser, ranks, bars and figures, is tests/test_hub.py's (on the course's hub).
Screenshots go to ``_build/screenshots/`` (test artefacts, never committed).
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nbformat
import pytest
from playwright.sync_api import TimeoutError as PlaywrightTimeout

from labkit.labs import LABS_DIR
from labkit.labs.assignments import COURSE_DIR, generate

ROOT = Path(__file__).resolve().parent.parent
SHOTS = ROOT / "_build" / "screenshots"
SETTINGS = Path(sys.prefix) / "share" / "jupyter" / "lab" / "settings" / "overrides.json"


@pytest.fixture(scope="module")
def jupyterlab(tmp_path_factory):
    if not SETTINGS.is_file() or SETTINGS.read_text() != (ROOT / "cluster/jupyterhub/overrides.json").read_text():
        pytest.fail(f"{SETTINGS} is missing or differs from cluster/jupyterhub/overrides.json: run `make venv`")
    home = tmp_path_factory.mktemp("student")
    root = home / "labs"
    shutil.copytree(LABS_DIR, root, ignore=shutil.ignore_patterns("*.ipynb", ".ipynb_checkpoints"))
    token = os.urandom(16).hex()
    # The student's own settings, workspaces and config start empty, as on a first visit.
    # A student's server: no matplotlib backend forced by whatever ran before in this test process
    env = {**{k: v for k, v in os.environ.items() if k != "MPLBACKEND"}, "JUPYTER_CONFIG_DIR": str(home / ".jupyter"),
           "JUPYTERLAB_SETTINGS_DIR": str(home / ".settings"), "JUPYTERLAB_WORKSPACES_DIR": str(home / ".ws")}
    env.pop("LABKIT_PROGRESS", None)
    log = open(home / "jupyterlab.log", "w")
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "jupyter-lab"), "--no-browser", "--allow-root", "--port=0",
         "--ServerApp.ip=127.0.0.1", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = _wait_for_url(home / "jupyterlab.log", proc, token)
        yield dict(url=url, token=token, root=root, home=home)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def _wait_for_url(log: Path, proc: subprocess.Popen, token: str, timeout: float = 90) -> str:
    """The server's address (it picked a free port), once it answers."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"jupyter-lab exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        found = re.search(r"(http://127\.0\.0\.1:\d+)/lab", log.read_text())
        if found:
            try:
                urllib.request.urlopen(f"{found.group(1)}/api/status?token={token}", timeout=5)
                return found.group(1)
            except OSError:
                pass
        time.sleep(0.5)
    pytest.fail(f"jupyter-lab did not answer within {timeout} s:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def page(browser, jupyterlab):
    SHOTS.mkdir(parents=True, exist_ok=True)
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    p = context.new_page()
    p.set_default_timeout(60_000)
    p.goto(f"{jupyterlab['url']}/lab?token={jupyterlab['token']}")
    yield p
    context.close()


def _open_by_double_click(page, name: str):
    page.locator(".jp-DirListing-item", has_text=name).first.dblclick()
    panel = page.locator(f".jp-NotebookPanel:has(.jp-Notebook)").last
    panel.wait_for()
    return panel


def _set_cell(page, panel, index: int, source: str) -> None:
    editor = panel.locator(".jp-Cell").nth(index).locator(".cm-content")
    editor.click()
    page.keyboard.press("Control+a")
    page.keyboard.insert_text(source)
    page.keyboard.press("Escape")


def _released_memory_exercise(home: Path) -> Path:
    course = home / "course"
    course.mkdir()
    shutil.copy(COURSE_DIR / "nbgrader_config.py", course)
    (released,) = generate(["memory"], course)
    target = home / "labs" / "exercise" / "memory.ipynb"
    target.parent.mkdir()
    shutil.copy(released, target)
    return course / "source" / "memory" / "memory.ipynb"


def _answer(source_nb: Path) -> str:
    """The instructor's solution, as a student who solved it would type it."""
    nb = nbformat.read(source_nb, as_version=4)
    (cell,) = [c for c in nb.cells if c.metadata.get("nbgrader", {}).get("solution")]
    return re.sub(r"^\s*### (BEGIN|END) SOLUTION\n", "", cell.source, flags=re.M)


def _keep_browser_copy(page) -> bool:
    """Our save and the Validate button's own save can cross (seen once in CI): JupyterLab then asks
    whether the file "has changed on disk", and queues nbgrader's result behind that question. The
    copy in the browser is the one to validate."""
    if not page.locator(".jp-Dialog", has_text="has changed on disk").count():
        return False
    page.locator(".jp-Dialog").get_by_role("button", name="Overwrite").click()
    return True


def _validate(page, panel, jupyterlab, timeout_s: float = 240) -> str:
    """Save, press Validate, and return the text of nbgrader's result dialog.

    The button reads "Saving...", then "Validating..." while the server runs the notebook in a
    fresh kernel, then "Validate" again; only then is the result dialog complete. Without a
    result, the failure names every dialog on screen (a lost connection, a kernel prompt) and
    ends with the server's log."""
    page.keyboard.press("Control+s")
    tab = page.locator(".lm-TabBar-tab.lm-mod-current")
    deadline = time.monotonic() + 60
    while "jp-mod-dirty" in (tab.first.get_attribute("class") or "") and time.monotonic() < deadline:
        _keep_browser_copy(page)
        time.sleep(0.2)
    button = panel.locator(".jp-NotebookPanel-toolbar").get_by_text("Validate", exact=True)
    while True:  # a question about the file on disk may block the button
        _keep_browser_copy(page)
        try:
            button.click(timeout=2_000)
            break
        except PlaywrightTimeout:
            if time.monotonic() > deadline:
                raise
    labels = panel.locator(".jp-NotebookPanel-toolbar .jp-ToolbarButtonComponent-label")
    deadline = time.monotonic() + timeout_s
    texts: list[str] = []
    while time.monotonic() < deadline:
        texts = [t for t in page.locator(".jp-Dialog").all_inner_texts() if t.strip()]
        if _keep_browser_copy(page):
            continue
        busy = any(t.strip() in ("Saving...", "Validating...") for t in labels.all_inner_texts())
        if not busy and any(re.search("Success|failed|Error", t, re.I) for t in texts):
            return "\n".join(texts)
        time.sleep(0.5)
    page.screenshot(path=str(SHOTS / "jupyterlab-validate-timeout.png"))
    log = (jupyterlab["home"] / "jupyterlab.log").read_text()[-4000:]
    pytest.fail(f"no validation result within {timeout_s} s; dialogs: {texts}; "
                f"toolbar: {labels.all_inner_texts()}; server log:\n{log}")


def test_the_graded_exercise_validates_right_and_wrong_answers(page, jupyterlab):
    source_nb = _released_memory_exercise(jupyterlab["home"])
    page.locator(".jp-DirListing-item", has_text="exercise").first.dblclick()
    panel = _open_by_double_click(page, "memory.ipynb")
    page.locator(".jp-StatusBar-Widget", has_text="Python (labkit) | Idle").first.wait_for(timeout=120_000)
    cells = nbformat.read(jupyterlab["root"] / "exercise" / "memory.ipynb", as_version=4).cells
    index = next(i for i, c in enumerate(cells) if c.cell_type == "code" and "YOUR CODE HERE" in c.source)
    wrong = re.sub(r"^(\s*)raise NotImplementedError.*$", r"\1return 0", cells[index].source, flags=re.M)
    _set_cell(page, panel, index, wrong)
    failed = _validate(page, panel, jupyterlab)
    page.screenshot(path=str(SHOTS / "jupyterlab-exercise-wrong.png"))
    assert "ZeRO Figure 1 gives [120.0, 31.4, 16.6, 1.9] GB, got [0.0, 0.0, 0.0, 0.0]" in failed, failed
    page.locator(".jp-Dialog").get_by_role("button").last.click()

    _set_cell(page, panel, index, _answer(source_nb))
    passed = _validate(page, panel, jupyterlab)
    page.screenshot(path=str(SHOTS / "jupyterlab-exercise-validated.png"))
    assert "Success" in passed and "passes all" in passed, passed


def test_a_link_to_a_lab_opens_it_as_a_notebook(page, jupyterlab):
    """Where a link to a lab's markdown lands (`make lab-ui`, or a clone of the course): a
    /lab/tree/.../<lab>.md address, which opens in the default viewer, jupytext's notebook."""
    page.goto(f"{jupyterlab['url']}/lab/tree/strategy_cost.md?token={jupyterlab['token']}")
    page.locator(".lm-TabBar-tab.lm-mod-current", has_text="strategy_cost.md").first.wait_for()
    shown = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden)")
    shown.locator(".jp-CodeCell").first.wait_for()
    assert shown.count() == 1 and not page.locator(".jp-FileEditor:not(.lm-mod-hidden)").count()
