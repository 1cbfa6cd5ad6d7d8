"""The gateway's tokenizer: text <-> token ids, and chat templates. No torch, no transformers.

Data flow: a worker's Hello carries a `protocol.messages.TokenizerInfo` (the `tokenizers` JSON, the
chat template, the special tokens). `GatewayTokenizer.from_info` builds one tokenizer per model from
it, once. For each request the gateway then

    chat messages --apply_chat_template--> prompt text --encode--> prompt ids  --> worker
    worker --> generated ids --(gateway.detokenize.IncrementalDetokenizer, via decode)--> text

Everything here is read-only after construction, so one instance is shared by all requests and
threads: the Rust `tokenizers.Tokenizer` is safe to call concurrently as long as nobody changes its
truncation/padding settings (we never do), and a compiled jinja2 template renders reentrantly.
Encoding a long prompt is CPU work; callers run it in a worker thread, off the event loop.

The chat template is rendered the way transformers renders it (`transformers.utils.
chat_template_utils`): same sandboxed environment, options, globals and variables, so the prompt
text is byte-for-byte what the model was trained and evaluated with.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from protocol.messages import TokenizerInfo


class ChatTemplateError(ValueError):
    """A conversation could not be rendered: no template, a bad message, or the template refused it.

    A ValueError, so that the gateway answers 400: the cause is the request (or a model that has no
    chat template), never the server.
    """


class RenderedPromptTooLong(ChatTemplateError):
    """The template rendered more text than the gateway accepts as one prompt."""


def _raise_exception(message: str) -> NoReturn:
    # Templates call this to reject a conversation ("roles must alternate"...): a client error.
    raise ChatTemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers replaces jinja's own `tojson`, which HTML-escapes "<", ">", "&" and "'": a prompt
    # must carry tool schemas verbatim.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja's `namespace`, refusing underscore names as transformers' does (sandbox hardening)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - jinja's own signature trick
        self, rest = args[0], args[1:]
        for name in dict(*rest, **kwargs):
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, *rest, **kwargs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


class _TemplateLate(Exception):
    """Raised inside a template's own code when its render passes its deadline."""


def _stop_template_at(deadline: float) -> Any:
    """A trace function for the rendering thread that follows only the template's compiled
    code ("<template>") and raises _TemplateLate in it once `deadline` has passed: a loop that
    writes nothing (`{% for i in range(n) %}{% for j in range(n) %}{% endfor %}...`) is stopped
    too, where a check between written pieces never runs. The clock is read every 256 lines."""
    lines = 0

    def in_template(frame: Any, event: str, arg: Any) -> Any:
        nonlocal lines
        if event == "line":
            lines += 1
            if not lines & 255 and time.monotonic() > deadline:
                raise _TemplateLate
        return in_template

    def on_call(frame: Any, event: str, arg: Any) -> Any:
        return in_template if frame.f_code.co_filename == "<template>" else None

    return on_call


def _compile_chat_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(source)


def _message_for_template(message: Mapping[str, Any]) -> dict[str, Any]:
    """A plain-dict copy of one message that a text-only template can read.

    Keys whose value is None are dropped, as transformers does (an assistant message with tool
    calls has `content: null`). A list of OpenAI content parts becomes one string: the text parts
    joined with "\\n" (vLLM's choice, so that separate parts do not run together); any other part
    (an image...) is refused, since these models read text only.
    """
    if not isinstance(message, Mapping):
        raise ChatTemplateError(f"a chat message must be an object, got {type(message).__name__}")
    out = {key: value for key, value in message.items() if value is not None}
    content = out.get("content")
    if isinstance(content, list):
        texts: list[str] = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise ChatTemplateError(f"unsupported content part {kind!r}: only text parts")
            text = part.get("text")
            if not isinstance(text, str):
                raise ChatTemplateError("a text content part needs a string 'text'")
            texts.append(text)
        out["content"] = "\n".join(texts)
    return out


class GatewayTokenizer:
    """One model's tokenizer, built once from the TokenizerInfo its workers announce."""

    def __init__(self, info: TokenizerInfo) -> None:
        self._info = info
        self._tok = Tokenizer.from_str(info.tokenizer_json)
        added = self._tok.get_added_tokens_decoder()
        # Invariant: fixed at construction; sets are frozen so sharing across threads is safe.
        self._special_ids: frozenset[int] = frozenset(i for i, t in added.items() if t.special)
        self._bos_id: int | None = (
            self._tok.token_to_id(info.bos_token) if info.bos_token is not None else None
        )
        eos_ids = list(info.eos_token_ids)
        if not eos_ids and info.eos_token is not None:
            eos_id = self._tok.token_to_id(info.eos_token)
            eos_ids = [eos_id] if eos_id is not None else []
        self._eos_ids: tuple[int, ...] = tuple(eos_ids)
        # Compiled once; a template that does not compile only breaks chat requests, not the model.
        self._template: jinja2.Template | None = None
        self._template_error: str | None = None
        if info.chat_template is None:
            self._template_error = "this model has no chat template; use /v1/completions"
        else:
            try:
                self._template = _compile_chat_template(info.chat_template)
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

    def token_to_id(self, token: str) -> int | None:
        """The id of one vocabulary entry (its raw form, e.g. "<|im_end|>" or "ĠParis")."""
        return self._tok.token_to_id(token)

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

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`. Bytes that do not form whole UTF-8 characters decode to U+FFFD."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        max_chars: int | None = None,
        timeout_s: float | None = None,
    ) -> str:
        """The prompt text for an OpenAI-style conversation, as transformers would render it.

        Raises ChatTemplateError (a ValueError: a 400) when the model has no usable template, a
        message is malformed, the template rejects the conversation, the rendered text passes
        `max_chars` (RenderedPromptTooLong) or rendering passes `timeout_s`.
        """
        if self._template is None:
            raise ChatTemplateError(self._template_error or "no chat template")
        if not messages:
            raise ChatTemplateError("a conversation needs at least one message")
        chat = [_message_for_template(m) for m in messages]
        # Like transformers' special_tokens_map: a token the model lacks stays undefined.
        special = {
            name: value
            for name, value in (
                ("bos_token", self._info.bos_token),
                ("eos_token", self._info.eos_token),
            )
            if value is not None
        }
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        previous = sys.gettrace()
        if deadline is not None:
            sys.settrace(_stop_template_at(deadline))  # this thread only
        try:
            # Rendered piece by piece, so that a template that writes far more than the messages
            # say (scaffolding around thousands of empty messages) is stopped as it goes, not
            # after; one that loops without writing is stopped by the trace at its deadline.
            pieces: list[str] = []
            size = 0
            # jinja2's TemplateStream: the template's text piece by piece (text rendering only;
            # no model runs in the gateway).
            for piece in self._template.stream(
                messages=chat,
                # Passed as None, not left undefined: templates test `tools is not none`, which
                # is true of an undefined name.
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **special,
            ):
                pieces.append(piece)
                size += len(piece)
                if max_chars is not None and size > max_chars:
                    raise RenderedPromptTooLong(
                        f"the rendered prompt is over {max_chars} characters (the chat template "
                        "adds text around every message, including empty ones)")
            return "".join(pieces)
        except ChatTemplateError:
            raise
        except _TemplateLate:
            raise ChatTemplateError(f"rendering took over {timeout_s} s") from None
        except Exception as exc:  # noqa: BLE001 - a template is model-supplied code; any error
            # while rendering is the conversation not fitting it (a missing key, a wrong type).
            raise ChatTemplateError(f"chat template failed on this conversation: {exc}") from exc
        finally:
            sys.settrace(previous)
