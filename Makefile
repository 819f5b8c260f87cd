# ditfuse: the commands of the README are `make demo`, `make test` (CI) and `make test-quick`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.ditfuse-installed
PYTEST_ARGS ?=
# pytest-xdist workers. Tests that share a live server stay on one worker (xdist_group +
# --dist loadgroup); the rest are spread one by one.
PYTEST_WORKERS ?= 2
XDIST := -n $(PYTEST_WORKERS) --dist loadgroup

.PHONY: install demo demo-video test test-quick test-gpu docs clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# Never let the install pull a multi-GB CUDA torch on a CPU machine: take the CPU wheel
	# (torch 2.13.0) unless a torch is already there (e.g. a CUDA build you installed yourself).
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "torch==2.13.0"
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

# The main job on the built-in default: a tiny random-weight FLUX pipeline (its images are noise).
demo: install
	$(BIN)/ditfuse generate --model tiny-flux --prompt "a lighthouse at dusk" --size 256x256 --steps 8 --seed 0 --quality lossless --out out/demo.png

# The video example: a tiny random-weight Wan pipeline (its video is noise) -> out/clip.mp4.
demo-video: install
	$(BIN)/ditfuse generate --model tiny-wan --prompt "a lighthouse at dusk" --frames 17 --size 832x480 --steps 8 --seed 0 --quality lossless --out out/clip.mp4

# The CI command: the whole CPU suite (GPU tests are skipped without CUDA).
test: install
	$(BIN)/python -m pytest -q $(XDIST) tests $(PYTEST_ARGS)

# The edit-test loop (under a minute): leaves out the Triton-interpreter kernel tests and the
# slow server/CLI tests (markers `interpret` and `slow`). Not a substitute for `make test`.
test-quick: install
	$(BIN)/python -m pytest -q $(XDIST) -m "not slow and not interpret and not gpu" tests/cpu $(PYTEST_ARGS)

# On a CUDA machine (see scripts/gpu_suite.sh for the carried-wheels variant used on the H200).
test-gpu: install
	$(BIN)/python -m pytest -q -m gpu tests/gpu $(PYTEST_ARGS)

docs: install
	$(BIN)/ditfuse docs

clean:
	rm -rf $(VENV) out .pytest_cache
