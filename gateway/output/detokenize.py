"""Incremental detokenization for streaming: token ids in, text that is safe to send out.

Data flow for one choice of one request:

    TokenOutput.token_ids --add()--> [UTF-8 stage] --> [stop-string stage] --> text to send
    finish (eos/length)   --flush()--> whatever was held back

UTF-8 stage. Byte-level tokenizers split one character over several tokens ("😀" is 3 tokens in
SmolLM2), and some decoders change a token's text by its position (a leading metaspace is dropped
at the start of a sequence). So we never decode one token alone: we keep two offsets into the ids,
`prefix <= read`, and decode the window ids[prefix:] against ids[prefix:read] (the method of
Hugging Face TGI and vLLM). The difference is new text, released only when it does not end in
U+FFFD (a character still missing bytes). Invariant: ids[:read] decodes to a string that ends on a
whole, valid character, so the text released so far is always a prefix of decode(all ids).

Stop-string stage. Text from the UTF-8 stage goes into `_held` first. A stop string that is
complete ends the output at its start. Otherwise we release all of `_held` except its longest
tail that is a proper prefix of some stop string: that tail might be the start of a stop, and a
sent byte cannot be taken back. Invariant: `_held` is shorter than the longest stop string, so
each step costs O(total length of the stop strings), whatever the length of the output.

Which stop wins. Generation ends when the first stop string is COMPLETED as text grows, so we
pick the occurrence that ends first, and among those ending at the same character, the longest
(so that no part of any stop string is sent). Only this rule gives the same answer however the
ids are split into add() calls: with stops "abcd" and "bc", text arriving as "abc" must stop at
"bc" before the "d" exists, so "abcd" arriving at once must too.

The result, for any split of the same ids into add() calls:
    "".join(outputs) + flush() == cut(tokenizer.decode(all ids), stops)
It holds for every id sequence with byte-level (GPT-2 style) decoders, and for valid UTF-8 with
byte-fallback (Llama style) ones. One exception, on garbage only: a ByteFallback decoder turns
EVERY byte of an invalid run of byte tokens into U+FFFD, valid ones included, so a full decode
can replace a character that a stream had already sent; sent text is final, so we keep it.
"""

from __future__ import annotations

from collections.abc import Sequence

from gateway.tokens.tokenizer import GatewayTokenizer

_REPLACEMENT_CHAR = "\ufffd"


def _stop_match(text: str, stops: Sequence[str]) -> tuple[int, str] | None:
    """(start, stop) of the stop occurrence in `text` that ends first; ties: the longest stop."""
    best: tuple[int, int, str] | None = None  # (end, start, stop)
    for stop in stops:
        start = text.find(stop)  # the first occurrence of one string is also the first to end
        if start >= 0:
            candidate = (start + len(stop), start, stop)
            if best is None or candidate[:2] < best[:2]:
                best = candidate
    return None if best is None else (best[1], best[2])


def _partial_stop_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of some stop string."""
    longest = 0
    for stop in stops:
        # Try the longer tails first; a tail of length k can only match if k < len(stop).
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if stop.startswith(text[-k:]):
                longest = k
                break
    return longest


class IncrementalDetokenizer:
    """Turns one sequence's generated token ids into text, chunk by chunk. Not thread-safe: one
    instance per choice, used by the task that streams that choice."""

    def __init__(
        self,
        tokenizer: GatewayTokenizer,
        stop: Sequence[str] | None = None,
        skip_special_tokens: bool = True,
        keep_stop: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._keep_stop = keep_stop  # vLLM's include_stop_str_in_output: the text ends after it
        # Empty stop strings would match everywhere; OpenAI's API never means that. Order is kept
        # (dict keys) only so that behaviour is reproducible; the winner does not depend on it.
        self._stops: tuple[str, ...] = tuple(dict.fromkeys(s for s in stop or () if s))
        self._ids: list[int] = []
        self._prefix = 0  # ids[prefix:read] decoded last time: context for the next window
        self._read = 0  # ids[:read] have been released to the stop-string stage
        self._held = ""  # decoded text not sent yet: it may begin a stop string
        self._pieces: list[str] = []  # everything sent, in order
        self._finished = False
        self.stopped = False
        self.matched_stop: str | None = None

    @property
    def text(self) -> str:
        """Everything emitted so far (by add() and flush())."""
        return "".join(self._pieces)

    @property
    def finished(self) -> bool:
        """True once a stop string matched or flush() ran: no more text will come."""
        return self._finished

    @property
    def num_tokens(self) -> int:
        """Token ids fed so far, including any after a stop string (those are ignored)."""
        return len(self._ids)

    def add(self, token_ids: Sequence[int]) -> str:
        """Feed newly generated ids; return the text that is now safe to send (maybe "").

        After a stop string has matched, further ids are ignored and "" is returned: the caller
        checks `stopped` and cancels the generation.
        """
        if self.stopped:
            return ""
        if self._finished:
            raise RuntimeError("add() after flush(): this sequence is finished")
        self._ids.extend(token_ids)
        return self._release(self._decode_new(final=False), final=False)

    def flush(self) -> str:
        """End of generation (eos or length): return all text still held back.

        A trailing incomplete character decodes to U+FFFD, as a full decode would. Idempotent.
        """
        if self._finished:
            return ""
        out = self._release(self._decode_new(final=True), final=True)
        self._finished = True
        return out

    def _decode_new(self, final: bool) -> str:
        """Text of the ids past `read` that is complete UTF-8 (all of it when `final`)."""
        if self._read == len(self._ids):
            return ""
        window = self._ids[self._prefix :]
        before = self._tokenizer.decode(
            window[: self._read - self._prefix], self._skip_special_tokens
        )
        after = self._tokenizer.decode(window, self._skip_special_tokens)
        # Wait when nothing new shows (a skipped special token) or a character is still missing
        # bytes; the window then grows until it completes. `after` starts with `before`, since
        # ids[prefix:read] ends on a whole character (the module docstring's one exception aside).
        if not final and (len(after) <= len(before) or after.endswith(_REPLACEMENT_CHAR)):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before) :]

    def _release(self, new_text: str, final: bool) -> str:
        """Pass new text through the stop-string stage; record and return what is sent."""
        if not self._stops:
            out = new_text
        else:
            text = self._held + new_text
            match = _stop_match(text, self._stops)
            if match is not None:
                start, stop = match
                out, self._held = text[:start + len(stop) if self._keep_stop else start], ""
                self.stopped, self.matched_stop, self._finished = True, stop, True
            elif final:
                out, self._held = text, ""
            else:
                keep = _partial_stop_len(text, self._stops)
                out, self._held = text[: len(text) - keep], text[len(text) - keep :]
        if out:
            self._pieces.append(out)
        return out
