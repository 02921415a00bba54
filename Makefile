# Two set-up commands, both safe on a fresh machine:
#   make run    create .venv, install v4stack, run the closed loop (agentic RL) on the tiny preset on the CPU
#   make test   create .venv if needed, install, run the default test suite (not slow, gpu skipped)
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
PROMPT ?= The sandbox said

$(BIN)/python:
	$(PY) -m venv $(VENV)

# torch first, pinned to the local CPU wheel, so nothing pulls a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev,tilelang,triton]'
	touch $@

install: $(VENV)/.installed

# the closed loop for LOOP_MINUTES of RL steps (the first run also teaches the supervised policy, ~3 min)
LOOP_MINUTES ?= 3
run: install sysdeps
	$(BIN)/v4stack loop --preset tiny --minutes $(LOOP_MINUTES) --out runs/loop

# OS packages for the sandbox tests (crun, erofs-utils, debootstrap, ...): installed when missing
sysdeps:
	bash scripts/dsec-system-deps.sh

test: install sysdeps
	$(BIN)/python -m pytest -q -m "not slow"

.PHONY: install run sysdeps test
