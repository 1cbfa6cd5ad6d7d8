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
