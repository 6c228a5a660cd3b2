"""Small Sphinx additions that make the built book work offline and keep its console clean.

* MathJax 3 is served from the book instead of a CDN. It comes from the pinned
  ``django-static-mathjax`` wheel (its static files only) and is copied to ``_static/mathjax`` of
  the output after the build: not via the source ``_static``, because Jupyter Book adds every
  ``.js`` found there as a script tag.
* sphinx-thebe 0.3.1 calls ``app.add_js_file`` inside ``html-page-context``, so its inline
  ``const THEBE_JS_URL`` script accumulates one more copy on every page written and the browser
  reports "Identifier 'THEBE_JS_URL' has already been declared". Duplicate scripts are dropped.
* A lab's page is built from the notebook ``labkit run`` executed into ``book/labs/`` (never
  committed), and sphinx-book-theme's JupyterHub button would have nbgitpuller pull the whole
  repository, every solution and hidden test in it, into the student's home. The button opens the
  lab's student form instead, which the course's hub puts in every student's home
  (:func:`labkit.labs.student_labs.launch_url`; ``make hub`` and ``cluster/jupyterhub`` both do).
"""
from __future__ import annotations

import shutil
from pathlib import Path

ENTRY = "tex-mml-chtml.js"  # Sphinx's default MathJax 3 component


def _mathjax_source() -> Path:
    import mathjax  # the django-static-mathjax package

    return Path(mathjax.__file__).parent / "static" / "mathjax" / "es5"


def _copy_mathjax(app, exception) -> None:
    if exception is not None or app.builder.format != "html":
        return
    dest = Path(app.outdir) / "_static" / "mathjax"
    if not (dest / ENTRY).exists():
        shutil.copytree(_mathjax_source(), dest, dirs_exist_ok=True)


def _dedupe_scripts(app, pagename, templatename, context, doctree) -> None:
    scripts = context.get("script_files")
    if not scripts:
        return
    seen, unique = set(), []
    for js in scripts:
        # Copies differ in priority (and None vs '' for inline scripts): compare what the tag renders.
        attrs = getattr(js, "attributes", {})
        key = (str(getattr(js, "filename", js) or ""), tuple(sorted((k, str(v)) for k, v in attrs.items())))
        if key not in seen:
            seen.add(key)
            unique.append(js)
    context["script_files"] = unique


def _launch_the_lab_itself(app, pagename, templatename, context, doctree) -> None:
    if not pagename.startswith("book/labs/"):
        return
    from labkit.labs.student_labs import launch_url

    for group in context.get("header_buttons", []):
        for button in group.get("buttons", []) if group.get("label") == "launch-buttons" else []:
            hub, pulled, _ = button.get("url", "").partition("/hub/user-redirect/git-pull?")
            if pulled:  # _config.yml's jupyterhub_url, before the address of nbgitpuller's
                button["url"] = launch_url(hub, pagename.rsplit("/", 1)[1])


def setup(app):
    if not (_mathjax_source() / ENTRY).exists():
        raise RuntimeError(f"MathJax not found at {_mathjax_source()}; install requirements.txt")
    app.config.mathjax_path = f"mathjax/{ENTRY}"
    app.connect("build-finished", _copy_mathjax)
    app.connect("html-page-context", _dedupe_scripts, priority=999)  # last: other handlers add scripts
    app.connect("html-page-context", _launch_the_lab_itself, priority=900)  # after the theme's buttons
    return {"parallel_read_safe": True, "parallel_write_safe": True}
