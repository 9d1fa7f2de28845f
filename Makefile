# Two commands set everything up on a fresh machine:
#   make run    installs Tessera and plans the built-in default (LLaMA-2 7B on 64 H100s)
#   make test   installs Tessera with its test extras and runs the whole suite
PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0

.PHONY: install run test

install:
	$(PYTHON) -m pip install -q "$(TORCH_SPEC)"
	$(PYTHON) -m pip install -q -e ".[runtime,test]"

run: install
	$(PYTHON) -m tessera plan

test: install
	$(PYTHON) -m pytest -q
