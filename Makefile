VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: install test lint default-model gpu-check gpu-bundle corpora clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "torch==2.13.0"  # the CPU wheel; first, so nothing pulls a CUDA build
	$(PIP) install -q -e ".[test,plot]"
	touch $@

test: lint
	$(PY) -m pytest

lint: install
	$(VENV)/bin/ruff check aftgen tests scripts recipes docs
	$(VENV)/bin/ruff format --check aftgen tests scripts recipes docs

# The shipped model: trained with aftgen itself on Tiny Shakespeare, with the options recipes/shakespeare.args
# lists (the recipe chooses the rest; 15 minutes on 2 CPU cores). Only the weights, config and tokenizer
# are copied into the package (models/shakespeare/README.md, the card, is written by hand from the run's
# numbers). The corpus is downloaded (and its SHA-256 checked) unless SHAKESPEARE names a copy that is
# already there; SHAKESPEARE_URL=... downloads it from a mirror.
SHAKESPEARE ?= data/tinyshakespeare.txt
SHIPPED = $(shell grep -v '^\#' recipes/shakespeare.args)
default-model: install
	$(PY) recipes/tinyshakespeare.py $(SHAKESPEARE)
	$(VENV)/bin/aftgen train $(SHAKESPEARE) --out runs/shakespeare --overwrite $(SHIPPED)
	mkdir -p models/shakespeare
	cp runs/shakespeare/config.json runs/shakespeare/model.safetensors runs/shakespeare/tokenizer.model \
		models/shakespeare/

# The check of every CUDA path (scripts/gpu_check.py): the suite on the device, parity of the two forms,
# training (bf16, --compile), the benches. On a GPU machine without this venv, call the script with its
# python3 (GPU_CHECK_PY=python3); DEVICE=cpu runs it here at small sizes in about a minute.
OUT ?= gpu-check
DEVICE ?= cuda
GPU_CHECK_PY ?= $(PY)
gpu-check: $(if $(filter $(PY),$(GPU_CHECK_PY)),install)
	$(GPU_CHECK_PY) scripts/gpu_check.py $(OUT) --device $(DEVICE)

# What a machine with no network needs beside its own torch: the serve and test extras as wheels for its
# Python (3.12), the versions of this venv, and Tiny Shakespeare; carried there as one ignored folder.
gpu-bundle: install
	scripts/gpu_bundle.sh $(PY) $(SHAKESPEARE)

# English corpora of about 10, 30 and 100 MB to measure the recipe on, from Debian's documentation packages (the
# ones `$(PY) scripts/make_corpora.py --packages` names, installed first); SHARED_DATA=../shared/data adds Tiny
# Shakespeare and the fortunes for the small end. No test depends on them.
CORPORA ?= ../corpora
corpora: install
	$(PY) scripts/make_corpora.py --out $(CORPORA) $(if $(SHARED_DATA),--shared $(SHARED_DATA))

clean:
	rm -rf $(VENV) build *.egg-info
