"""Shared fixtures: the converted SmolLM2 checkpoint, a tiny random Llama, running servers.

Checkpoints live in KESTREL_CACHE_DIR (default ~/.cache/kestrel): SmolLM2's one-time conversion
from the embedded GGUF takes ~25 s; later sessions reuse it. `smollm2_meta_dir` is the embedded
GGUF's metadata folder (config and tokenizer) converted afresh once a run, by this run's code:
the tokenizer's conversion through transformers takes ~20 s, so the tests that need the
tokenizer as save_gguf_tokenizer writes it share this one folder and only read it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from engine_worker.config import cache_dir_from_env
from tests.procs import GatewayProc, WorkerProc

if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    # Several test processes share the cores (`make test`: pytest-xdist). OpenMP's threads in
    # each (torch's here, and in the workers these processes start, which inherit it) would
    # spin at every barrier for a core another process needs: 762 CPU-seconds for the suite
    # instead of 512, and 7 min 12 s instead of 5 min 15 s on two cores. Set before torch loads.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@pytest.fixture(scope="session")
def cache_dir() -> Path:
    path = cache_dir_from_env()
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def new_cache_dir(cache_dir: Path, tmp_path_factory: pytest.TempPathFactory
                  ) -> Callable[[], Path]:
    """Makes an empty KESTREL cache dir for one test, but for its kernels/ folder: a link to the
    session cache's. Whatever a test finds there (Inductor's files, converted checkpoints) is
    its own; our C++ kernels (~35 s to build on a 2-core host, keyed by their source, flags,
    torch and this CPU: engine_worker/kernel_build.py) are built once per host, as in serving."""

    def make() -> Path:
        path = tmp_path_factory.mktemp("kestrel-cache")
        (cache_dir / "kernels").mkdir(exist_ok=True)
        (path / "kernels").symlink_to(cache_dir / "kernels", target_is_directory=True)
        return path

    return make


@pytest.fixture(scope="session")
def smollm2_dir(cache_dir: Path) -> Path:
    from engine_worker.model.loader import resolve_checkpoint

    return resolve_checkpoint("default", cache_dir)


@pytest.fixture(scope="session")
def gguf_meta_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An empty cache folder of this run, for `smollm2_meta_dir`'s conversion alone."""
    return tmp_path_factory.mktemp("gguf-meta-cache")


@pytest.fixture(scope="session")
def smollm2_meta_dir(gguf_meta_cache: Path) -> Path:
    """The embedded GGUF converted with weights=False (config.json, tokenizer files) into
    `gguf_meta_cache`: a conversion of this run, never an older run's cached folder."""
    from engine_worker.model.loader import embedded_gguf_path, resolve_checkpoint

    return resolve_checkpoint(str(embedded_gguf_path()), gguf_meta_cache, weights=False)


@pytest.fixture(scope="session")
def tiny_model_dir(cache_dir: Path, smollm2_dir: Path) -> Path:
    from engine_worker.model.loader import write_folder_once
    from engine_worker.model.tiny import make_tiny_checkpoint

    path = cache_dir / "tiny-llama-seed0"
    if not (path / "config.json").exists():  # the other test process may be reading it
        write_folder_once(path, lambda tmp: make_tiny_checkpoint(
            tmp, seed=0, tokenizer_from=smollm2_dir))
    return path


@pytest.fixture(scope="module")
def tiny_server(tiny_model_dir: Path) -> Iterator[tuple[GatewayProc, WorkerProc]]:
    """A gateway and one worker on the tiny random model, shared by a test module."""
    with GatewayProc() as gw, WorkerProc(tiny_model_dir, gw.engine_address) as wk:
        gw.wait_ready()
        yield gw, wk


@pytest.fixture(scope="session")
def smollm_server(smollm2_dir: Path) -> Iterator[tuple[GatewayProc, WorkerProc]]:
    """A gateway and one worker on the real SmolLM2, shared by the whole session."""
    with GatewayProc() as gw, WorkerProc(smollm2_dir, gw.engine_address,
                                         "--model-id", "SmolLM2-135M-Instruct") as wk:
        gw.wait_ready(timeout=180)
        yield gw, wk


QWEN_GGUF = cache_dir_from_env() / "gguf" / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
QWEN_MODEL = "qwen2.5-coder-0.5b-instruct"


@pytest.fixture(scope="session")
def qwen_server() -> Iterator[GatewayProc]:
    """A gateway and one worker on the real Qwen2.5-Coder-0.5B-Instruct GGUF (Q4_K_M), served as
    `kestrel serve FILE` does (its own blocks, default flags), shared by the session. Skipped when
    the file is not in the cache's gguf/ folder (`python benchmarks/fetch_qwen_gguf.py --only
    0.5b` puts it there).

    The gateway keeps its default heartbeat timeout (1.5 s): the first tool call of the session
    builds llguidance's tokenizer for Qwen's 151,936-token vocabulary holding the worker's GIL
    (0.7 s on a quiet host), which once cost a clean clone's CI a 503 mid-request; the worker
    now announces that silence first (engine_worker/grammar_builds.py)."""
    if not QWEN_GGUF.is_file():
        pytest.skip(f"{QWEN_GGUF} is not there")
    with GatewayProc() as gw, \
            WorkerProc(QWEN_GGUF, gw.engine_address, "--model-id", QWEN_MODEL, "--threads", "1"):
        gw.wait_ready(timeout=300)
        yield gw
