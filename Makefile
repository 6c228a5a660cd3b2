# Training at Scale: `make book` builds the book, `make test` runs every test. Both set up .venv first.
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= python3.11
VENV := .venv
# LABKIT_PYTHON: a Python that already has the course installed (the hub image sets it): no .venv is
# made, and every target runs with that Python and the tools beside it.
ifdef LABKIT_PYTHON
PY := $(LABKIT_PYTHON)
BIN := $(dir $(shell command -v $(LABKIT_PYTHON)))
STAMP :=
else
PY := $(VENV)/bin/python
BIN := $(VENV)/bin/
STAMP := $(VENV)/.installed
endif
PROFILE ?= ci
LAB ?=
BUILD := _build
# DeepSpeed compiles small ops at first use; keep its cache in the build folder so make reuses it.
export TORCH_EXTENSIONS_DIR := $(CURDIR)/$(BUILD)/torch_extensions
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: help venv labs lab book test serve lab-ui assignments hub gpu-check clean compare baseline

help:
	@echo "make book              set up .venv, execute every lab (PROFILE=$(PROFILE)), build the HTML book"
	@echo "                       (HUB_URL=https://hub.your.school: each lab page's launch button opens the lab there)"
	@echo "make test              set up .venv, run the whole test suite"
	@echo "make lab LAB=data_parallel PROFILE=cpu|ci|gpu   execute one lab into $(BUILD)/runs/"
	@echo "make lab-ui            open the labs in JupyterLab (LAB_UI_OPTS=\"--no-browser --port N\" passes options)"
	@echo "make assignments       nbgrader student notebooks of the labs' exercises in course/release/"
	@echo "make hub               as root: a JupyterHub for a class on this machine (HUB_STATE=$(HUB_STATE), HUB_OPTS=\"--gpus all --port 8000\")"
	@echo "make serve             serve the built book on http://127.0.0.1:8000"
	@echo "make compare           every lab's ci profile against the committed baseline labs/baseline/ci (exit 1: regressed)"
	@echo "make baseline          rerun every lab's ci profile and make it the baseline (review, then commit)"
	@echo "make gpu-check         on a GPU node, within 10 minutes: the machine, every strategy, precision, MFU and"
	@echo "                       the labs that fit (ARGS=--full: everything); report in $(BUILD)/gpu_check/"

# Installs only when requirements.txt or pyproject.toml changed. torch goes first and DeepSpeed is
# built without isolation against it (DS_BUILD_OPS=0: no CUDA ops compiled at install time).
# Byte-compiled at install: with PYTHONDONTWRITEBYTECODE set, as on many CI machines, nothing compiled
# later is kept, and every rank and kernel would compile torch anew. pip compiles one file at a time
# (2 of the 3.6 minutes of set-up here); compileall does it on every core, after the installs (a few
# packages ship files for other Pythons, which pip skips too: its status is not a check).
PIP_INSTALL := $(PY) -m pip install -q --no-compile
ifndef LABKIT_PYTHON
$(STAMP): requirements.txt pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP_INSTALL) pip==24.3.1 setuptools==84.2.1 wheel==0.48.0
	$(PIP_INSTALL) $$(grep -E '^torch==' requirements.txt)
	DS_BUILD_OPS=0 $(PIP_INSTALL) --no-build-isolation -r requirements.txt
	$(PIP_INSTALL) --no-deps --no-build-isolation -e .
	$(PY) -m compileall -q -j 0 $(VENV)/lib >/dev/null || true
	$(PY) -m ipykernel install --sys-prefix --name labkit --display-name "Python (labkit)" >/dev/null
	@touch $@

# JupyterLab's settings for the course, as the hub image installs them (cluster/jupyterhub/Dockerfile):
# a lab's MyST markdown opens as a notebook on double-click (jupytext's viewer), not in the editor.
LAB_SETTINGS := $(VENV)/share/jupyter/lab/settings/overrides.json
$(LAB_SETTINGS): cluster/jupyterhub/overrides.json | $(STAMP)
	install -D -m 644 $< $@
else
LAB_SETTINGS :=
endif

venv: $(STAMP) $(LAB_SETTINGS)

labs: $(STAMP)
	$(PY) -m labkit run --profile $(PROFILE)

lab: $(STAMP)
	@test -n "$(LAB)" || { echo "usage: make lab LAB=<name> PROFILE=<cpu|ci|gpu>; labs: $$($(PY) -m labkit list)"; exit 2; }
	$(PY) -m labkit run $(LAB) --profile $(PROFILE) --out $(BUILD)/runs/$(PROFILE) --force

# Regression runs (labkit.labs.compare): every lab's ci profile, held against the committed baseline
# (exit 1 when something regressed; the report is book/labs/compare.md). `make baseline` makes such
# a run the baseline: a deliberate change, reviewed as `git diff labs/baseline` before it is committed.
compare: $(STAMP)
	$(PY) -m labkit run --profile ci --jobs 2
	$(PY) -m labkit compare book/labs

baseline: $(STAMP)
	$(PY) -m labkit run --profile ci --jobs 2 --force
	$(PY) -m labkit baseline book/labs

# HUB_URL: the course's JupyterHub, which each lab page's launch button opens (book/_ext/book_extras.py);
# unset, the book has no launch button.
HUB_URL ?=
book: labs
	HUB_URL='$(HUB_URL)' $(BIN)jupyter-book build . --builder html -W --keep-going
	@echo
	@echo "The book is in $(BUILD)/html. Open $(CURDIR)/$(BUILD)/html/index.html in a browser,"
	@echo "or run 'make serve' and visit http://127.0.0.1:8000 (search needs a served copy)."

# Three workers on two cores, one test file each at a time (tests/conftest.py says why): the suite
# keeps about 1.1 cores busy with two (browser, Slurm, launcher and elastic tests mostly wait, measured:
# 35.5 CPU minutes in a 32-minute run), so a third fills the gaps; TEST_WORKERS=0 runs in one.
# Every test's duration goes to $(BUILD)/test-durations.xml (JUnit XML), the slowest are printed
# (pyproject.toml) and tests/conftest.py keeps a timeline per worker: the suite has a 20-minute budget.
TEST_WORKERS ?= 3
test: $(STAMP) $(LAB_SETTINGS)
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder \
	  --junitxml=$(BUILD)/test-durations.xml

serve:
	$(PY) -m http.server 8000 --bind 127.0.0.1 --directory $(BUILD)/html

# Jupyter refuses to run as root without --allow-root (a container, CI); LAB_UI_OPTS passes more, e.g.
# make lab-ui LAB_UI_OPTS="--no-browser --port 8890"
LAB_UI_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root)
lab-ui: $(STAMP) $(LAB_SETTINGS)
	$(BIN)jupyter lab labs/ $(LAB_UI_ROOT) $(LAB_UI_OPTS)

# The graded exercises at the end of every lab, as nbgrader assignments (book/instructors.md).
assignments: $(STAMP)
	$(PY) -m labkit.course.assignments

# A JupyterHub for a class on one machine (labkit/course/hub.py, book/instructors.md): run as root; users
# are added with `python -m labkit.course.hub add`. Everything it keeps is in HUB_STATE.
HUB_STATE ?= /srv/labkit-hub
HUB_OPTS ?=
hub: $(STAMP)
	$(PY) -m labkit.course.hub serve --state $(HUB_STATE) $(HUB_OPTS)

# On a GPU node or hub image: no set-up, so it runs where CUDA torch is installed and no registry is
# reachable (.venv's Python when there is one, else python3 with labkit on the path). It ends within
# its budget (10 minutes; ARGS="--budget S" or ARGS=--full), each item and lab stopped at its own.
GPU_PYTHON ?= $(if $(wildcard $(PY)),$(PY),python3)
gpu-check:
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PYTHON) -m labkit.gpu_check $(ARGS)

clean:
	rm -rf $(BUILD) book/labs
