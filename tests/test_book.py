"""The book builds with warnings as errors, and a real browser reads it offline."""
import functools
import http.server
import os
import re
import subprocess
import threading
from pathlib import Path

import pytest

from labkit.labs import LABS_DIR, list_labs

ROOT = Path(__file__).resolve().parent.parent
HTML = ROOT / "_build" / "html"
# The book is built as `make book HUB_URL=...` builds it for a class: for the hub `make hub` serves.
HUB = "http://127.0.0.1:8000"
# page -> figures it must show (glued from the executed labs, or the lab's own plots)
PAGES = {"book/data_parallel.html": 4, "book/labs/data_parallel.html": 3, "book/memory.html": 4,
         "book/communication.html": 4, "book/labs/communication.html": 3,
         "book/long_context_experts.html": 2, "book/labs/long_context_experts.html": 2,
         "book/finetuning.html": 3, "book/labs/finetuning.html": 4,
         "book/labs/memory.html": 3, "book/zero_fsdp.html": 7, "book/labs/zero_fsdp.html": 5, "book/activation_checkpointing.html": 2,
         "book/labs/activation_checkpointing.html": 2, "book/strategy_cost.html": 1, "book/labs/strategy_cost.html": 1,
         "book/input_pipeline.html": 5, "book/labs/input_pipeline.html": 5,
         "book/packing.html": 7, "book/labs/packing.html": 7,
         "book/fault_tolerance.html": 4, "book/labs/fault_tolerance.html": 3,
         "book/failures_at_scale.html": 4, "book/labs/failures_at_scale.html": 3,
         "book/clusters.html": 2, "book/instructors.html": 0,
         "book/model_parallel.html": 11, "book/labs/tensor_parallel.html": 3, "book/labs/pipeline_parallel.html": 5,
         "book/inside_device.html": 5, "book/labs/inside_device.html": 5, "book/intro.html": 0}


@pytest.fixture(scope="module")
def built_book(lab_metrics):
    jb = Path(os.sys.executable).parent / "jupyter-book"
    proc = subprocess.run([str(jb), "build", str(ROOT), "--builder", "html", "-W", "--keep-going"],
                          capture_output=True, text=True, timeout=900, env={**os.environ, "HUB_URL": HUB})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    return HTML


def test_book_builds_with_warnings_as_errors(built_book):
    for page in PAGES:
        assert (built_book / page).is_file(), page
    chapter = (built_book / "book/data_parallel.html").read_text()
    assert (built_book / "_static/mathjax/tex-mml-chtml.js").is_file()
    assert "cdn.jsdelivr.net" not in chapter  # MathJax is served from the book itself
    # no page links a placeholder hub (issue 46): the launch buttons go to the hub the book was built for
    placeholder = [str(p.relative_to(built_book)) for p in built_book.rglob("*.html")
                   if re.search(r"hub\.example\.|example\.(org|com|net)", p.read_text(errors="replace"))]
    assert not placeholder, placeholder[:5]


def _book_extras():
    import importlib.util

    spec = importlib.util.spec_from_file_location("book_extras", ROOT / "book" / "_ext" / "book_extras.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_launch_buttons_hub_is_configured_or_absent_never_a_placeholder():
    """`make book HUB_URL=...` names the hub; without one the book has no launch button (the theme adds
    none for an empty jupyterhub_url); a placeholder or a non-http address stops the build."""
    import yaml

    hub_url = _book_extras().hub_url
    configured = yaml.safe_load((ROOT / "_config.yml").read_text())["launch_buttons"]["jupyterhub_url"]
    assert hub_url(configured, {}) == ""  # the committed config names no hub: no button
    assert hub_url(configured, {"HUB_URL": "https://hub.school.edu/"}) == "https://hub.school.edu"
    assert hub_url("https://jupyter.cs.school.edu", {}) == "https://jupyter.cs.school.edu"
    assert hub_url("https://a.school.edu", {"HUB_URL": " "}) == "https://a.school.edu"
    for bad, where in (("https://hub.example.org", "HUB_URL"), ("http://example.com", "HUB_URL"),
                       ("hub.school.edu", "HUB_URL"), ("ftp://hub.school.edu", "HUB_URL")):
        with pytest.raises(ValueError, match=where):
            hub_url("", {"HUB_URL": bad})
    with pytest.raises(ValueError, match="_config.yml.*placeholder"):
        hub_url("https://hub.example.org", {})


@pytest.fixture(scope="module")
def server(built_book):
    handler = functools.partial(_QuietHandler, directory=str(built_book))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def _open(browser, url):
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    errors = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("requestfailed", lambda r: errors.append(f"request failed: {r.url}"))
    page.goto(url, wait_until="networkidle")
    return page, errors


def _sideways(page, path: str) -> None:
    """No code line, output line or table wider than its column; on a lab page the cells that only
    record numbers for the text (tagged remove-input) are not shown."""
    wide = page.eval_on_selector_all(
        "article div.highlight pre, article div.cell_output pre",
        "els => els.filter(e => e.scrollWidth > e.clientWidth + 1).map(e => e.innerText.split('\\n')"
        ".reduce((a, b) => a.length > b.length ? a : b).slice(0, 100))")
    assert not wide, f"{path}: code or output wider than its block: {wide[:3]}"
    overflowing = page.eval_on_selector_all(
        "article table",
        "ts => ts.filter(t => t.getBoundingClientRect().right > t.closest('article')"
        ".getBoundingClientRect().right + 1).map(t => t.innerText.slice(0, 80))")
    assert not overflowing, f"{path}: a table wider than the page column: {overflowing}"
    if "/labs/" in path:
        code = " ".join(page.locator("article div.cell_input").all_text_contents())
        assert "record(" not in code, f"{path}: a cell that only records numbers is shown"
        lab = path.rsplit("/", 1)[1].replace(".html", "")
        assert "record(" in (LABS_DIR / f"{lab}.md").read_text(), f"{lab} records nothing for the text"


@pytest.mark.parametrize("path", list(PAGES))
def test_figures_load_math_renders_nothing_scrolls_sideways_and_no_console_errors(browser, server, path):
    page, errors = _open(browser, f"{server}/{path}")
    _sideways(page, path)
    images = page.eval_on_selector_all(
        "article img", "imgs => imgs.map(i => [i.getAttribute('src'), i.complete && i.naturalWidth > 0])")
    assert len(images) >= PAGES[path], images
    assert all(ok for _, ok in images), [src for src, ok in images if not ok]
    n_math = page.locator(".math").count()
    if n_math:  # MathJax typesets every math node, offline (also those in collapsed, hidden cells)
        page.wait_for_function(f"document.querySelectorAll('mjx-container').length >= {n_math}", timeout=30_000)
        assert page.locator("mjx-container").count() == n_math
    assert not page.locator("text=No key").count()
    assert not page.locator("text=glue:").count()  # an unresolved glue role shows as source
    shots = ROOT / "_build" / "screenshots"
    shots.mkdir(parents=True, exist_ok=True)
    # the first screen only: a full-page shot of a long chapter takes seconds and is only looked at
    page.screenshot(path=str(shots / (path.replace("/", "_") + ".png")))
    assert not errors, errors  # the book is offline: any failed request or script error is ours
    page.close()


def test_chapters_show_measured_numbers(browser, server, lab_metrics):
    page, _ = _open(browser, f"{server}/book/data_parallel.html")
    text = page.inner_text("article")
    m = lab_metrics["data_parallel"]
    assert f"{m['grad_bytes']:,}" in text
    assert f"{m['max_loss_diff']:.1e}" in text
    assert f"{m['n_params']:,}" in text
    page.goto(f"{server}/book/memory.html", wait_until="networkidle")
    text = page.inner_text("article")
    assert all(v in text for v in ("120.0", "31.4", "16.6", "1.9"))  # the ZeRO paper's Figure 1
    assert f"{lab_metrics['memory']['act_max_rel_err']:.1%}" in text
    page.goto(f"{server}/book/strategy_cost.html", wait_until="networkidle")
    text = page.inner_text("article")
    assert "$18,000" in text and "rule runs out of memory" in text
    page.close()


def test_search_finds_the_lab(browser, server):
    page, errors = _open(browser, f"{server}/search.html?q=ring")
    page.wait_for_selector("#search-results li a", timeout=20_000)
    hrefs = page.eval_on_selector_all("#search-results li a", "as => as.map(a => a.getAttribute('href'))")
    assert any("labs/data_parallel" in h for h in hrefs), hrefs
    page.close()


def _statement_words(lab: str) -> list[str]:
    """Words of the first line of the lab's exercise statement, math left out (MathJax renders it)."""
    text = (LABS_DIR / f"{lab}.md").read_text()
    first = text.split("```{exercise-start}", 1)[1].split('+++ {"tags": ["exercise"]}\n\n', 1)[1].split("\n", 1)[0]
    return re.findall(r"[A-Za-z]{4,}", re.sub(r"\$[^$]*\$", "", first))[:5]


@pytest.mark.parametrize("lab", list_labs())
def test_lab_shows_its_exercise_and_a_collapsed_solution(browser, server, lab):
    page, errors = _open(browser, f"{server}/book/labs/{lab}.html")
    exercise = page.locator(f"div.exercise.admonition#lab-{lab}-exercise")
    assert exercise.count() == 1 and exercise.is_visible(), f"{lab}: no exercise admonition"
    text = exercise.inner_text()
    words = _statement_words(lab)
    assert words and all(w in text for w in words), (lab, words, text[:300])
    solution = page.locator(f"div.solution.dropdown.admonition#lab-{lab}-solution")
    assert solution.count() == 1, f"{lab}: no solution dropdown"
    code = solution.locator("div.cell")
    assert code.count() >= 1, f"{lab}: the solution dropdown holds no code cell"
    # sphinx-togglebutton collapses .admonition.dropdown when the page loads: only the title shows.
    assert "toggle-hidden" in solution.get_attribute("class") and not code.first.is_visible(), lab
    assert solution.locator(".admonition-title").is_visible()
    # text_content(): collapsed text too. The tests follow the dropdown, collapsed by hide-input.
    assert "HIDDEN TESTS" not in solution.text_content(), f"{lab}: the hidden tests belong outside the solution"
    assert "HIDDEN TESTS" in page.locator("article").text_content(), lab
    solution.locator("button.toggle-button").click()
    code.first.wait_for(state="visible", timeout=5_000)
    assert "### BEGIN SOLUTION" in solution.inner_text(), lab
    assert not errors, errors
    page.close()


def test_every_lab_page_launches_the_lab_on_the_hub_and_downloads_its_notebook(browser, server):
    """The launch button opens the lab's student form in the student's home on the course's hub (where
    the hub put it: tests/test_hub.py follows this link), not nbgitpuller's copy of the repository,
    solutions and all, nor the executed copy the page was built from."""
    import json as _json
    import urllib.request
    from urllib.parse import urljoin

    from labkit.course.student_labs import launch_url

    hub = HUB
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    for lab in list_labs():
        page.goto(f"{server}/book/labs/{lab}.html", wait_until="networkidle")
        (href,) = page.eval_on_selector_all(
            f"a[href^='{hub}/']", "as => [...new Set(as.map(a => a.getAttribute('href')))]")
        assert href == launch_url(hub, lab) == f"{hub}/hub/user-redirect/lab/tree/labs/{lab}.ipynb", href
        downloads = [h for h in page.eval_on_selector_all(
            "a[href$='.ipynb']", "as => [...new Set(as.map(a => a.getAttribute('href')))]") if h != href]
        assert downloads, f"{lab}: no download button for the notebook"
        with urllib.request.urlopen(urljoin(page.url, downloads[0])) as r:
            assert _json.loads(r.read())["cells"], lab
    page.close()

