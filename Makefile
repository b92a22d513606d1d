# Two commands: `make run` renders the quickstart batch with the embedded tiny model,
# `make test` runs the whole test suite. Both create .venv and install on first use.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# The CPU wheel keeps a fresh install small where it is available; any torch >= 2.4 works.
TORCH  ?= torch==2.13.0

.PHONY: run test install clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check "$(TORCH)"
	$(BIN)/python -m pip install -q --disable-pip-version-check -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/pan2-render run jobs/quickstart.yaml --out renders/quickstart

test: $(STAMP)
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) renders .pytest_cache
