"""The worker's speculative settings are checked once at start, and build what they name."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine_worker.config import WorkerConfig
from engine_worker.model_runner import ModelRunner
from engine_worker.speculative.build import build_spec_decoder
from engine_worker.speculative.draft import DraftModelProposer
from engine_worker.speculative.ngram import NgramProposer


@pytest.mark.parametrize("kw", [
    dict(speculative_method="medusa"),
    dict(speculative_method="draft"),  # no --draft-model
    dict(speculative_method="ngram", draft_model="x"),  # a draft model that would be ignored
    dict(speculative_method="ngram", num_speculative_tokens=0),
    dict(speculative_method="ngram", speculative_max_batch=0),
    dict(speculative_method="ngram", speculative_min_acceptance=1.0),
    dict(speculative_method="draft", draft_model="x", speculative_draft_confidence="1.0"),
    dict(speculative_method="draft", draft_model="x", speculative_draft_confidence="often"),
    dict(speculative_method="draft", draft_model="x", speculative_draft_quantization="q2_k"),
])
def test_bad_settings_are_refused(kw: dict) -> None:
    with pytest.raises(ValueError):
        WorkerConfig(**kw)


def test_build_from_settings(tiny_runner: ModelRunner, tiny_dir: Path) -> None:
    assert build_spec_decoder(WorkerConfig(), tiny_runner) is None
    spec = build_spec_decoder(WorkerConfig(speculative_method="ngram",
                                           num_speculative_tokens=3), tiny_runner)
    assert spec is not None and isinstance(spec.proposer, NgramProposer) and spec.k == 3
    spec = build_spec_decoder(WorkerConfig(speculative_method="draft", draft_model=str(tiny_dir),
                                           kv_cache_mb=8), tiny_runner)
    assert spec is not None and isinstance(spec.proposer, DraftModelProposer)
    assert spec.proposer.min_confidence is None  # auto: the measured price of a draft
    spec = build_spec_decoder(WorkerConfig(speculative_method="draft", draft_model=str(tiny_dir),
                                           kv_cache_mb=8, speculative_draft_confidence="0.5"),
                              tiny_runner)
    assert spec is not None and spec.proposer.min_confidence == 0.5


def test_a_gguf_draft_is_requantized_by_default(tiny_runner: ModelRunner, tmp_path: Path,
                                                 tiny_dir: Path,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    """auto: a GGUF draft's Q8_0 matrices served as Q4_0, and the start log says so; none: its
    own blocks; a folder's float weights are not a GGUF's blocks and stay as they are."""
    import gguf

    from engine_worker.model import loader
    from tests.engine_worker.gguf_factory import write_gguf

    path = write_gguf(tiny_dir, tmp_path / "draft.gguf", gguf.GGMLQuantizationType.Q8_0,
                      gguf.GGMLQuantizationType.Q8_0)
    # the test file holds tensors only: its config and tokenizer are the tiny folder's
    real = loader.resolve_checkpoint
    monkeypatch.setattr(loader, "resolve_checkpoint", lambda model, *a, **k: tiny_dir
                        if model == str(path) else real(model, *a, **k))
    caplog.set_level("INFO", logger="kestrel.speculative")
    kinds = {}
    for rq in ("auto", "none"):
        spec = build_spec_decoder(WorkerConfig(speculative_method="draft", draft_model=str(path),
                                               kv_cache_mb=8, speculative_draft_quantization=rq),
                                  tiny_runner)
        assert spec is not None and isinstance(spec.proposer, DraftModelProposer)
        kinds[rq] = (spec.proposer.runner.plan.kinds, spec.proposer.runner.plan.head_kind)
    assert kinds == {"auto": (("q4_0",), "q4_0"), "none": (("q8_0",), "q8_0")}
    said = [r.getMessage() for r in caplog.records if r.name == "kestrel.speculative"]
    assert any("draft model draft.gguf: matmul plan: q4_0: int_dot" in m and
               "re-quantized to q4_0" in m and "MB of weights a token" in m for m in said), said
    spec = build_spec_decoder(WorkerConfig(speculative_method="draft", draft_model=str(tiny_dir),
                                           kv_cache_mb=8), tiny_runner)
    assert spec is not None and spec.proposer.runner.runner_config.requantize == "none"
