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

test: lint
	$(PY) -m pytest

lint: install
	$(VENV)/bin/ruff check aftgen tests
	$(VENV)/bin/ruff format --check aftgen tests

# The shipped model: trained with aftgen itself on Tiny Shakespeare (about an hour on 2 CPU cores,
# bf16 autocast), keeping the weights that scored best on the held-out check, stored in fp16 to stay
# under 16 MB; then only the Hub-shaped files are copied into the package.
SHAKESPEARE ?= ../shared/data/tinyshakespeare.txt
default-model: install
	$(VENV)/bin/aftgen train $(SHAKESPEARE) --out runs/shakespeare --overwrite --preset medium --dtype bf16 \
		--lr 1e-3 --warmup-steps 150 --max-steps 2000 --max-time 55m --eval-interval 100 --eval-windows 200 \
		--keep-best --weights-dtype fp16
	mkdir -p models/shakespeare
	cp runs/shakespeare/config.json runs/shakespeare/model.safetensors runs/shakespeare/tokenizer.model \
		runs/shakespeare/README.md models/shakespeare/

clean:
	rm -rf $(VENV) build *.egg-info
