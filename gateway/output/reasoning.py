"""Reasoning models' thinking, returned apart from their answer (`--reasoning-parser`).

DeepSeek-R1's distills and Qwen3 write `<think> ... </think>` before the answer. With a parser
set, a chat's message (or stream delta) carries the thinking as `reasoning_content` and, under
vLLM's newer name, `reasoning` (both: renaming it broke clients), and `content` only the answer.

    Reasoning(parser).feed(text) -> [("reasoning" | "content", text), ...]   (streamed pieces)
    Reasoning(parser).finish()   -> the same for what a partial tag held back
    split(parser, text)          -> (reasoning or None, content)               (a whole text)

The two parsers (vLLM's names) differ on a text that does not open with `<think>`:
- `deepseek_r1`: the template opened the thinking itself, so the text starts inside it: all of it
  up to `</think>` is reasoning (all, when `</think>` never comes: cut by max_tokens);
- `qwen3`: the model opens it when it thinks (it may not, with enable_thinking false): a text
  that does not start with `<think>` is all answer.
Tags may arrive split across tokens and chunks (`<th`, `ink>`): a piece that could still become a
tag is held back until it is known, never sent as text.
"""

from __future__ import annotations

from gateway.config import REASONING_PARSERS

START, END = "<think>", "</think>"


class Reasoning:
    def __init__(self, parser: str) -> None:
        if parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning parser must be one of {', '.join(REASONING_PARSERS)}")
        self.parser = parser
        self.state = "start"  # -> "reasoning" -> "content", or "start" -> "content"
        self.held = ""
        self.thought = False  # whether the text had a reasoning part at all

    def feed(self, text: str) -> list[tuple[str, str]]:
        self.held += text
        out: list[tuple[str, str]] = []
        while self.held:
            if self.state == "start":
                lead = self.held.lstrip()
                if lead.startswith(START):
                    self.held, self.state, self.thought = lead[len(START):], "reasoning", True
                elif START.startswith(lead):  # "", "<", "<th": not known yet
                    break
                elif self.parser == "deepseek_r1":
                    self.state, self.thought = "reasoning", True
                else:
                    self.state = "content"
            elif self.state == "reasoning":
                at = self.held.find(END)
                if at >= 0:
                    if at:
                        out.append(("reasoning", self.held[:at]))
                    self.held, self.state = self.held[at + len(END):], "content"
                    continue
                keep = _partial_tag(self.held, END)
                if len(self.held) > keep:
                    out.append(("reasoning", self.held[: len(self.held) - keep]))
                    self.held = self.held[len(self.held) - keep:]
                break
            else:
                out.append(("content", self.held))
                self.held = ""
        return out

    def finish(self) -> list[tuple[str, str]]:
        """What is held back, once the text has ended: a partial tag is text after all."""
        held, self.held = self.held, ""
        if not held:
            return []
        if self.state == "start" and self.parser == "deepseek_r1":
            self.thought = True
        field = "reasoning" if self.state == "reasoning" or (
            self.state == "start" and self.parser == "deepseek_r1") else "content"
        return [(field, held)]


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (0: none)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def split(parser: str, text: str) -> tuple[str | None, str]:
    """A whole text's reasoning (None when it has none) and its answer."""
    r = Reasoning(parser)
    pieces = r.feed(text) + r.finish()
    reasoning = "".join(t for field, t in pieces if field == "reasoning")
    content = "".join(t for field, t in pieces if field == "content")
    return (reasoning if r.thought else None), content


def fields(reasoning: str) -> dict[str, str]:
    """A message's or a delta's reasoning under both of its names."""
    return {"reasoning_content": reasoning, "reasoning": reasoning}
