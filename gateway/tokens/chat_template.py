"""A model's chat template: compiled once, rendered bounded, and asked whether it renders tools.

    TokenizerInfo.chat_template ──ChatTemplate()──▶ compiled jinja2 template, native_tools probed
    messages (+ tools) ──render──▶ prompt text, piece by piece: over max_chars or past the
                                    deadline, a ChatTemplateError (a 400), never a hung thread

Rendered the way transformers renders it (`transformers.utils.chat_template_utils`): same
sandboxed environment, options, globals and variables, so the prompt text is byte-for-byte what
the model was trained and evaluated with. A compiled template renders reentrantly: one instance
serves all requests and threads.

`native_tools`: the template lays out a request's `tools` itself and asks for Hermes-style
`<tool_call>` blocks (Qwen2.5, Qwen3, Hermes 2 Pro...). It is probed once, by rendering one user
turn with and without a sample tool: the template must read `tools` (jinja2's AST), the sample's
name must appear only when it is given, and the text must mention `<tool_call>`, the format
gateway.prompt.tool_calls parses. A template that lists tools in some other format (Llama 3.1's bare
JSON, Mistral's [TOOL_CALLS]) is treated as having no tools branch: gateway.prompt.tools' own prompt
then serves it, in a format we can both ask for and parse.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.utils

from gateway.tokens.template_sandbox import BoundedSandbox

log = logging.getLogger("kestrel.gateway")
TOOL_CALL_TAG = "<tool_call>"
_PROBE_NAME = "kestrel_probe_function"
_PROBE_TOOLS = [{"type": "function", "function": {
    "name": _PROBE_NAME, "description": "Probe.",
    "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]
_PROBE_MESSAGES = [{"role": "user", "content": "Hello."}]


class ChatTemplateError(ValueError):
    """A conversation could not be rendered: no template, a bad message, or the template refused it.

    A ValueError, so that the gateway answers 400: the cause is the request (or a model that has no
    chat template), never the server.
    """


class RenderedPromptTooLong(ChatTemplateError):
    """The template rendered more text than the gateway accepts as one prompt."""


# A template that cannot render a small conversation in time is broken, whoever asks: each of
# its renders would burn a thread and, holding the GIL between trace checks, slow every other
# request, until its timeout. It is tried once when the model joins, on one short message, and
# a render of at most SMALL_CHARS (messages and tools) that runs out of time fences it too.
PROBE_TIMEOUT_S = 0.5
SMALL_CHARS = 8192


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


def _environment() -> BoundedSandbox:
    env = BoundedSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _TemplateNamespace
    return env


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


def _up_to_final(text: str, final: str) -> str:
    """The text rendered with FINAL_MARKER for the final message's text, cut where the marker
    starts and the text written there: whatever the template writes after it (its end of the
    turn) is gone, and no lookalike in the template's own text can be taken for it."""
    at = text.find(FINAL_MARKER)
    if at < 0:
        raise ChatTemplateError("continue_final_message: the template does not write the final "
                                "message's text as it is")
    return text[:at] + final.rstrip()


FINAL_MARKER = "kestrelfinalmessage7f3a9c"  # letters only: no template filter changes it
# What the server passes every template itself: a request's chat_template_kwargs may not set them
TEMPLATE_VARIABLES = ("messages", "tools", "documents", "add_generation_prompt", "bos_token",
                      "eos_token")


class ChatTemplate:
    """One model's compiled chat template. Raises jinja2.TemplateError if it does not compile."""

    def __init__(self, source: str, special: Mapping[str, str]) -> None:
        env = _environment()
        self._template = env.from_string(source)
        # Like transformers' special_tokens_map: a token the model lacks stays undefined.
        self._special = dict(special)
        self.broken: str | None = None  # why every render is refused, once it is known
        try:
            self.render(_PROBE_MESSAGES, max_chars=100_000, timeout_s=PROBE_TIMEOUT_S)
        except ChatTemplateError:
            pass  # a template may refuse a lone user message; only being late breaks it
        reads_tools = "tools" in jinja2.meta.find_undeclared_variables(env.parse(source))
        self.native_tools = not self.broken and reads_tools and self._probe_tools()

    def _probe_tools(self) -> bool:
        try:
            bare = self.render(_PROBE_MESSAGES, max_chars=100_000, timeout_s=2.0)
            rich = self.render(_PROBE_MESSAGES, tools=_PROBE_TOOLS, max_chars=100_000,
                               timeout_s=2.0)
        except ChatTemplateError:
            return False
        return _PROBE_NAME in rich and _PROBE_NAME not in bare and TOOL_CALL_TAG in rich

    def render(
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
        """The prompt text; ChatTemplateError (RenderedPromptTooLong past `max_chars`) else.
        `extra`: more variables for the template (a request's chat_template_kwargs, such as
        enable_thinking), never one of those the server sets. `continue_final_message`: the
        text ends with the last message's own text, the template's end of that turn cut."""
        if self.broken:
            raise ChatTemplateError(self.broken)
        if not messages:
            raise ChatTemplateError("a conversation needs at least one message")
        taken = sorted(set(extra or ()) & {*TEMPLATE_VARIABLES, *self._special})
        if taken:
            raise ChatTemplateError(f"chat_template_kwargs may not set {', '.join(taken)}")
        chat = [_message_for_template(m) for m in messages]
        final = str(chat[-1].get("content") or "")
        if continue_final_message:  # rendered with a marker where its text goes, cut there
            chat[-1] = {**chat[-1], "content": FINAL_MARKER}
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
                # None, not left undefined, when absent: templates test `tools is not none`,
                # which is true of an undefined name. Given, as transformers passes them: a
                # list of {"type": "function", "function": {...}}.
                tools=tools or None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self._special,
                **(extra or {}),
            ):
                pieces.append(piece)
                size += len(piece)
                if max_chars is not None and size > max_chars:
                    raise RenderedPromptTooLong(
                        f"the rendered prompt is over {max_chars} characters (the chat template "
                        "adds text around every message, including empty ones)")
            text = "".join(pieces)
            return _up_to_final(text, final) if continue_final_message else text
        except ChatTemplateError:
            raise
        except _TemplateLate:
            size = len(repr(chat)) + len(repr(tools or "")) + len(repr(extra or ""))
            if size <= SMALL_CHARS and timeout_s is not None and timeout_s >= PROBE_TIMEOUT_S:
                # not this conversation's size, nor a tight bound: the template itself
                self.broken = (f"this model's chat template took over {timeout_s} s on a "
                               f"conversation of {size} characters; its chats are refused "
                               "(use /v1/completions)")
                raise ChatTemplateError(self.broken) from None
            raise ChatTemplateError(f"rendering took over {timeout_s} s") from None
        except Exception as exc:  # noqa: BLE001 - a template is model-supplied code; any error
            # while rendering is the conversation not fitting it (a missing key, a wrong type).
            raise ChatTemplateError(f"chat template failed on this conversation: {exc}") from exc
        finally:
            sys.settrace(previous)
