"""What each request asks for: prompt text of about N tokens and an output of exactly M tokens.

    WorkloadConfig + seed ──▶ Workload.next_spec() ──▶ RequestSpec
      ──▶ build_request() ──▶ (path, JSON body)

Lengths come from `LengthDist`s (fixed / uniform) or, row by row, from a dataset (ours, ShareGPT or
OpenAI-style conversations: loadgen/dataset.py; a conversation's reference reply sets the output
length, and a chat request sends its turns as they are). Prompts
are synthetic: words drawn from a fixed vocabulary of common English words, each of which is a
single token after a space in the byte-level BPE tokenizers of Llama-family models (checked
against SmolLM2's), so N words is about N tokens. With `tokenizer_json` the text is instead cut
to exactly N tokens of that tokenizer. The output length is forced by `max_tokens` plus
`ignore_eos` (an extension vLLM and kestrel honour), so the server cannot stop early.

A shared-prefix workload puts the same L-token text (a system message for chat) in front of a
fraction F of the prompts, spread evenly: request i has it iff floor((i+1)F) > floor(iF), so any
first n requests hold exactly floor(nF) of them, whatever n a duration-bounded run reaches.

Specs are produced in index order from one seeded `random.Random`, so spec i is the same however
the runner interleaves requests.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from loadgen.config import Api, WorkloadConfig
from loadgen.dataset import load_dataset

VOCABULARY: tuple[str, ...] = tuple("""
the of and to in is for on that with as was by at from it this be are or an have not has but
they he she we you his her their which one all more new were been can would there will about time
when what year so if no other up also into some after first two over than out people only most
may like then them these its any could between where our state world such well much many back
through under city house water life work school group number part day place made during while
high small large long great public system each last case point same right left area family power
music game party book story young order line light hand head home side river land north south
east west early late open real next few near best old major general human local national money
market field study form level view model war team name course door plan rate price value kind
voice road fire body child cause class space sign trade letter paper board stone island forest
garden window street bridge village church mountain ocean coast table chair glass bread fruit
apple horse bird fish tree flower grass summer winter spring autumn morning evening night week
month season doctor teacher farmer captain king queen student artist writer police army energy
metal gold silver iron steel cotton wood color green blue red black white brown yellow bright
dark quiet strong simple clear ready happy free full short warm cold deep wide heavy basic final
common single certain private social natural central modern recent special former total similar
various whole main true hard easy fast slow soft safe rich poor sure able good bad big little
""".split())


@dataclass(frozen=True)
class RequestSpec:
    """One request's content. `prompt_len` is the target (or counted) length of `prompt` alone;
    `prefix` (the shared text, if any) adds about `prefix_len` more tokens."""

    index: int
    prompt: str
    prompt_len: int
    output_len: int
    prefix: str | None = None
    prefix_len: int = 0
    messages: tuple[dict[str, str], ...] | None = None  # a dataset conversation's turns

    @property
    def shared_prefix(self) -> bool:
        return self.prefix is not None


class TokenCounter(Protocol):
    def count(self, text: str) -> int: ...
    def fit(self, words: list[str], target: int, rng: random.Random) -> str: ...


class WordCounter:
    """The approximation: one token per word (each vocabulary word is one token after a space)."""

    def count(self, text: str) -> int:
        return len(text.split())

    def fit(self, words: list[str], target: int, rng: random.Random) -> str:
        return " ".join(words[:target])


class TokenizerCounter:
    """Exact counts with a `tokenizers` JSON file: cut the text at the end of token `target`."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer  # only this option needs it; the CLI starts without it

        self.tok = Tokenizer.from_file(str(path))

    def count(self, text: str) -> int:
        return len(self.tok.encode(text, add_special_tokens=False).ids)

    def fit(self, words: list[str], target: int, rng: random.Random) -> str:
        if target == 0:
            return ""
        text = " ".join(words[:target])
        enc = self.tok.encode(text, add_special_tokens=False)
        while len(enc.ids) < target:  # words longer than a token are common; words shorter not
            text += " " + " ".join(rng.choice(VOCABULARY) for _ in range(target - len(enc.ids)))
            enc = self.tok.encode(text, add_special_tokens=False)
        # Offsets are character spans in `text`: cutting there keeps whole tokens, and re-encoding
        # the cut text gives `target` tokens for the usual BPE and word-level tokenizers.
        return text[: enc.offsets[target - 1][1]]


def make_counter(tokenizer_json: Path | None) -> TokenCounter:
    return TokenizerCounter(tokenizer_json) if tokenizer_json is not None else WordCounter()


def synthetic_text(target: int, rng: random.Random, counter: TokenCounter) -> str:
    words = [rng.choice(VOCABULARY) for _ in range(target)]
    return counter.fit(words, target, rng)


class Workload:
    """An endless, reproducible stream of RequestSpecs (a JSONL dataset is cycled in order)."""

    def __init__(self, config: WorkloadConfig, seed: int = 0) -> None:
        self.config = config
        # Separate string-seeded streams (stable across runs; str seeds hash with SHA-512) so the
        # prefix text does not depend on how many requests are drawn.
        self.rng = random.Random(f"{seed}:workload")
        self.counter = make_counter(config.tokenizer_json)
        self.rows = load_dataset(config.dataset) if config.dataset is not None else None
        self.prefix: str | None = None
        if config.shared_prefix_frac > 0:
            prefix_rng = random.Random(f"{seed}:prefix")
            self.prefix = synthetic_text(config.shared_prefix_len, prefix_rng, self.counter)
        self.index = 0

    def next_spec(self) -> RequestSpec:
        i, cfg = self.index, self.config
        self.index += 1
        row = self.rows[i % len(self.rows)] if self.rows is not None else {}
        if isinstance(row.get("prompt"), str):
            prompt = row["prompt"]
            prompt_len = self.counter.count(prompt)
        else:
            prompt_len = (row["prompt_len"] if "prompt_len" in row
                          else cfg.prompt_len.sample(self.rng))
            prompt = synthetic_text(prompt_len, self.rng, self.counter)
        if "output_len" in row:
            output_len = row["output_len"]
        elif "answer" in row:  # a conversation's reply: ask for as many tokens as it had
            output_len = max(1, self.counter.count(row["answer"]))
        else:
            output_len = cfg.output_len.sample(self.rng)
        messages = tuple(row["messages"]) if "messages" in row else None
        frac = cfg.shared_prefix_frac
        shared = math.floor((i + 1) * frac) > math.floor(i * frac)
        return RequestSpec(i, prompt, prompt_len, output_len,
                           self.prefix if shared else None, cfg.shared_prefix_len if shared else 0,
                           messages)

    def take(self, n: int) -> list[RequestSpec]:
        return [self.next_spec() for _ in range(n)]


def build_request(spec: RequestSpec, api: Api, model: str, *, ignore_eos: bool = True,
                  extra_body: dict[str, Any] | None = None,
                  stream: bool = True) -> tuple[str, dict[str, Any]]:
    """The path (relative to the base URL) and JSON body of a request for `spec`, streamed
    (with usage in the last chunk) unless `stream` is False."""
    body: dict[str, Any] = {"model": model, "max_tokens": spec.output_len, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if ignore_eos:
        body["ignore_eos"] = True
    if api == "chat":
        messages = [{"role": "system", "content": spec.prefix}] if spec.prefix is not None else []
        turns = list(spec.messages) if spec.messages is not None else [
            {"role": "user", "content": spec.prompt}]
        body["messages"] = [*messages, *turns]
        path = "/chat/completions"
    else:
        # The prefix's last word and the prompt's first are joined by a space, which byte-level
        # BPEs attach to the following word: the prefix tokenizes the same in every request.
        body["prompt"] = f"{spec.prefix} {spec.prompt}" if spec.prefix is not None else spec.prompt
        path = "/completions"
    body.update(extra_body or {})
    return path, body
