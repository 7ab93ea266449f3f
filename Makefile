# Two entry points for a fresh machine: `make demo` and `make test`.
# Each creates its own virtual environment in .venv (CPU torch unless one is already there).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.deltaflash-installed

.PHONY: demo test install clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q triton==3.6.0
	$(PY) -m pip install -q -e '.[test,bench]'
	$(PY) -m pip install -q --no-deps dflash==0.1.0
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m deltaflash demo

test: $(STAMP)
	TRITON_INTERPRET=1 $(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) .pytest_cache
