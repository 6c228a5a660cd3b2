#!/usr/bin/env bash
# Sourced by the cluster scripts: PYTHON is the Python that runs labkit, checked before any work.
# Given PYTHON=..., that one; otherwise the checkout's .venv (make venv) under LABKIT_ROOT; otherwise
# python3 from PATH. It must import torch and labkit (and each module named in NEEDS) from outside the
# checkout: a Python without torch would otherwise pass a check run inside it and fail minutes later.
find_python() {
  if [ -z "${PYTHON:-}" ]; then
    if [ -x "$LABKIT_ROOT/.venv/bin/python" ]; then PYTHON=$LABKIT_ROOT/.venv/bin/python; else PYTHON=python3; fi
  fi
  local mods
  mods="labkit torch${NEEDS:+ $NEEDS}"
  if ! (cd / && PYTHONPATH="$LABKIT_ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -c "import ${mods// /, }") 2>/dev/null; then
    echo "$(basename "$0"): PYTHON=$PYTHON cannot import ${mods// /, }: run 'make venv' in $LABKIT_ROOT, or set PYTHON= to the Python that has them" >&2
    exit 2
  fi
}
