"""A whole term on the one-machine hub (``make hub``, book/instructors.md), driven in a real browser.

The hub runs as CI runs, as root, on a loopback port, with a state folder of its own and a GPU pool
of three made-up devices (nothing here has a GPU: each server must still get a different one). Two
students and an instructor are real unix users made for this run only, with passwords (PAM). The
instructor releases the memory lab's exercise from a terminal of theirs; each student logs in,
follows the book's launch link to the lab (a notebook in the course kernel, in its student form),
runs it at the ``ci`` profile, fetches the exercise from nbgrader's Assignments panel, answers it
(Alice right, Bob wrong) and submits. The hub restarts; nobody logs in again and nothing is lost.
The instructor collects, autogrades, exports the grades and releases feedback; each student fetches
it and sees a score and no hidden test. Bob's attempts to read Alice's work or the instructors' files
are refused by the filesystem. Screenshots go to ``_build/screenshots/hub/`` (artefacts, never
committed).
"""
from __future__ import annotations

import csv
import json
import os
import pwd
import re
import secrets
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

from labkit.core.ports import listen_port
from labkit.course.hub_limits import cgroup_paths, cgroup_v2
from labkit.course.student_labs import launch_url

ROOT = Path(__file__).resolve().parent.parent
SHOTS = ROOT / "_build" / "screenshots" / "hub"
LAB = "memory"  # the exercise: the quickest lab to grade
RUN = "data_parallel"  # the lab Alice runs: it starts ranks from the kernel, trains, draws figures
_RUN = secrets.token_hex(3)  # users and group of this run only: no existing account is touched
TEACH, ALICE, BOB = f"lt{_RUN}teach", f"lt{_RUN}alice", f"lt{_RUN}bob"
GROUP = f"lt{_RUN}grp"
PASSWORD = secrets.token_urlsafe(12)
GPUS = ["0", "1", "2"]


def _start(state: Path, port: int, log: Path) -> subprocess.Popen:
    # as the chapter starts it; the suite's interpreter is the one make would use (.venv's, or the image's)
    proc = subprocess.Popen(
        ["make", "--no-print-directory", "hub", f"HUB_STATE={state}", f"LABKIT_PYTHON={sys.executable}",
         f"HUB_OPTS=--port {port} --gpus {','.join(GPUS)} --cpus 2 --memory 4G"],
        stdout=open(log, "a"), stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the hub exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/hub/api/", timeout=5)
            return proc
        except OSError:
            time.sleep(0.5)
    pytest.fail(f"the hub did not answer within 120 s:\n{log.read_text()[-3000:]}")


def _stop(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    if os.geteuid() != 0 or not all(shutil.which(t) for t in ("useradd", "runuser", "chpasswd")):
        pytest.skip("the hub makes unix users and starts servers as them: it needs root (CI runs as root)")
    from labkit.course.hub_state import prepare_state

    shutil.rmtree(SHOTS, ignore_errors=True)  # this run's steps only
    SHOTS.mkdir(parents=True)
    state = Path("/tmp") / f"labkit-hub-{_RUN}"  # /tmp, not pytest's folder under /root: the users reach it
    log = tmp_path_factory.mktemp("hub") / "hub.log"
    made: list[str] = []
    proc = None
    try:
        prepare_state(state, group=GROUP)
        for role, names in (("instructor", [TEACH]), ("student", [ALICE, BOB])):
            made += names
            # as the chapter has it: `export HUB_STATE=...`, then `add` with no --state (issue 44, item 4)
            added = subprocess.run([sys.executable, "-m", "labkit.course.hub", "add", "--role", role,
                                    "--password-stdin", *names], input=PASSWORD + "\n", text=True, cwd=ROOT,
                                   capture_output=True, env={**os.environ, "HUB_STATE": str(state)})
            assert added.returncode == 0, added.stderr[-2000:]
            for name in names:  # it says what it did
                assert f"hub: enrolled {name} as {role} " in added.stdout and f" in {state}" in added.stdout, added.stdout
        for user in (TEACH, BOB):  # the test reads their terminals' screens
            _screen_reader(user)
        port = listen_port()  # not one an outgoing connection can take while the hub installs
        proc = _start(state, port, log)
        hub = dict(url=f"http://127.0.0.1:{port}", state=state, log=log, port=port, proc=proc)
        yield hub
        proc = hub["proc"]
    finally:
        if proc is not None:
            _stop(proc)
        for user in made:
            for _ in range(50):  # a killed process is gone a moment later
                subprocess.run(["pkill", "-KILL", "-u", user], capture_output=True)
                gone = subprocess.run(["userdel", "-r", user], capture_output=True, text=True)
                if gone.returncode != 8:  # 8: the user still has a process
                    break
                time.sleep(0.1)
            assert gone.returncode in (0, 6, 12), gone.stderr  # 6: never made; 12: home already gone
            for cgroup in (c for c in cgroup_paths(user) if c.is_dir()):  # the servers': empty once
                for _ in range(100):  # the kernel has let go of the killed processes
                    try:
                        cgroup.rmdir()
                        break
                    except OSError:
                        time.sleep(0.1)
        subprocess.run(["groupdel", GROUP], capture_output=True)
        subprocess.run(["umount", str(state / "exchange")], capture_output=True)  # its own file system
        shutil.rmtree(state, ignore_errors=True)


def _as(hub, user: str, *cmd: str, cwd: Path | None = None, ok: bool = True) -> subprocess.CompletedProcess:
    """``cmd`` as ``user`` in the environment the hub gives that user's terminals."""
    from labkit.course.hub import terminal_env

    env = {**terminal_env(hub["state"], user), "LABKIT_THREADS": "1"}
    home = Path(env["HOME"])
    proc = subprocess.run([shutil.which("runuser"), "-u", user, "--", *cmd], cwd=cwd or home, env=env, capture_output=True,
                          text=True, timeout=600)
    if ok:
        assert proc.returncode == 0, (cmd, proc.stdout[-2000:], proc.stderr[-3000:])
    return proc


def _refused(hub, code: str) -> str:
    proc = _as(hub, BOB, "python", "-c", code, ok=False)
    assert proc.returncode != 0 and "PermissionError" in proc.stderr, (code, proc.stdout, proc.stderr[-1500:])
    return proc.stderr.strip().splitlines()[-1]


def _login(browser, hub, user: str, url: str):
    """Open ``url`` as a student following a link would: the hub asks for a login first, then starts
    the server and sends them on to where the link pointed."""
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    page = context.new_page()
    page.set_default_timeout(120_000)
    # while the hub restarts its proxy is down, and JupyterLab asks whether to restart the server (it
    # runs on), or says the folder its file browser polls was not found (the proxy's 404, seen in CI):
    # the student dismisses that, as anyone would, whenever it comes up
    page.add_locator_handler(page.locator(".jp-Dialog", has_text=re.compile("Server unavailable|Directory not found")),
                             lambda dialog: dialog.get_by_role("button", name="Dismiss").click())
    page.goto(url)
    page.fill("#username_input", user)
    page.fill("#password_input", PASSWORD)
    page.click("#login_submit")
    return page


def _who(user: str) -> str:
    return user.removeprefix(f"lt{_RUN}")


CHAPTER = ROOT / "book" / "instructors.md"


def _chapter_block(after: str) -> list[str]:
    """The lines of the first bash block after the words ``after`` in the instructors' chapter: the
    test types the chapter's own text."""
    block = re.search(re.escape(after) + r".*?```bash\n(.*?)```", CHAPTER.read_text(), re.S)
    assert block, f"no bash block after {after!r} in {CHAPTER.name}"
    return [line for line in block[1].splitlines() if line.strip()]


def _chapter_inline(start: str) -> str:
    """The chapter's inline command that starts with ``start``."""
    (command,) = {c.replace("\n", " ") for c in re.findall(r"`(" + re.escape(start) + r"[^`]*)`", CHAPTER.read_text())}
    return re.sub(r"\s+", " ", command)


def _screen_reader(user: str) -> None:
    """JupyterLab's terminal setting "Screen Reader Mode" for ``user``: xterm then keeps the screen's
    rows as text in the page, where the test reads what the terminal shows."""
    folder = Path(pwd.getpwnam(user).pw_dir) / ".jupyter/lab/user-settings/@jupyterlab/terminal-extension"
    subprocess.run(["runuser", "-u", user, "--", "mkdir", "-p", str(folder)], check=True)
    subprocess.run(["runuser", "-u", user, "--", "sh", "-c", f"echo '{{\"screenReaderMode\": true}}' > "
                    f"{folder}/plugin.jupyterlab-settings"], check=True)


def _lab_open(page, hub, shot: str) -> None:
    """Wait for JupyterLab's main area; otherwise fail with the page and the hub's log."""
    try:
        page.locator("#jp-main-dock-panel").wait_for()
    except PlaywrightTimeout:
        _shot(page, f"{shot}-timeout")
        pytest.fail(f"JupyterLab did not open at {page.url}: {page.locator('body').inner_text()[:1000]}\n"
                    f"hub log:\n{hub['log'].read_text()[-4000:]}")


def _terminal(page):
    """A new terminal, as a person opens one: File, New, Terminal. Found as the terminal shown that was
    not there before (after a reload JupyterLab may restore an earlier one, hidden: CI once waited on
    that one)."""
    terms = page.locator("#jp-main-dock-panel .jp-Terminal")
    before = set(terms.evaluate_all("els => els.map(e => e.id)"))
    shown = "els => els.filter(e => e.checkVisibility()).map(e => e.id)"  # the opened one is the one shown
    new: list[str] = []
    for _ in range(2):  # a click while the restored layout still loads can be lost: once more
        page.locator(".lm-MenuBar-itemLabel", has_text=re.compile("^File$")).click()
        page.locator(".lm-Menu-itemLabel", has_text=re.compile("^New$")).first.hover()
        page.locator(".lm-Menu-itemLabel", has_text=re.compile("^Terminal$")).first.click()
        deadline = time.monotonic() + 60
        while not new and time.monotonic() < deadline:
            new = [i for i in terms.evaluate_all(shown) if i and i not in before]
            time.sleep(0.2)
        if new:
            break
    assert new, f"File > New > Terminal opened no terminal (there were {sorted(before)})"
    term = page.locator(f"#{new[-1]}")
    term.wait_for(state="visible")
    term.locator(".xterm-accessibility-tree").wait_for(state="attached")
    deadline = time.monotonic() + 60  # typing before bash's prompt is up loses the first keys
    while "$" not in term.locator(".xterm-accessibility-tree").inner_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    return term


def _type_in_terminal(page, term, lines: list[str], timeout_s: float = 600) -> str:
    """Type each line and Enter, then ``echo`` of its exit status; every status must be 0. Returns
    what the screen showed last."""
    screen = ""
    for i, line in enumerate(lines):
        term.click()
        page.keyboard.type(line)
        page.keyboard.press("Enter")
        page.keyboard.type(f'echo "__rc{i}_$?__"')
        page.keyboard.press("Enter")
        deadline = time.monotonic() + timeout_s
        while True:
            screen = term.locator(".xterm-accessibility-tree").inner_text()
            status = re.search(rf"__rc{i}_(\d+)__", screen)
            if status or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert status and status[1] == "0", f"{line!r} in the terminal:\n{screen[-3000:]}"
    return screen


def _shot(page, name: str) -> None:
    page.screenshot(path=str(SHOTS / f"{name}.png"))


def _set_cell(page, panel, index: int, source: str) -> None:
    editor = panel.locator(".jp-Cell").nth(index).locator(".cm-content")
    editor.click()
    page.keyboard.press("Control+a")
    page.keyboard.insert_text(source)
    page.keyboard.press("Escape")


def _save(page) -> None:
    """Save the notebook in front and wait until the save is done: JupyterLab marks its tab clean once
    the server has written the file. (The first current tab on the page is the sidebar's, never dirty:
    waiting on it let a Submit copy a notebook mid-save, and autograde failed on it in CI.)"""
    page.keyboard.press("Control+s")
    tab = page.locator("#jp-main-dock-panel .lm-TabBar-tab.lm-mod-current").first
    deadline = time.monotonic() + 60
    while "jp-mod-dirty" in (tab.get_attribute("class") or "") and time.monotonic() < deadline:
        time.sleep(0.2)


def _assignments(page):
    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile("^Nbgrader$")).click()
    items = page.locator(".lm-Menu-itemLabel", has_text=re.compile("^Assignment List$"))
    items.first.wait_for()
    # a student's server: the assignment list, not the formgrader or assignment creation
    menu = page.locator(".lm-Menu-content").last.all_text_contents()
    assert "Formgrader" not in " ".join(menu) and "Create assignment" not in " ".join(menu), menu
    items.first.click()
    panel = page.locator("#nbgrader-assignment-list")
    panel.wait_for()
    return panel


def _server_pid(user: str) -> int:
    out = subprocess.run(["pgrep", "-u", user, "-f", "jupyterhub.singleuser"], capture_output=True, text=True)
    return int(out.stdout.split()[0])


def _student_term(browser, hub, user: str, answer: str, run: str | None, validate: bool = False,
                  fetch_in_terminal: bool = False):
    """Follow the book's launch link (of the lab ``run``, which is run at the ci profile, or of the
    exercise's lab), then fetch (from the Assignments panel, or with the chapter's command in a
    terminal), answer and submit the exercise."""
    lab = run or LAB
    page = _login(browser, hub, user, launch_url(hub["url"], lab))  # the book's link, this hub's address
    panel = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden)").last
    panel.locator(".jp-CodeCell").first.wait_for()
    assert page.url.endswith(f"/user/{user}/lab/tree/labs/{lab}.ipynb"), page.url
    page.locator(".jp-StatusBar-Widget", has_text="Python (labkit) | Idle").first.wait_for()
    lab_nb = nbformat.read(Path(pwd.getpwnam(user).pw_dir) / "labs" / f"{lab}.ipynb", as_version=4)
    text = "\n".join(c.source for c in lab_nb.cells)
    assert "YOUR CODE HERE" in text and "BEGIN SOLUTION" not in text and "HIDDEN TESTS" not in text
    _shot(page, f"{_who(user)}-1-lab-opened")
    if run:
        _run_to_the_exercise(page, panel, lab_nb, user)

    if fetch_in_terminal:
        _type_in_terminal(page, _terminal(page), [_chapter_inline("nbgrader fetch_assignment")])
        _shot(page, f"{_who(user)}-3-fetched-in-a-terminal")
    assignments = _assignments(page)
    if not fetch_in_terminal:
        assignments.get_by_role("button", name="Fetch", exact=True).first.click()
    page.wait_for_function("() => document.querySelector('#nbgrader-assignment-list')?.innerText.includes('Submit')")
    _shot(page, f"{_who(user)}-3-fetched")
    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile("^File$")).click()
    page.locator(".lm-Menu-itemLabel", has_text=re.compile("^Open from Path")).first.click()
    page.locator(".jp-Dialog input").fill(f"{LAB}/{LAB}.ipynb")
    page.locator(".jp-Dialog").get_by_role("button", name="Open").click()
    # the graded notebook (the lab that is open too has the same name)
    nb_panel = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden)", has_text="Graded exercise").last
    nb_panel.locator(".jp-CodeCell").first.wait_for()
    fetched = nbformat.read(Path(pwd.getpwnam(user).pw_dir) / LAB / f"{LAB}.ipynb", as_version=4)
    index = next(i for i, c in enumerate(fetched.cells) if c.cell_type == "code" and "YOUR CODE HERE" in c.source)
    _set_cell(page, nb_panel, index, answer)
    if validate:  # nbgrader's Validate button runs the notebook and its visible tests
        failed = _validate(page, nb_panel, hub)
        _shot(page, f"{_who(user)}-3-validated")
        assert "ZeRO Figure 1 gives [120.0, 31.4, 16.6, 1.9] GB, got [0.0, 0.0, 0.0, 0.0]" in failed, failed
        page.locator(".jp-Dialog").get_by_role("button").last.click()
    _save(page)
    answered = nbformat.read(Path(pwd.getpwnam(user).pw_dir) / LAB / f"{LAB}.ipynb", as_version=4).cells[index].source
    assert "YOUR CODE HERE" not in answered, answered  # what is submitted is the answer, saved
    assignments = _assignments(page)
    assignments.get_by_role("button", name="Submit", exact=True).first.click()
    page.wait_for_function("() => document.querySelector('#nbgrader-assignment-list')?.innerText.match(/\\d{4}-\\d\\d-\\d\\d/)")
    _shot(page, f"{_who(user)}-4-submitted")
    return page


def _keep_browser_copy(page) -> bool:
    """Our save and the Validate button's own save can cross (seen once in CI): JupyterLab then asks
    whether the file "has changed on disk", and queues nbgrader's result behind that question. The
    copy in the browser is the one to validate."""
    if not page.locator(".jp-Dialog", has_text="has changed on disk").count():
        return False
    page.locator(".jp-Dialog").get_by_role("button", name="Overwrite").click()
    return True


def _validate(page, panel, hub, timeout_s: float = 240) -> str:
    """Save, press Validate, and return the text of nbgrader's result dialog.

    The button reads "Saving...", then "Validating..." while the server runs the notebook in a
    fresh kernel, then "Validate" again; only then is the result dialog complete. Without a result,
    the failure names every dialog on screen and ends with the hub's log."""
    _save(page)
    deadline = time.monotonic() + 60
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
    _shot(page, "validate-timeout")
    pytest.fail(f"no validation result within {timeout_s} s; dialogs: {texts}; "
                f"toolbar: {labels.all_inner_texts()}; hub log:\n{hub['log'].read_text()[-4000:]}")


def _run_to_the_exercise(page, panel, lab_nb, user: str) -> None:
    """Set the ci profile and run every cell: the lab runs up to its exercise, whose stub raises
    NotImplementedError until it is answered. Its ranks start from the kernel, as the student's user."""
    first = next(i for i, c in enumerate(lab_nb.cells) if c.cell_type == "code")
    assert 'PROFILE = "cpu"' in lab_nb.cells[first].source
    _set_cell(page, panel, first, lab_nb.cells[first].source.replace('PROFILE = "cpu"', 'PROFILE = "ci"'))
    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile("^Run$")).click()
    page.locator(".lm-Menu-itemLabel", has_text=re.compile("^Run All Cells$")).first.click()
    panel.locator(".jp-OutputArea-output", has_text="NotImplementedError").first.wait_for(timeout=420_000)
    outputs = panel.locator(".jp-OutputArea-output").all_text_contents()
    errors = [o for o in outputs if re.search(r"^\w+Error\b", o, re.M) and "NotImplementedError" not in o]
    assert not errors, errors[0][-2000:]
    text = "\n".join(outputs)
    assert "profile 'ci'" in text, text[:1000]
    # a lab that starts ranks says how many and where, before it starts them
    assert re.search(r"\[launch\] \w+ on 2 rank\(s\): CPU processes \(gloo\)", text), text[:2000]
    # the figures rendered (images the browser decoded); the training showed its progress as tqdm's
    # notebook widget, a rank's bar drawn by the kernel that launched it
    page.wait_for_function("n => document.querySelectorAll('.jp-RenderedImage img').length >= n", arg=2)
    images = panel.locator(".jp-RenderedImage img")
    sizes = []
    for i in range(images.count()):
        images.nth(i).scroll_into_view_if_needed()
        sizes.append(images.nth(i).evaluate("e => e.decode().then(() => e.naturalWidth)"))
    assert all(w > 0 for w in sizes), sizes
    bars = [" ".join(b.split()) for b in  # tqdm pads with figure spaces
            panel.locator(".jp-OutputArea-output .widget-hbox:has(.widget-hprogress)").all_text_contents()]
    assert any(b.startswith("single x1: 100%") for b in bars), bars  # trained in the kernel
    assert any(b.startswith("ddp x2: 100%") for b in bars), bars  # on two ranks, drawn by the kernel
    _shot(page, f"{_who(user)}-2-lab-ran-to-the-exercise")
    page.keyboard.press("Control+s")


def _answers(hub) -> tuple[str, str]:
    source = nbformat.read(hub["state"] / "course" / "source" / LAB / f"{LAB}.ipynb", as_version=4)
    (cell,) = [c for c in source.cells if c.metadata.get("nbgrader", {}).get("solution")]
    right = re.sub(r"^\s*### (BEGIN|END) SOLUTION\n", "", cell.source, flags=re.M)
    wrong = re.sub(r"### BEGIN SOLUTION.*?### END SOLUTION", "return 0", cell.source, flags=re.S)
    return right, wrong


def test_a_term_on_the_hub(hub, browser, grading_sandbox):
    state, course = hub["state"], hub["state"] / "course"
    home = {u: Path(pwd.getpwnam(u).pw_dir) for u in (TEACH, ALICE, BOB)}
    # the instructor, in a terminal of theirs: the exercises from the labs, then the release
    assert (home[TEACH] / "course").resolve() == course.resolve()
    # the course's folder in the exchange, the instructor's from the day they were added
    assert (state / "exchange" / "training-at-scale").stat().st_uid == pwd.getpwnam(TEACH).pw_uid
    from test_hub_image import grades_in_the_sandbox, uses_the_courses_exchange

    # the formgrader's collect, and the students' submit
    assert uses_the_courses_exchange(state / "jupyter" / "instructor", state / "jupyter" / "student")
    # an instructor's autograde from anywhere runs in the sandbox (the course's config does in ~/course)
    assert grades_in_the_sandbox(state / "jupyter" / "instructor") == [True]
    # the chapter's commands, typed in a JupyterLab terminal of the instructor's own server
    teach = _login(browser, hub, TEACH, f"{hub['url']}/hub/user-redirect/lab")  # starts their server
    _lab_open(teach, hub, "teach-0-lab")
    _type_in_terminal(teach, _terminal(teach), _chapter_block("As the instructor, in a terminal on your own server"))
    _shot(teach, "teach-1-released-in-a-terminal")
    assert "is not a subdirectory of the notebook" not in hub["log"].read_text()  # the formgrader finds ~/course
    right, wrong = _answers(hub)

    pages = {ALICE: _student_term(browser, hub, ALICE, right, run=RUN),
             BOB: _student_term(browser, hub, BOB, wrong, run=None, validate=True, fetch_in_terminal=True)}
    # each server its own GPU of the pool, and a cgroup with the limits asked for (where one can be made)
    pids = {u: _server_pid(u) for u in (ALICE, BOB)}
    gpus = {u: dict(kv.split("=", 1) for kv in Path(f"/proc/{p}/environ").read_text().split("\0") if "=" in kv)
            ["CUDA_VISIBLE_DEVICES"] for u, p in pids.items()}
    assert sorted(gpus.values()) == sorted(set(gpus.values())) and set(gpus.values()) <= set(GPUS), gpus
    for u, p in pids.items():
        groups = Path(f"/proc/{p}/cgroup").read_text()
        if f"labkit-hub/{u}" in groups:
            limit = next(f for f in (Path(f"/sys/fs/cgroup/labkit-hub/{u}/memory.max"),
                                     Path(f"/sys/fs/cgroup/memory/labkit-hub/{u}/memory.limit_in_bytes")) if f.exists())
            assert int(limit.read_text()) == 4 << 30, limit
            tasks = next(f for f in (Path(f"/sys/fs/cgroup/labkit-hub/{u}/pids.max"),
                                     Path(f"/sys/fs/cgroup/pids/labkit-hub/{u}/pids.max")) if f.exists())
            assert int(tasks.read_text()) == 2048, tasks
            if not cgroup_v2():  # in its devices cgroup: the pool's other GPUs refused at open() (test_hub_safety)
                assert f"devices:/labkit-hub/{u}" in groups, groups
        else:  # a container without a writable cgroup: said, not silently dropped
            assert f"{u}'s server runs without CPU and memory limits" in hub["log"].read_text(), groups

    # the hub's database is root's alone; the exchange is a file system of its own (what students write
    # there cannot fill the database's disk)
    assert (state / "jupyterhub.sqlite").stat().st_mode & 0o077 == 0
    assert os.path.ismount(state / "exchange") or "could not be mounted" in hub["log"].read_text()
    inbound = state / "exchange" / "training-at-scale" / "inbound"
    (alices,) = [p for p in inbound.iterdir() if p.name.startswith(ALICE)]
    attempts = {
        "list the submissions": f"import os; print(os.listdir({str(inbound)!r}))",
        # its folder's name ends in a random string (nbgrader's), and the folder above cannot be listed
        "alter a submission whose name was guessed": f"open({str(alices / f'{LAB}.ipynb')!r}, 'a').write('x')",
        "read the other's notebook at home": f"open({str(home[ALICE] / LAB / f'{LAB}.ipynb')!r}).read()",
        "read the sources": f"open({str(course / 'source' / LAB / f'{LAB}.ipynb')!r}).read()",
        "read the gradebook": f"open({str(course / 'gradebook.db')!r}, 'rb').read()",
        "alter the release": f"open({str(state / 'exchange' / 'training-at-scale' / 'outbound' / LAB / f'{LAB}.ipynb')!r}, 'a').write('x')",
        # within the exchange (its own file system: a rename out of it is EXDEV before it is EPERM)
        "replace the course's exchange folder": f"import os; os.rename({str(state / 'exchange' / 'training-at-scale')!r}, "
                                                f"{str(state / 'exchange' / 'taken')!r})",
    }
    refused = {what: _refused(hub, code) for what, code in attempts.items()}

    # the hub restarts mid-term: the servers run on, the sessions hold, the submissions stay
    _stop(hub["proc"])
    hub["proc"] = _start(state, hub["port"], hub["log"])
    assert {u: _server_pid(u) for u in (ALICE, BOB)} == pids
    hub_api = f"http://127.0.0.1:{json.loads((state / 'hub.json').read_text())['hub_port']}/"
    for pid in pids.values():  # the servers that ran on still reach the hub: it kept its API port
        env = dict(v.split("=", 1) for v in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in v)
        assert env["JUPYTERHUB_API_URL"].startswith(hub_api), (env["JUPYTERHUB_API_URL"], hub_api)
        urllib.request.urlopen(env["JUPYTERHUB_API_URL"] + "/", timeout=10)
    home_page = pages[ALICE].context.new_page()
    home_page.goto(f"{hub['url']}/hub/home")
    assert "/hub/login" not in home_page.url, home_page.url
    home_page.close()

    # the hub restarted: the page loads again through it, and a new terminal runs the chapter's steps.
    # ?reset: without it JupyterLab restores the earlier terminal as well, a hidden tab that appeared
    # after the new one had been looked for (twice in CI, under load)
    teach.goto(re.sub(r"/lab\b.*$", "/lab", teach.url) + "?reset")
    _lab_open(teach, hub, "teach-2-lab-again")
    _type_in_terminal(teach, _terminal(teach), _chapter_block("After the deadline, in a terminal of yours"))
    _shot(teach, "teach-2-graded-in-a-terminal")
    with open(course / "grades.csv") as f:
        grades = {row["student_id"]: float(row["score"]) for row in csv.DictReader(f) if row["assignment"] == LAB}
        f.seek(0)
        best = {row["student_id"]: float(row["max_score"]) for row in csv.DictReader(f) if row["assignment"] == LAB}
    assert grades[ALICE] == best[ALICE] > 0 and grades[BOB] < best[BOB], grades

    for user, page in pages.items():  # the panel is open where they left it
        page.locator("#nbgrader-assignment-list").get_by_role("button", name="Fetch Feedback").first.click()
        deadline = time.monotonic() + 120
        while not list((home[user] / LAB / "feedback").rglob("*.html")) and time.monotonic() < deadline:
            time.sleep(0.5)
        _shot(page, f"{_who(user)}-5-feedback")
        report = next((home[user] / LAB / "feedback").rglob("*.html")).read_text()
        assert "HIDDEN TESTS" not in report and "Score" in report, user
        assert f"{grades[user]:g}" in report or f"{grades[user]:.1f}" in report, user
    feedback = state / "exchange" / "training-at-scale" / "feedback"
    refused["list the feedback"] = _refused(hub, f"import os; print(os.listdir({str(feedback)!r}))")
    alices_feedback = next(feedback.iterdir())  # as root we know a name; a student cannot list one
    refused["replace feedback whose name was guessed"] = _refused(hub, f"open({str(alices_feedback)!r}, 'w').write('x')")
    assert len(refused) == 9, refused
