"""The worker's speculative decoder, built from its settings and its runner's config.

    WorkerConfig --build_spec_decoder(cfg, runner)--> None (off) | SpecDecoder(NgramProposer)
                                                    | SpecDecoder(DraftModelProposer(draft runner))

The draft runner's config is the target's (`runner.runner_config.for_draft`): the same device,
dtype, block size, attention path, cache dir and KV budget, that is --kv-cache-memory (or
--kv-cache-mb) as resolved once at start. A GGUF draft's blocks wider than Q4_0 are re-quantized
to it at load (--speculative-draft-quantization, model/requantize.py): the 0.5B Qwen's one-token
pass then reads 278 MB, not 392 (its Q5_0 layers and Q8_0 head), and takes 12.4 ms, not 14.5,
on a 2-vCPU Zen 4 (bench_draft_costs.py), accepting 0-5 points fewer drafts.
"""

from __future__ import annotations

import logging
from pathlib import Path

from engine_worker.config import WorkerConfig
from engine_worker.model_runner import ModelRunner
from engine_worker.speculative.decoder import Proposer, SpecDecoder
from engine_worker.speculative.ngram import NgramProposer

log = logging.getLogger("kestrel.speculative")


def build_spec_decoder(cfg: WorkerConfig, runner: ModelRunner) -> SpecDecoder | None:
    """The worker's speculative decoder from its settings (None: --speculative-method off)."""
    if cfg.speculative_method == "off":
        return None
    proposer: Proposer
    if cfg.speculative_method == "ngram":
        proposer = NgramProposer()
    else:
        from engine_worker.model.loader import gguf_source, resolve_checkpoint
        from engine_worker.sampler import Sampler
        from engine_worker.speculative import hot_vocab
        from engine_worker.speculative.draft import DraftModelProposer

        gguf = gguf_source(cfg.draft_model)  # a GGUF draft is served from its own blocks
        checkpoint = resolve_checkpoint(cfg.draft_model, Path(cfg.cache_dir),
                                        weights=gguf is None)
        rq = cfg.speculative_draft_quantization
        draft = ModelRunner(runner.runner_config.for_draft(
            checkpoint, gguf, requantize="q4_0" if rq == "auto" else rq))
        log.info("draft model %s: %s, %.1f MB of weights a token", Path(cfg.draft_model).name,
                 draft.plan.describe(), draft.decode_read_bytes / 1e6)
        if draft.config.vocab_size != runner.config.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({draft.config.vocab_size}) is not "
                             f"the served model's ({runner.config.vocab_size})")
        hot = hot_vocab.attach(draft.model, hot_vocab.texts_of(
            runner.runner_config.model_path, runner.config.vocab_size))
        if hot is not None:
            log.info("the draft's head reads ids [0, %d) of %d while a greedy sequence's text "
                     "stays among them (their ASCII-rich prefix)", hot.cut,
                     runner.config.vocab_size)
        conf = cfg.speculative_draft_confidence
        # the served model's EOS ids: min_tokens holds them back in the drafts too, so no draft
        # is spent on an end the target would refuse
        proposer = DraftModelProposer(draft, Sampler(runner.config.eos_token_ids),
                                      min_confidence=None if conf == "auto" else float(conf),
                                      hot=hot)
    return SpecDecoder(proposer, cfg.num_speculative_tokens,
                       max_batch=cfg.speculative_max_batch,
                       min_acceptance=cfg.speculative_min_acceptance)
