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
  (:func:`labkit.course.student_labs.launch_url`; ``make hub`` and ``cluster/jupyterhub`` both do).
* That button exists only when a hub is named: ``make book HUB_URL=https://hub.your.school`` (the
  ``HUB_URL`` environment variable), or ``launch_buttons.jupyterhub_url`` in ``_config.yml``. With
  neither, the pages have no launch button; a placeholder address (``example.org`` and the like) or
  anything but an http(s) address stops the build (:func:`hub_url`).
"""
from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlsplit

ENTRY = "tex-mml-chtml.js"  # Sphinx's default MathJax 3 component
# Domains reserved for documentation (RFC 2606): a hub there is a placeholder, never a class's hub.
PLACEHOLDER_DOMAINS = ("example.org", "example.com", "example.net", "example", "invalid")


def hub_url(configured: str | None, env: Mapping[str, str] = os.environ) -> str:
    """The hub the launch buttons open: ``HUB_URL`` from ``env`` (``make book HUB_URL=...``), else
    ``configured`` (``_config.yml``'s ``launch_buttons.jupyterhub_url``), without a trailing slash; ``""``
    when neither names one, and then the book has no launch button. A ValueError, naming where the
    address came from, for an address that is not http(s) with a host, or whose host is a placeholder."""
    given, source = (env.get("HUB_URL") or "").strip(), "HUB_URL"
    if not given:
        given, source = (configured or "").strip(), "_config.yml's launch_buttons.jupyterhub_url"
    if not given:
        return ""
    parts = urlsplit(given)
    host = (parts.hostname or "").lower()
    if parts.scheme not in ("http", "https") or not host:
        raise ValueError(f"{source}={given!r} is not an http(s) address of a JupyterHub, such as "
                         "https://hub.your.school; leave it empty for a book without launch buttons")
    if any(host == d or host.endswith("." + d) for d in PLACEHOLDER_DOMAINS):
        raise ValueError(f"{source}={given!r} is a placeholder, not a hub: give your hub's address "
                         "(make book HUB_URL=https://hub.your.school), or leave it empty for a book "
                         "without launch buttons")
    return given.rstrip("/")


def _set_hub(app, config) -> None:
    """``config-inited``: the launch buttons' hub, from :func:`hub_url` (none: no launch button)."""
    options = dict(config.html_theme_options or {})
    buttons = dict(options.get("launch_buttons") or {})
    buttons["jupyterhub_url"] = hub_url(buttons.get("jupyterhub_url"))
    options["launch_buttons"] = buttons
    config.html_theme_options = options


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
    from labkit.course.student_labs import launch_url

    for group in context.get("header_buttons", []):
        for button in group.get("buttons", []) if group.get("label") == "launch-buttons" else []:
            hub, pulled, _ = button.get("url", "").partition("/hub/user-redirect/git-pull?")
            if pulled:  # _config.yml's jupyterhub_url, before the address of nbgitpuller's
                button["url"] = launch_url(hub, pagename.rsplit("/", 1)[1])


def setup(app):
    if not (_mathjax_source() / ENTRY).exists():
        raise RuntimeError(f"MathJax not found at {_mathjax_source()}; install requirements.txt")
    app.config.mathjax_path = f"mathjax/{ENTRY}"
    app.connect("config-inited", _set_hub)
    app.connect("build-finished", _copy_mathjax)
    app.connect("html-page-context", _dedupe_scripts, priority=999)  # last: other handlers add scripts
    app.connect("html-page-context", _launch_the_lab_itself, priority=900)  # after the theme's buttons
    return {"parallel_read_safe": True, "parallel_write_safe": True}
