VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: install test lint default-model clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "torch==2.13.0"  # the CPU wheel; first, so nothing pulls a CUDA build
	$(PIP) install -q -e ".[test]"
	touch $@

test: install
	$(VENV)/bin/ruff check aftgen tests
	$(PY) -m pytest

lint: install
	$(VENV)/bin/ruff check aftgen tests
	$(VENV)/bin/ruff format --check aftgen tests

clean:
	rm -rf $(VENV) build *.egg-info
