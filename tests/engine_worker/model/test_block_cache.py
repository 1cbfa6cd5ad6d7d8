"""Issue 39: a GGUF's rewritten blocks kept between starts (engine_worker/model/block_cache.py)
and the start probe's step costs kept per host (engine_worker/probe_record.py). A tiny Qwen2 GGUF
mixing Q4_K, Q5_K, Q6_K (rewritten) and Q5_0 (served as stored), written by the test."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from types import SimpleNamespace

import gguf
import pytest
import torch

from engine_worker import kernel_build
from engine_worker.model.block_cache import BlockCache
from engine_worker.model.gguf_native import load_gguf_model
from engine_worker.model.loader import load_config
from engine_worker.model.matmul_plan import MatmulPlan
from engine_worker.probe_record import ProbeRecord
from engine_worker.step_costs import StepCosts
from tests.engine_worker.gguf_factory import write_state_gguf
from tests.engine_worker.model.test_gguf_kquants import DIMS, PROMPT, VARIANTS
from tests.engine_worker.model.test_gguf_native import _logits

Q = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    from transformers import AutoModelForCausalLM

    make_cfg, arch, qwen_types = VARIANTS["qwen2"]
    # the gate|up in Q5_1, which is rewritten (to q8_1) and so kept in the cache; the K-quants
    # are served as stored and only their packed layers are cached

    def qtype_of(name: str) -> gguf.GGMLQuantizationType:
        return Q.Q5_1 if "gate" in name or "up_proj" in name else qwen_types(name)

    tmp = tmp_path_factory.mktemp("block-cache")
    torch.manual_seed(1)
    hf = AutoModelForCausalLM.from_config(make_cfg()).to(torch.float32).eval()
    hf.save_pretrained(tmp / "hf")
    state = {k: v.numpy() for k, v in hf.state_dict().items()}
    path = write_state_gguf(state, tmp / "qwen2.gguf", arch, qtype_of,
                            DIMS["num_attention_heads"], DIMS["num_key_value_heads"])
    return path, load_config(tmp / "hf")


def load(path: Path, cfg: object, cache: BlockCache | None) -> torch.Tensor:
    model = load_gguf_model(path, cfg, "cpu", plan=MatmulPlan(int_dot_all=True), blocks=cache)  # type: ignore
    return _logits(model, PROMPT)


def damage(path: Path) -> None:
    """Flip one byte in the middle of a cached (read-only) file."""
    os.chmod(path, 0o644)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_second_load_maps_every_rewritten_tensor_and_computes_the_same_logits(
        int_dot_kernel: None, qwen: tuple[Path, object], tmp_path: Path) -> None:
    path, cfg = qwen
    plain = load(path, cfg, None)
    first = BlockCache.beside(path, tmp_path)
    assert torch.equal(load(path, cfg, first), plain)
    assert first.hits == 0 and first.writes > 0
    bins = sorted(first.folder.glob("*.bin"))
    assert len(bins) == first.writes
    assert not any("attn_output" in b.name for b in bins)  # Q5_0: a view of the file, no copy
    assert all(stat.S_IMODE(b.stat().st_mode) == 0o444 for b in bins)
    second = BlockCache.beside(path, tmp_path)
    assert torch.equal(load(path, cfg, second), plain)
    assert second.hits == first.writes and second.writes == 0


def test_a_damaged_cached_tensor_is_rewritten_not_served(
        int_dot_kernel: None, qwen: tuple[Path, object], tmp_path: Path) -> None:
    path, cfg = qwen
    plain = load(path, cfg, None)
    cache = BlockCache.beside(path, tmp_path)
    load(path, cfg, cache)
    damage(sorted(cache.folder.glob("*.bin"))[0])
    again = BlockCache.beside(path, tmp_path)
    assert torch.equal(load(path, cfg, again), plain)
    assert again.writes == 1 and again.hits == cache.writes - 1


def test_a_file_rewritten_in_place_gets_a_new_cache_and_the_old_one_goes(
        int_dot_kernel: None, qwen: tuple[Path, object], tmp_path: Path) -> None:
    path, cfg = qwen
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(path.read_bytes())
    old = BlockCache.beside(copy, tmp_path)
    load(copy, cfg, old)
    os.utime(copy, ns=(0, copy.stat().st_mtime_ns + 10**9))
    new = BlockCache.beside(copy, tmp_path)
    assert new.folder != old.folder and not old.folder.exists()
    load(copy, cfg, new)
    assert new.hits == 0 and new.writes == old.writes


def test_a_folder_that_cannot_be_written_serves_without_a_cache(
        int_dot_kernel: None, qwen: tuple[Path, object], tmp_path: Path) -> None:
    path, cfg = qwen
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    cache = BlockCache(blocker / "blocks")  # its parent is a file: nothing can be made there
    assert torch.equal(load(path, cfg, cache), load(path, cfg, None))
    assert not cache.writable and cache.writes == 0


# ---- the probe's record ----------------------------------------------------------------------

def runner_like(model: Path, **over: object) -> SimpleNamespace:
    rc = SimpleNamespace(gguf_path=model, model_path=model.parent)
    fields = dict(runner_config=rc, dtype_name="float32", device="cpu", paged_decode=True,
                  use_stack=False, plan=MatmulPlan(), compiled=None, num_blocks=64,
                  block_size=16, max_model_len=1024)
    return SimpleNamespace(**{**fields, **over})


def measured() -> StepCosts:
    costs = StepCosts(512)
    for rows, seconds in ((1, 0.010), (16, 0.040), (32, 0.090)):
        costs.observe(rows, 0, seconds)
    costs.observe(0, 64, 0.320)
    return costs


def test_a_saved_probe_seeds_a_later_start_with_the_same_estimates(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"x")
    record = ProbeRecord.for_runner(tmp_path, runner_like(model), {"max_num_seqs": 32})
    fresh = StepCosts(512)
    assert not record.seed(fresh)  # nothing kept yet: the worker probes
    record.save(measured())
    later = StepCosts(512)
    assert ProbeRecord.for_runner(tmp_path, runner_like(model), {"max_num_seqs": 32}).seed(later)
    assert later.points() == measured().points()
    assert later.prefill_rows(16) == measured().prefill_rows(16)


def test_a_probe_is_reused_whatever_the_kv_cache_s_size(tmp_path: Path) -> None:
    """A --kv-cache-memory fraction gives another cache size (and context) at every start."""
    model = tmp_path / "m.gguf"
    model.write_bytes(b"x")
    ProbeRecord.for_runner(tmp_path, runner_like(model), {}).save(measured())
    bigger = runner_like(model, num_blocks=4096, max_model_len=8192)
    assert ProbeRecord.for_runner(tmp_path, bigger, {}).seed(StepCosts(512))
    short = runner_like(model, max_model_len=128)  # the probe's context itself is shorter
    assert not ProbeRecord.for_runner(tmp_path, short, {}).seed(StepCosts(512))


@pytest.mark.parametrize("change", ["settings", "dtype", "model file", "threads", "kernels"])
def test_a_probe_is_not_reused_for_another_setting_model_thread_count_or_kernel(
        tmp_path: Path, change: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"x")
    ProbeRecord.for_runner(tmp_path, runner_like(model), {"max_num_seqs": 32}).save(measured())
    settings, runner = {"max_num_seqs": 32}, runner_like(model)
    threads = torch.get_num_threads()
    if change == "settings":
        settings = {"max_num_seqs": 64}
    elif change == "dtype":
        runner = runner_like(model, dtype_name="bfloat16")
    elif change == "model file":
        model.write_bytes(b"xy")
    elif change == "kernels":  # an edited kernel: its steps cost what they cost now
        csrc = tmp_path / "csrc"
        csrc.mkdir()
        for src in kernel_build.CSRC.glob("*.cpp"):
            (csrc / src.name).write_bytes(src.read_bytes() + b"\n// edited\n")
        monkeypatch.setattr(kernel_build, "CSRC", csrc)
    else:
        torch.set_num_threads(threads + 1)
    try:
        assert not ProbeRecord.for_runner(tmp_path, runner, settings).seed(StepCosts(512))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("body", ["not json", json.dumps({"points": {"decode": [], "prefill": []}}),
                                  json.dumps({"points": {"decode": [[3, 1, 0.1]],
                                                         "prefill": [[16, 0.01]]}})])
def test_a_record_that_is_not_a_probe_s_is_ignored(tmp_path: Path, body: str) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"x")
    record = ProbeRecord.for_runner(tmp_path, runner_like(model), {})
    record.path.parent.mkdir(parents=True)
    record.path.write_text(body)
    costs = StepCosts(512)
    assert not record.seed(costs) and costs.points() == {"decode": [], "prefill": []}


def _mapped_files(t: torch.Tensor) -> set[str]:
    """The files whose mapping holds the tensor's first byte (/proc/self/maps)."""
    at = t.data_ptr()
    out = set()
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, *rest = line.split()
        lo, hi = (int(x, 16) for x in span.split("-"))
        if lo <= at < hi and len(rest) >= 5:
            out.add(rest[4])
    return out


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc")
def test_the_packed_layers_are_pages_of_the_cache_mapped_by_every_load(
        int_dot_kernel: None, qwen: tuple[Path, object], tmp_path: Path) -> None:
    """The kernel's packed copies are written once and mapped: file pages two workers of one
    file share, not anonymous memory each builds; a second load packs nothing and computes
    the same logits; a damaged packed part is packed again, never served."""
    from engine_worker.model.int_dot_linear import IntDotLinear

    path, cfg = qwen
    plain = load(path, cfg, None)
    first = BlockCache.beside(path, tmp_path)
    assert torch.equal(load(path, cfg, first), plain)
    assert first.packed_writes > 0 and first.packed_hits == 0
    second = BlockCache.beside(path, tmp_path)
    model = load_gguf_model(path, cfg, "cpu", plan=MatmulPlan(int_dot_all=True),  # type: ignore
                            blocks=second)
    assert torch.equal(_logits(model, PROMPT), plain)
    assert second.packed_hits == first.packed_writes and second.packed_writes == 0
    layers = [m for m in model.modules() if isinstance(m, IntDotLinear)]
    assert len(layers) == first.packed_writes
    for m in layers:
        files = _mapped_files(m.packed.qs) | _mapped_files(m.packed.d)
        assert files and all(f.startswith(str(second.folder / "packed")) for f in files), files
    damage(sorted((second.folder / "packed").glob("*.qs.bin"))[0])
    third = BlockCache.beside(path, tmp_path)
    assert torch.equal(load(path, cfg, third), plain)
    assert third.packed_writes == 1 and third.packed_hits == first.packed_writes - 1


# ---- issue 54: the seals are signed with a key the worker keeps outside the cache -------------

def reseal(json_path: Path, bin_path: Path) -> None:
    """What anyone who can write the cache folder can do: rewrite a seal's sha256 to match."""
    import hashlib

    os.chmod(json_path, 0o644)
    meta = json.loads(json_path.read_text())
    meta["sha256"] = hashlib.sha256(bin_path.read_bytes()).hexdigest()
    json_path.write_text(json.dumps(meta))


def test_a_tampered_tensor_with_its_sha256_rewritten_beside_it_is_not_served(
        int_dot_kernel: None, qwen: tuple[Path, object], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KESTREL_BLOCK_CACHE_KEY", str(tmp_path / "state" / "seal.key"))
    path, cfg = qwen
    plain = load(path, cfg, None)
    cache = BlockCache.beside(path, tmp_path / "models")
    load(path, cfg, cache)
    victim = sorted(cache.folder.glob("*.bin"))[0]
    damage(victim)
    reseal(victim.with_suffix(".json"), victim)
    again = BlockCache.beside(path, tmp_path / "models")
    assert torch.equal(load(path, cfg, again), plain)  # the file's own weights, not the edit
    assert again.writes == 1 and again.hits == cache.writes - 1


def test_the_seal_key_is_made_once_for_its_user_alone_outside_the_cache(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from engine_worker.model.block_cache import seal_key

    key_file = tmp_path / "state" / "seal.key"
    monkeypatch.setenv("KESTREL_BLOCK_CACHE_KEY", str(key_file))
    key = seal_key()
    assert key is not None and len(key) == 32 and seal_key() == key  # made once, then read
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(key_file.parent.stat().st_mode) == 0o700
    os.chmod(key_file, 0o644)  # others may read it: it signs nothing
    assert seal_key() is None
    cache = BlockCache(tmp_path / "models" / "blocks")
    assert not cache.writable  # no key, no cache: served from the file
