"""Speculative decoding: propose -> verify (one forward pass) -> accept, lossless.

    state.py       SpecState: a sequence's speculation state, one object on `Sequence.spec`
    decoder.py     SpecDecoder: when to speculate, proposing through a Proposer, acceptance
    acceptance.py  accept(): rejection sampling over a batch of draft chunks
    ngram.py       NgramProposer: prompt lookup
    draft.py       DraftModelProposer: a small model on its own KV cache
    build.py       build_spec_decoder(): the above from the worker's settings

Kept free of imports here so that `Sequence` (no torch) can import `state` alone.
"""
