"""Request bodies, as OpenAI's API types them (strict: "5" is not an integer).

Static bounds live on the fields; the limits that are settings (prompt characters, the max_tokens
cap) are checked by `check_limits` with the gateway's config. Unknown fields are ignored, as
OpenAI clients expect. Validation happens before anything is tokenized or queued.

An absent max_tokens (max_new_tokens) means the route's default (16 for completions and the
native API, as OpenAI's completions; 512 for chat), cut to the cap, the model's context and what
the model's workers were measured to finish before the request's deadline
(`Intake.sampling`): a request that asked for nothing is never a 422 nor a 504.
Integers that travel to the worker are bounded here to what msgpack carries (64 bits), so a huge
number is a 422, never an encoding error.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from gateway.output_schemas import (
    ResponseFormat,
    StructuredOutputs,
    Tool,
    ToolCall,
    ToolChoice,
)

MAX_N = 8
MAX_LOGPROBS = 5
INT64_MIN, UINT64_MAX = -(2**63), 2**64 - 1
TOKEN_ID = Annotated[int, Field(ge=0, lt=2**32)]  # the model's vocabulary is checked later
SEED = Annotated[int, Field(ge=INT64_MIN, le=UINT64_MAX)]  # the sampler masks it to 64 bits
TOP_K = Annotated[int, Field(ge=-1, lt=2**31)]


class RequestLimitError(ValueError):
    """A well-typed request outside a configured limit: answered 422 like a type error."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class RequestBase(_Strict):
    """What every generation route's body carries, and what those fields become for the engine:
    the model, stop strings, the prefix-cache salt, the deadline and the shared sampling fields.
    """

    model: str | None = None
    stop: str | list[str] | None = None
    # vLLM's extension: requests share cached prefixes only with the same salt (and key).
    cache_salt: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: TOP_K = -1  # extension; -1 or 0: off
    seed: SEED | None = None
    ignore_eos: bool = False  # extension
    speculative: bool = True  # extension: False opts this request out of speculative decoding
    timeout: Annotated[float, Field(gt=0.0)] | None = None  # extension: seconds, may only shorten

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        if any(s == "" for s in stops):
            raise ValueError("stop sequences must not be empty")
        return stop

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def requested_max_tokens(self) -> int | None:
        """The one max_tokens of this body, whatever the route spells it; None: not set."""
        return None

    @property
    def include_usage(self) -> bool:
        return False

    def sampling(self) -> dict[str, Any]:
        """The SamplingParams fields this body sets (max_tokens aside: the intake decides it)."""
        return dict(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                    seed=self.seed, ignore_eos=self.ignore_eos, speculative=self.speculative)


class _SamplingFields(RequestBase):
    """Fields shared by the OpenAI routes."""

    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    user: str | None = None
    # Declared so that it is refused (400), never silently ignored: the worker has no logit bias.
    logit_bias: dict[str, float] | None = None
    # Structured output (gateway/structured.py): OpenAI's response_format and vLLM's extensions.
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | bool | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def top_logprobs_asked(self) -> int | None:
        """How many alternatives per token to return; None: no logprobs."""
        return None

    def sampling(self) -> dict[str, Any]:
        return dict(super().sampling(), n=self.n, presence_penalty=self.presence_penalty,
                    frequency_penalty=self.frequency_penalty, logprobs=self.top_logprobs_asked())


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[TOKEN_ID]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def top_logprobs_asked(self) -> int | None:
        return self.logprobs


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a "tool" message: the call it answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    # Tools (gateway/tools.py): rendered into the prompt, calls parsed from the output.
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def top_logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class GenerateRequest(RequestBase):
    """The native API: POST /v1/generate and /v1/generate/stream."""

    prompt: str
    max_new_tokens: Annotated[int, Field(ge=1)] | None = None

    def requested_max_tokens(self) -> int | None:
        return self.max_new_tokens

    def sampling(self) -> dict[str, Any]:
        return dict(super().sampling(), n=1)


def check_limits(prompt_chars: int, max_tokens: int | None, *, max_prompt_chars: int,
                 max_tokens_cap: int) -> None:
    if prompt_chars == 0:
        raise RequestLimitError("the prompt is empty", "prompt")
    if prompt_chars > max_prompt_chars:
        raise RequestLimitError(
            f"the prompt has {prompt_chars} characters; the limit is {max_prompt_chars}", "prompt")
    if max_tokens is not None and max_tokens > max_tokens_cap:
        raise RequestLimitError(
            f"max_tokens is {max_tokens}; the limit is {max_tokens_cap}", "max_tokens")
