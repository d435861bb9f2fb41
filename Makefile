# Every target creates or reuses .venv and installs tailspec (editable) with what it needs.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.tailspec-installed

.PHONY: demo test test-verl wheel-check bench lint clean-venv gpu-check gpu-lease gpu-selector gpu-train gpu-attention gpu-speed gpu-next gpu-wheels \
        gpu-rehearse

# The GPU check (docs/GPU.md) runs on a lent GPU's image as it is: python3 with torch, triton and
# transformers, and none of trl, ray, deepspeed or wandb. The tree goes on PYTHONPATH as `tailspec`.
GPU_PATH   := /tmp/tailspec-path
LINK_TREE  := mkdir -p $(GPU_PATH) && ln -sfn $(CURDIR) $(GPU_PATH)/tailspec
GPU_OUT    ?= $(if $(OUT),$(OUT),outputs/gpu-check)
# GPU_BUDGET=S: each stage of the one-stage commands below may take S seconds instead of its own
# budget (a shorter lease: later parts skipped and named, what ran kept)
GPU_BUDGET_ARG = $(if $(GPU_BUDGET),--budget $(GPU_BUDGET))
# the rehearsal's environment is made like that image: its transformers, a CPU torch, no trainer stack
REHEARSE_VENV := .venv-gpu-rehearse
REHEARSE_PY   := $(REHEARSE_VENV)/bin/python
REHEARSE_STAMP := $(REHEARSE_VENV)/.installed
# --no-compile: byte-compiling every installed file up front took longer than the install (106 s
# against 42 s); the rehearsal compiles what it imports, once (gpu-rehearse writes byte code)
REHEARSE_PIP := -m pip install -q --no-compile
IMAGE_PACKAGES := torch==2.13.0 transformers==5.17.0 triton==3.6.0 tokenizers safetensors numpy pyyaml jinja2 \
                  tqdm pytest pytest-timeout accelerate==1.15.0 pandas pyarrow psutil xxhash fsspec requests httpx
# what the training stage needs and the image lacks: carried as wheels (make gpu-wheels), installed --no-deps
TRAIN_WHEELS := trl==1.16.0 datasets==4.7.0 dill==0.4.0 multiprocess==0.70.18
WHEEL_PLATFORMS := --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
                   --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64

# Everything the project promises is installed (every extra, DeepSpeed included), at the exact tested
# versions of constraints.txt, so only GPU tests skip on CPU.
# The test environment is byte-compiled at install: the suite starts dozens of processes at once
# (Ray workers, CLI runs), which would otherwise each compile the modules they import.
$(STAMP): pyproject.toml constraints.txt Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt -e ".[dev,all]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/tailspec demo

# two test processes (pytest-xdist), a file's tests in one of them (module fixtures built once): the
# suite's tests run one torch thread each, so on 2 cores this halves the wall time. Files are handed
# out in tests/conftest.py's order, longest first (--no-loadscope-reorder: xdist would otherwise
# order them by their number of tests, and a long file of few tests would run last). Tests marked
# `solo` judge what adaptive picks from measured step times: they run afterwards, alone.
# Byte code is written whatever the environment says (an image may set PYTHONDONTWRITEBYTECODE):
# without it every process the suite starts (Ray workers, CLI runs, draft processes) compiles
# tailspec's modules again, about 2 s each, and pytest rewrites every test module in each one.
TEST_WORKERS ?= 2
SOLO_TESTS := tests/workers/test_adaptive_on_workers.py tests/trainer_hooks/test_spec_rollout.py  # the files holding `solo` tests (tests/conftest.py checks)
WRITE_BYTECODE := PYTHONDONTWRITEBYTECODE=
test: $(STAMP)
	$(WRITE_BYTECODE) $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not solo"
	$(WRITE_BYTECODE) $(PY) -m pytest -q -m solo $(SOLO_TESTS)

# the verl backend's tests (tests/trainer_hooks/verl_backend) where verl is installed: an environment made as a
# verl user's is (torch 2.13.0 first, then tailspec[verl], which keeps it and takes verl's transformers)
VERL_VENV  := .venv-verl
VERL_PY    := $(VERL_VENV)/bin/python
VERL_STAMP := $(VERL_VENV)/.installed
$(VERL_STAMP): pyproject.toml Makefile
	test -x $(VERL_PY) || $(PYTHON) -m venv $(VERL_VENV)
	$(VERL_PY) -m pip install -q -U pip
	$(VERL_PY) -m pip install -q torch==2.13.0
	$(VERL_PY) -m pip install -q -e ".[verl]" pytest pytest-timeout
	touch $(VERL_STAMP)

test-verl: $(VERL_STAMP)
	$(WRITE_BYTECODE) $(VERL_PY) -m pytest -q -p no:cacheprovider tests/trainer_hooks/verl_backend

# the wheel as a user installs it (tests/wheel_check.py): built from the tracked files, installed into a
# new virtual environment without the checkout, every module imported, a speculative generate and a
# two-step GRPO run from it; a file the wheel lacks is named
wheel-check: $(STAMP)
	$(PY) tests/wheel_check.py

bench: $(STAMP)
	$(VENV)/bin/tailspec bench

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean-venv:
	rm -rf $(VENV)

gpu-check:
	$(LINK_TREE)
	PYTHONPATH=$(GPU_PATH) PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 python3 -m tailspec.benchmarks.gpu --out $(GPU_OUT)

# a lease in one call (docs/GPU.md, "The next lease"): the pack's correctness stage, the training
# stage (GRPO on the long-tailed workload; carry .whl) and fast_path, within GPU_WITHIN seconds in all
# (the device tool's 600 s a call): each stage gets its budget or what is left, and one that cannot
# fit is left out by name, as are the parts of fast_path its share cannot hold (gpu-next holds them).
# Runs 13 and 15 lost their second call: a machine goes back after 30 s idle.
GPU_WITHIN ?= 570
GPU_LEASE_STAGES ?= correctness,training,fast_path
gpu-lease:
	$(LINK_TREE)
	PYTHONPATH=$(GPU_PATH) PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 python3 -m tailspec.benchmarks.gpu \
		--stages $(GPU_LEASE_STAGES) --within $(GPU_WITHIN) --out $(GPU_OUT)

# adaptive on the GPU (issue 46): calibration, predicted against measured step times, adaptive
# against every fixed arm of its arm set; its own command, since the pack above fills its budget
gpu-selector:
	$(LINK_TREE)
	PYTHONPATH=$(GPU_PATH) PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 python3 -m tailspec.benchmarks.gpu --stages selector \
		--out $(GPU_OUT)/selector $(GPU_BUDGET_ARG)

# the training stage on the GPU: GRPO with SpecRollout(adaptive) on the long-tailed workload, every
# drafter beside a plain twin; needs `make gpu-wheels` first and .whl carried with the call
gpu-train:
	$(LINK_TREE)
	PYTHONPATH=$(GPU_PATH) PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 python3 -m tailspec.benchmarks.gpu --stages training \
		--out $(GPU_OUT)/training $(GPU_BUDGET_ARG)

# the split-KV decode attention against gather + SDPA at contexts of 512 to 32k (issue 48)
gpu-attention:
	$(LINK_TREE)
	PYTHONPATH=$(GPU_PATH) PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 python3 -m tailspec.benchmarks.gpu --stages attention \
		--out $(GPU_OUT)/attention $(GPU_BUDGET_ARG)

# issue 48's engine speed (stage fast_path, about 6 minutes): the compiled decoder layers, kernels
# per step, HF's static cache, the 7.2B-shaped policy, long contexts; the kernel alone: gpu-attention
gpu-speed:
	$(LINK_TREE)
	PYTHONPATH=$(GPU_PATH) PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 python3 -m tailspec.benchmarks.gpu \
		--stages fast_path --out $(GPU_OUT)/speed $(GPU_BUDGET_ARG)

# a lease's second call, right after `make gpu-lease` (docs/GPU.md, "The next lease"; a machine goes
# back after 30 s idle): fast_path whole (the first call's share holds its first parts), then the GPU
# tests, within GPU_NEXT_WITHIN seconds
GPU_NEXT_WITHIN ?= 250
gpu-next:
	$(LINK_TREE)
	PYTHONPATH=$(GPU_PATH) PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 python3 -m tailspec.benchmarks.gpu \
		--stages fast_path,gpu_tests --within $(GPU_NEXT_WITHIN) --out $(GPU_OUT)/next

# the image's Python (3.12) wheels of TRAIN_WHEELS into .whl/ (ignored; about 1.7 MB)
gpu-wheels:
	python3 -m pip download -q --no-deps --only-binary=:all: $(WHEEL_PLATFORMS) -d .whl $(TRAIN_WHEELS)

$(REHEARSE_STAMP): Makefile
	test -x $(REHEARSE_PY) || $(PYTHON) -m venv $(REHEARSE_VENV)
	$(REHEARSE_PY) $(REHEARSE_PIP) $(IMAGE_PACKAGES)
	$(REHEARSE_PY) $(REHEARSE_PIP) --no-deps $(TRAIN_WHEELS)
	touch $(REHEARSE_STAMP)

# (its processes write byte code as they import: the environment is installed without it, and the
# stages' own children, a pytest run and an import probe, then read what the driver compiled)
gpu-rehearse: $(REHEARSE_STAMP)
	$(LINK_TREE)
	$(WRITE_BYTECODE) PYTHONPATH=$(GPU_PATH) PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 $(REHEARSE_PY) -m tailspec.benchmarks.gpu --rehearse \
		--out outputs/gpu-rehearse
