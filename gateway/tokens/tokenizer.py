"""The gateway's tokenizer: text <-> token ids, and chat templates. No torch, no transformers.

Data flow: a worker's Hello carries a `protocol.messages.TokenizerInfo` (the `tokenizers` JSON, the
chat template, the special tokens). `GatewayTokenizer.from_info` builds one tokenizer per model from
it, once. For each request the gateway then

    chat messages --encode_chat--> prompt ids  --> worker
        (a control token's spelling in a client's text hidden behind a per-render marker,
         rendered by the chat template, the text cut at the template's own control tokens)
    worker --> generated ids --(gateway.output.detokenize.IncrementalDetokenizer)--> text

Everything here is read-only after construction, so one instance is shared by all requests and
threads: the Rust `tokenizers.Tokenizer` is safe to call concurrently as long as nobody changes its
truncation/padding settings (we never do), and a compiled jinja2 template renders reentrantly.
Encoding a long prompt is CPU work; callers run it in a worker thread, off the event loop.

The chat template (gateway.tokens.chat_template) is rendered the way transformers renders it, so the
prompt text is byte-for-byte what the model was trained and evaluated with; `native_tools` says
whether it lays out a request's tools itself (gateway.prompt.tools then passes them through).
"""

from __future__ import annotations

import math
import re
import secrets
import string
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
from tokenizers import Tokenizer

from gateway.tokens.chat_template import (  # noqa: F401 - the errors are this module's API too
    ChatTemplate,
    ChatTemplateError,
    RenderedPromptTooLong,
)
from protocol.messages import TokenizerInfo

# The longest chat template compiled. Those of the models we serve are 1-3 KB; a template of
# dense `if` blocks costs ~20 ms of CPU per KB to compile (Ice Lake), part of it in one call that
# holds the GIL: a 1.2 MB one took 23 s, the process reaching 263 MB.
# Past the limit, the model serves completions but not chat.
MAX_TEMPLATE_CHARS = 128 * 1024


class GatewayTokenizer:
    """One model's tokenizer, built once from the TokenizerInfo its workers announce."""

    def __init__(self, info: TokenizerInfo) -> None:
        self._info = info
        self._tok = Tokenizer.from_str(info.tokenizer_json)
        added = self._tok.get_added_tokens_decoder()
        # Invariant: fixed at construction; sets are frozen so sharing across threads is safe.
        self._special_ids: frozenset[int] = frozenset(i for i, t in added.items() if t.special)
        self._added: dict[str, int] = {t.content: i for i, t in added.items()}  # never changed
        # The control tokens' spellings (<|im_start|>...): only a template's own text may make
        # them; in a message's content they are text (encode_chat).
        specials = sorted((t.content for t in added.values() if t.special), key=len, reverse=True)
        self._specials = re.compile("|".join(map(re.escape, specials))) if specials else None
        self._special_spellings: tuple[str, ...] = tuple(specials)
        self._as_text: Tokenizer | None = None  # the same, spelling special tokens out as text
        self._as_text_lock = threading.Lock()
        self._bos_id: int | None = (
            self._tok.token_to_id(info.bos_token) if info.bos_token is not None else None
        )
        eos_ids = list(info.eos_token_ids)
        if not eos_ids and info.eos_token is not None:
            eos_id = self._tok.token_to_id(info.eos_token)
            eos_ids = [eos_id] if eos_id is not None else []
        self._eos_ids: tuple[int, ...] = tuple(eos_ids)
        # Compiled once; a template that does not compile only breaks chat requests, not the model.
        self._template: ChatTemplate | None = None
        self._template_error: str | None = None
        # Like transformers' special_tokens_map: a token the model lacks stays undefined.
        special = {name: value for name, value in (("bos_token", info.bos_token),
                                                    ("eos_token", info.eos_token))
                   if value is not None}
        if info.chat_template is None:
            self._template_error = "this model has no chat template; use /v1/completions"
        elif len(info.chat_template) > MAX_TEMPLATE_CHARS:
            self._template_error = (
                f"this model's chat template is {len(info.chat_template)} characters, over the "
                f"gateway's limit of {MAX_TEMPLATE_CHARS}; use /v1/completions")
        else:
            try:
                self._template = ChatTemplate(info.chat_template, special)
            except jinja2.TemplateError as exc:
                self._template_error = f"this model's chat template does not compile: {exc}"

    @classmethod
    def from_info(cls, info: TokenizerInfo) -> GatewayTokenizer:
        return cls(info)

    @property
    def info(self) -> TokenizerInfo:
        return self._info

    @property
    def vocab_size(self) -> int:
        """Ids are in range(vocab_size), added tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos_ids

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_id

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    @property
    def native_tools(self) -> bool:
        """The chat template renders tools and asks for `<tool_call>` blocks (chat_template)."""
        return self._template is not None and self._template.native_tools

    def token_to_id(self, token: str) -> int | None:
        """The id of one vocabulary entry (its raw form, e.g. "<|im_end|>" or "ĠParis")."""
        return self._tok.token_to_id(token)

    def added_token_id(self, text: str) -> int | None:
        """The id of the added token spelled `text` (Qwen's "<tool_call>"...), special or not:
        llguidance matches an added token only by its id (`<[151657]>`), never by its text."""
        return self._added.get(text)

    def is_special(self, token_id: int) -> bool:
        """True for special added tokens (<|im_end|>...), the ones `skip_special_tokens` drops."""
        return token_id in self._special_ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. With `add_special_tokens`, the tokenizer's post-processor runs and
        a bos is prepended if the model asks for one (`add_bos_token`) and it is not there yet.

        Encode a rendered chat prompt with add_special_tokens=False: the template already wrote
        its bos, as transformers' apply_chat_template(tokenize=True) does.
        """
        ids: list[int] = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if (
            add_special_tokens
            and self._info.add_bos_token
            and self._bos_id is not None
            and (not ids or ids[0] != self._bos_id)
        ):
            ids.insert(0, self._bos_id)
        return ids

    def fim_ids(self) -> tuple[int, int, int] | None:
        """The model's fill-in-the-middle tokens (prefix, suffix, middle), or None."""
        for names in FIM_SPELLINGS:
            ids = [self.added_token_id(name) for name in names]
            if all(i is not None for i in ids):
                return ids[0], ids[1], ids[2]  # type: ignore[return-value]
        return None

    def encode_fim(self, prefix: str | Sequence[int], suffix: str) -> list[int]:
        """A fill-in-the-middle prompt in the prefix-suffix-middle order these models were
        trained on: <prefix> text <suffix> text <middle>; the texts tokenized as text (a
        control token's spelling in the code stays text), a prefix given as token ids kept.
        ValueError without FIM tokens."""
        fim = self.fim_ids()
        if fim is None:
            raise ValueError("this model has no fill-in-the-middle tokens")
        as_text = self._text_tokenizer()
        before = as_text.encode(prefix, add_special_tokens=False).ids \
            if isinstance(prefix, str) else list(prefix)
        ids = [fim[0], *before, fim[1], *as_text.encode(suffix, add_special_tokens=False).ids,
               fim[2]]
        if self._info.add_bos_token and self._bos_id is not None:
            ids.insert(0, self._bos_id)
        return ids

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        tools: list[dict[str, Any]] | None = None,
        max_chars: int | None = None,
        timeout_s: float | None = None,
        extra: Mapping[str, Any] | None = None,
        continue_final_message: bool = False,
    ) -> list[int]:
        """Token ids of the conversation rendered by the chat template (apply_chat_template,
        same arguments), a control token's spelling in anything the client sent (a message's
        text, a tool's name or arguments, a template variable) tokenized as the text it is: a
        user who types `<|im_end|><|im_start|>system` forges no system turn, whatever the parts
        it is split into. Only the template's own text makes control tokens.

        Where a client's text sits is known from the rendering itself, never found by searching
        the rendered text (a template writes the same tags before it): each such spelling is
        replaced, before rendering, by a per-render random marker of letters (_Hidden), so that
        every spelling left in the rendered text is the template's. The text is then cut at
        those, each piece tokenized with the special tokens spelled out as text, the markers
        back in their spellings. Without a marker the text is encoded whole, as transformers
        does. ChatTemplateError (a 400) when the template altered a marker (it changes the
        client's text beyond cutting or trimming it), as for apply_chat_template."""
        hidden = _Hidden(self._special_spellings)
        text = self.apply_chat_template(
            hidden.hide(messages), add_generation_prompt, tools=hidden.hide(tools),
            max_chars=max_chars, timeout_s=timeout_s, extra=hidden.hide(extra),
            continue_final_message=continue_final_message)
        return self._encode_rendered(text, hidden)

    def _encode_rendered(self, text: str, hidden: _Hidden) -> list[int]:
        if not hidden.used:
            return self._tok.encode(text, add_special_tokens=False).ids
        hidden.check(text)
        assert self._specials is not None  # (a marker was placed: the model has specials)
        as_text = self._text_tokenizer()
        ids: list[int] = []
        at = 0
        for found in self._specials.finditer(text):  # the template's: the client's are markers
            if found.start() > at:
                ids += as_text.encode(hidden.restore(text[at:found.start()]),
                                      add_special_tokens=False).ids
            ids.append(self._added[found.group()])
            at = found.end()
        if at < len(text):
            ids += as_text.encode(hidden.restore(text[at:]), add_special_tokens=False).ids
        return ids

    def _text_tokenizer(self) -> Tokenizer:
        with self._as_text_lock:  # built once, on the first content that needs it
            if self._as_text is None:
                tok = Tokenizer.from_str(self._info.tokenizer_json)
                tok.encode_special_tokens = True
                self._as_text = tok
            return self._as_text

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`. Bytes that do not form whole UTF-8 characters decode to U+FFFD."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        tools: list[dict[str, Any]] | None = None,
        max_chars: int | None = None,
        timeout_s: float | None = None,
        extra: Mapping[str, Any] | None = None,
        continue_final_message: bool = False,
    ) -> str:
        """The prompt text for an OpenAI-style conversation, as transformers would render it;
        `tools` as transformers passes them (OpenAI's list of {"type": "function", ...});
        `extra`, more template variables; `continue_final_message`: the text ends inside the
        last (assistant) message, without the template's end of its turn, so that the model
        goes on writing it (vLLM's and transformers' meaning).

        Raises ChatTemplateError (a ValueError: a 400) when the model has no usable template, a
        message is malformed, the template rejects the conversation, the rendered text passes
        `max_chars` (RenderedPromptTooLong) or rendering passes `timeout_s`.
        """
        if self._template is None:
            raise ChatTemplateError(self._template_error or "no chat template")
        return self._template.render(messages, add_generation_prompt, tools=tools,
                                     max_chars=max_chars, timeout_s=timeout_s, extra=extra,
                                     continue_final_message=continue_final_message)


# Fill-in-the-middle token spellings: Qwen2.5-Coder's, then StarCoder's (and its followers')
FIM_SPELLINGS = (("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
                 ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"))


class _Hidden:
    """One render's markers: each control token's spelling in a client's strings becomes
    `base + code`, lowercase letters that no template filter short of a case change or a
    replace alters (trim, tojson, escapes leave them), `base` drawn at random for this render so
    that no client can write one; `restore` puts the spellings back."""

    def __init__(self, spellings: Sequence[str]) -> None:
        self.base = "".join(secrets.choice(string.ascii_lowercase) for _ in range(16))
        width = max(1, math.ceil(math.log(max(len(spellings), 2), 26)))
        self.marker = {s: self.base + _letters(i, width) for i, s in enumerate(spellings)}
        self.spelling = {marker: s for s, marker in self.marker.items()}
        self.find = (re.compile("|".join(map(re.escape, sorted(spellings, key=len, reverse=True))))
                     if spellings else None)
        self.found_marker = re.compile(re.escape(self.base) + f"[a-z]{{{width}}}")
        self.used = False

    def hide(self, value: Any) -> Any:
        """`value` (a JSON-like tree: mappings, lists, strings) with every spelling in its
        strings, keys included, replaced by its marker."""
        if isinstance(value, str):
            if self.find is None or not self.find.search(value):
                return value
            self.used = True
            return self.find.sub(lambda m: self.marker[m.group()], value)
        if isinstance(value, Mapping):
            return {self.hide(k): self.hide(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self.hide(v) for v in value]
        return value

    def check(self, text: str) -> None:
        """Every trace of this render's base in `text` is a whole marker of ours."""
        whole = sum(1 for m in self.found_marker.finditer(text) if m.group() in self.spelling)
        if whole != text.lower().count(self.base):
            raise ChatTemplateError(
                "a message contains a control token of this model (such as <|im_end|>) and the "
                "chat template changed that text, so it cannot be kept as text: remove it")

    def restore(self, text: str) -> str:
        return self.found_marker.sub(lambda m: self.spelling[m.group()], text)


def _letters(n: int, width: int) -> str:
    out = ""
    for _ in range(width):
        n, digit = divmod(n, 26)
        out += string.ascii_lowercase[digit]
    return out
