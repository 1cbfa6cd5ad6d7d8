"""The draft's head over the vocabulary's ASCII-rich prefix (engine_worker/speculative/
hot_vocab.py): where the prefix ends, the same logits for its ids, taken only by passes whose
sequences are plain greedy and stay in it, and the text of plain decoding either way."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch

from engine_worker.model.int_dot_linear import IntDotLinear
from engine_worker.model_runner import ModelRunner
from engine_worker.runner_config import RunnerConfig
from engine_worker.speculative import hot_vocab
from engine_worker.speculative.draft import DraftModelProposer
from engine_worker.step import StepItem
from tests.engine_worker.gguf_factory import write_gguf
from tests.engine_worker.speculative.test_speculative import engine, gen, run

Q = gguf.GGMLQuantizationType
W = hot_vocab.WINDOW


def test_the_prefix_ends_at_the_first_window_mostly_not_ascii() -> None:
    assert hot_vocab.hot_prefix(["ab"] * (3 * W) + ["é"] * W + ["ab"] * W) == 3 * W
    mixed = ["ab"] * (2 * W) + ["ab", "né", "дом"] * W  # a third ASCII: cold
    assert hot_vocab.hot_prefix(mixed) == 2 * W


def test_no_prefix_where_nothing_is_cold_or_too_little_would_be_cut() -> None:
    assert hot_vocab.hot_prefix(["ab"] * (8 * W)) is None  # ASCII-rich throughout
    assert hot_vocab.hot_prefix(["日本"] * (8 * W)) is None  # cold from the first id
    assert hot_vocab.hot_prefix(["ab"] * (15 * W) + ["é"] * W) is None  # 1/16 left out


def test_control_tokens_past_the_cut_leave_a_sequence_hot(gguf_draft: ModelRunner) -> None:
    """Qwen's chat template puts <|im_start|> (151,644) in every prompt: ASCII text past the
    cut, so not cold; a non-ASCII id past it is."""
    n = 49152
    texts = ["ab"] * (10 * W) + ["é"] * (n - 10 * W - 2) + ["<|im_start|>", "<|im_end|>"]
    head = gguf_draft.model.lm_head
    try:
        hot = hot_vocab.attach(gguf_draft.model, texts)
        assert hot is not None and hot.cut == 10 * W
        assert not hot.leaves([5, n - 2, 17, n - 1]) and not hot.leaves([])
        assert hot.leaves([5, 10 * W + 3]) and hot.leaves([n - 3])
    finally:
        gguf_draft.model.lm_head = head


def test_smollm2s_vocabulary_has_no_hot_prefix(smollm2_meta_dir: Path) -> None:
    texts = hot_vocab.texts_of(smollm2_meta_dir, 49152)
    assert len(texts) == 49152 and hot_vocab.hot_prefix(texts) is None


@pytest.fixture(scope="module")
def gguf_draft(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory,
               cache_dir: Path) -> ModelRunner:
    """The tiny model as a draft is served: a GGUF re-quantized to Q4_0, every matmul (its
    head too) on the integer-dot kernel."""
    path = write_gguf(tiny_dir, tmp_path_factory.mktemp("hot") / "tiny.gguf", Q.Q4_1, Q.Q8_0)
    return ModelRunner(RunnerConfig(tiny_dir, gguf_path=path, kv_budget_bytes=16 << 20,
                                    block_size=16, requantize="q4_0", cache_dir=cache_dir))


CUT = 47104  # of the tiny model's 49,152 ids: a random model's next id is past it 1 time in 24


@pytest.fixture
def hot(gguf_draft: ModelRunner) -> hot_vocab.HotHead:
    head = gguf_draft.model.lm_head
    head = head.head if isinstance(head, hot_vocab.HotHead) else head
    assert isinstance(head, IntDotLinear)
    gguf_draft.model.lm_head = hot_vocab.HotHead(head, CUT)
    yield gguf_draft.model.lm_head
    gguf_draft.model.lm_head = head


def test_a_hot_pass_gives_the_prefix_of_the_whole_heads_logits(
        gguf_draft: ModelRunner, hot: hot_vocab.HotHead) -> None:
    item = StepItem(list(range(5, 30)), 0, [0, 1])
    whole = gguf_draft.execute([item])
    hot.hot = True
    part = gguf_draft.execute([item])
    hot.hot = False
    assert part.shape == (1, CUT) and whole.shape[1] == 49152
    torch.testing.assert_close(part, whole[:, :CUT], rtol=0, atol=0)


class _Watched(DraftModelProposer):
    """Records whether each draft pass took the hot head."""

    def __init__(self, runner: ModelRunner, hot: hot_vocab.HotHead) -> None:
        super().__init__(runner, hot=hot)
        self.passes: list[bool] = []

    def _execute(self, items: list[StepItem]) -> torch.Tensor:
        assert self.hot is not None
        self.passes.append(self.hot.hot)
        logits = super()._execute(items)
        assert logits.shape[1] == (CUT if self.hot.hot else 49152)
        return logits


def test_greedy_text_in_the_prefix_drafts_hot_and_keeps_plain_decodings_text(
        tiny_runner: ModelRunner, gguf_draft: ModelRunner, hot: hot_vocab.HotHead) -> None:
    prompt = [7 + (i * 37) % (CUT - 8) for i in range(40)]  # every id below the cut
    proposer = _Watched(gguf_draft, hot)
    gens = [gen("g", prompt, 24)]
    out = run(engine(tiny_runner, proposer), gens)
    assert out == run(engine(tiny_runner, None), gens)
    # hot from the first pass, until the target's own text leaves the prefix (if it does)
    passes = proposer.passes
    assert passes and passes[0] and passes == sorted(passes, reverse=True)


def test_a_sequence_with_an_id_past_the_cut_or_sampled_drafts_over_every_id(
        tiny_runner: ModelRunner, gguf_draft: ModelRunner, hot: hot_vocab.HotHead) -> None:
    cold_prompt = [7 + (i * 37) % (CUT - 8) for i in range(39)] + [CUT + 5]
    for g in (gen("cold", cold_prompt, 12),
              gen("sampled", cold_prompt[:-1], 12, temperature=0.8, seed=3)):
        proposer = _Watched(gguf_draft, hot)
        out = run(engine(tiny_runner, proposer), [g])
        assert proposer.passes and not any(proposer.passes)
        if g.params.temperature == 0:
            assert out == run(engine(tiny_runner, None), [g])


def test_the_workers_builder_puts_a_hot_head_on_a_gguf_draft(
        tiny_runner: ModelRunner, tiny_dir: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Built as a worker builds it: a vocabulary whose last sixth is not ASCII (SmolLM2's, the
    tiny model's, is ASCII throughout: its texts are replaced) gets a hot head at the cut, and
    the start log says so; the real vocabulary gets none."""
    from engine_worker.config import WorkerConfig
    from engine_worker.model import loader
    from engine_worker.speculative.build import build_spec_decoder

    path = write_gguf(tiny_dir, tmp_path / "draft.gguf", Q.Q4_1, Q.Q8_0)
    real = loader.resolve_checkpoint
    monkeypatch.setattr(loader, "resolve_checkpoint", lambda model, *a, **k: tiny_dir
                        if model == str(path) else real(model, *a, **k))
    settings = WorkerConfig(speculative_method="draft", draft_model=str(path), kv_cache_mb=8)
    spec = build_spec_decoder(settings, tiny_runner)
    assert spec is not None and isinstance(spec.proposer, DraftModelProposer)
    assert spec.proposer.hot is None
    caplog.set_level("INFO", logger="kestrel.speculative")
    monkeypatch.setattr(hot_vocab, "texts_of",
                        lambda _path, n: ["ab"] * (10 * W) + ["é"] * (n - 10 * W))
    spec = build_spec_decoder(settings, tiny_runner)
    assert spec is not None and isinstance(spec.proposer, DraftModelProposer)
    assert spec.proposer.hot is not None and spec.proposer.hot.cut == 10 * W
    assert spec.proposer.runner.model.lm_head is spec.proposer.hot
    said = [r.getMessage() for r in caplog.records if r.name == "kestrel.speculative"]
    assert any(f"reads ids [0, {10 * W}) of 49152" in m for m in said), said
