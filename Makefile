# On a fresh machine:
#   make demo   -- create .venv, install ludic, run `ludic demo` (SFT then GRPO, tiny model, CPU)
#   make test   -- create .venv, install ludic with dev extras, run the test suite
#   make lint   -- ruff check + format check
PYTHON ?= python3
VENV ?= .venv
# The CPU build of torch; pip resolves it from the local wheel cache where one exists.
TORCH_SPEC ?= torch==2.13.0

.PHONY: setup demo test lint clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q "$(TORCH_SPEC)"
	$(VENV)/bin/pip install -q -e ".[dev]"
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(VENV)/bin/ludic demo

test: setup
	$(VENV)/bin/pytest -q

lint: setup
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/ruff format --check src tests

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
