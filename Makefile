# Two commands: `make run` renders the quickstart batch with the embedded tiny model,
# `make test` runs the whole test suite. Both create .venv on first use: `make run` installs
# pan2-render with its runtime dependencies only, `make test` adds the test extras.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
RUN_STAMP  := $(VENV)/.installed-run
TEST_STAMP := $(VENV)/.installed-test
# The CPU wheel keeps a fresh install small where it is available; any torch >= 2.4 works.
TORCH  ?= torch==2.13.0

.PHONY: run test install clean

$(RUN_STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo ">> installing into $(VENV): $(TORCH), then pan2-render and its runtime dependencies (pyproject.toml, [project] dependencies); pip names each package; a few minutes the first time"
	$(BIN)/python -m pip install --disable-pip-version-check --progress-bar on "$(TORCH)"
	$(BIN)/python -m pip install --disable-pip-version-check -e .
	touch $@

$(TEST_STAMP): $(RUN_STAMP) pyproject.toml
	@echo ">> installing the test extras into $(VENV): pytest, pytest-timeout, diffusers, peft and ccvfi (the references our models are tested against), triton (kernel tests), playwright (drives Chromium in the browser tests), openai (its client against the farm's /v1/videos), ruff (the linter)"
	$(BIN)/python -m pip install --disable-pip-version-check -e '.[test]'
	touch $@

install: $(RUN_STAMP)

run: $(RUN_STAMP)
	$(BIN)/pan2-render run jobs/quickstart.yaml --out renders/quickstart
	@echo ">> pan2-render is installed in $(VENV): 'source $(VENV)/bin/activate' puts it on PATH (README.md, First five minutes)"

test: $(TEST_STAMP)
	@echo ">> linting (ruff, pyproject.toml [tool.ruff]), then the test suite (about 20 minutes on 2 cores); each line ends with tests run / total"
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q --durations=20

clean:
	rm -rf $(VENV) renders .pytest_cache
