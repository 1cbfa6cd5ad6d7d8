"""Request bodies, as OpenAI's API types them (strict: "5" is not an integer).

Static bounds live on the fields, so /openapi.json (built from these models) states them; where a
bound was once checked by hand, `refused_as` keeps that check's message. The limits that are
settings (prompt characters, the max_tokens cap) are checked by `check_limits` with the gateway's
config, and those that depend on the served models (their names, vocabulary, context) by the
intake; `server_bound` marks the fields they bound, and gateway.api.openapi writes the running
server's figure there. Unknown fields are ignored, as OpenAI clients expect. Validation happens
before anything is tokenized or queued.

An absent max_tokens (max_new_tokens) means the route's default (16 for completions and the
native API, as OpenAI's completions; 512 for chat), cut to the cap, the model's context and what
the model's workers were measured to finish before the request's deadline
(`Intake.sampling`): a request that asked for nothing is never a 422 nor a 504.
Integers that travel to the worker are bounded here to what msgpack carries (64 bits), so a huge
number is a 422, never an encoding error. An integer may be spelled 5.0, as JSON Schema's
"integer" allows (the document cannot say otherwise); 5.5 and "5" are still a 422.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from gateway.http.errors import LIMIT_ERROR
from gateway.http.output_schemas import (
    ResponseFormat,
    StructuredOutputs,
    Tool,
    ToolCall,
    ToolChoice,
)
from gateway.http.request_rules import CHAT_RULES, COMPLETION_RULES, TOKENIZE_RULES
from gateway.tokens.chat_template import TEMPLATE_VARIABLES

MAX_N = 8
MAX_LOGPROBS = 5
MAX_STOP = 4
INT64_MIN, UINT64_MAX = -(2**63), 2**64 - 1
SERVER_BOUND = "x-server-bound"  # marks a field's server_bound in the models' JSON schema
EMPTY_PROMPT = "the prompt is empty"


def server_bound(**bounds: str) -> dict[str, Any]:
    """A field's bound that only the running server knows: {JSON Schema keyword: the name of
    its figure}, which gateway.api.openapi.server_figures gives per request."""
    return {SERVER_BOUND: bounds}


def _whole(value: Any) -> Any:
    return int(value) if isinstance(value, float) and value.is_integer() else value


def refused_as(messages: dict[str, str], whole: bool = False) -> WrapValidator:
    """Pydantic's errors of these types (the field's declared bounds) answered with our own
    message, as the check had when it was made by hand; `whole`: without the "param: " prefix."""

    def check(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError as exc:
            kinds = [e["type"] for e in exc.errors()]
            if not all(kind in messages for kind in kinds):
                raise
            raise PydanticCustomError(LIMIT_ERROR if whole else "invalid_value",
                                      messages[kinds[0]]) from None

    return WrapValidator(check)


def _one_prompt(prompts: list[str]) -> list[str]:
    """After the items' types (["a", 1] is neither texts nor ids), so not pydantic's max_length."""
    if len(prompts) > 1:
        raise PydanticCustomError(LIMIT_ERROR, "batched prompts are not supported: send one prompt")
    return prompts


def _int(**bounds: Any) -> Any:
    """A bounded integer type, which may be spelled as a whole float (5.0)."""
    return Annotated[int, Field(**bounds), BeforeValidator(_whole)]


# The model's vocabulary is checked by the intake (400); the document says it where known.
TOKEN_ID = _int(ge=0, lt=2**32, json_schema_extra=server_bound(exclusiveMaximum="vocab_size"))
SEED = _int(ge=INT64_MIN, le=UINT64_MAX)  # the sampler masks it to 64 bits
TOP_K = _int(ge=-1, lt=2**31)
N_CHOICES = _int(ge=1, le=MAX_N)
MAX_LOGIT_BIAS = 1024  # entries of one request's logit_bias
MAX_STOP_TOKEN_IDS = 64
TOKEN_ID_TEXT = r"^(0|[1-9][0-9]{0,9})$"  # no leading zeros: "01" and "1" are one token
LOGIT_BIAS_KEY = Annotated[str, Field(pattern=TOKEN_ID_TEXT)]  # a token id, as OpenAI spells it
LOGPROBS = _int(ge=0, le=MAX_LOGPROBS)
MAX_TOKENS = _int(ge=1, json_schema_extra=server_bound(maximum="max_tokens"),
                 description="at most the server's cap; the prompt's tokens plus this must fit "
                 "the model's context (400 context_length_exceeded)")
PROMPT_TEXT = Annotated[str, Field(min_length=1, json_schema_extra=server_bound(
    maxLength="max_prompt_chars"))]
PROMPT_DOC = ("its tokens must leave room in the model's context for max_tokens "
              "(400 context_length_exceeded)")
STOP_TEXT = Annotated[str, Field(min_length=1)]
STOP_ERRORS = {"string_too_short": "stop sequences must not be empty",
               "too_long": f"at most {MAX_STOP} stop sequences"}
STOP = (Annotated[STOP_TEXT, refused_as(STOP_ERRORS)]
        | Annotated[list[STOP_TEXT], Field(max_length=MAX_STOP), refused_as(STOP_ERRORS)])


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

    # Absent or "": the first model served; the document lists the served names.
    model: Annotated[str | None, Field(json_schema_extra=server_bound(enum="model"))] = None
    stop: STOP | None = None
    # vLLM's extension: requests share cached prefixes only with the same salt (and key).
    cache_salt: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: TOP_K = -1  # extension; -1 or 0: off
    seed: SEED | None = None
    ignore_eos: bool = False  # extension
    speculative: bool = True  # extension: False opts this request out of speculative decoding
    timeout: Annotated[float, Field(gt=0.0, description=(
        "seconds from arrival to the last token, honoured in full up to the server's "
        "--max-timeout-s; absent: the server's --default-timeout-s (none by default). A deadline "
        "this request cannot meet on this server (its measured step costs, behind the work "
        "admitted before it) is refused at once: 400 deadline_unreachable, or 429 "
        "would_miss_deadline at the current load"))] | None = None  # extension

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

    n: N_CHOICES = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    user: str | None = None
    # vLLM's extensions: the matched stop string kept at the end of the text; special tokens
    # (<|im_end|>...) written out in the text rather than dropped.
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # OpenAI's token id -> bias (-100 bans, +100 forces); ids at or past the vocabulary: 400.
    logit_bias: Annotated[dict[LOGIT_BIAS_KEY, Annotated[float, Field(ge=-100.0, le=100.0)]],
                          Field(max_length=MAX_LOGIT_BIAS, json_schema_extra={
                              "additionalProperties": False, "propertyNames": {
                                  "pattern": TOKEN_ID_TEXT,
                                  **server_bound(pattern="token_id_pattern")}})] | None = None
    # vLLM's sampler extensions (engine_worker/sampler.py says how each applies).
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    repetition_penalty: Annotated[float, Field(ge=0.01, le=2.0)] = 1.0  # 1e-300: 0 in float32
    min_tokens: _int(ge=0, json_schema_extra=server_bound(maximum="max_tokens"), description=(
        "no EOS nor stop_token_ids before this many tokens; at most max_tokens (400)")) = 0
    stop_token_ids: Annotated[list[TOKEN_ID], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    # vLLM's: only the prompt's last k tokens are kept (-1: the model's context)
    truncate_prompt_tokens: _int(ge=1) | Literal[-1] | None = None
    # Structured output (gateway/prompt/structured.py): OpenAI's response_format and vLLM's
    # extensions.
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | bool | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str] | None, Field(json_schema_extra={"minItems": 1})] = None
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
                    frequency_penalty=self.frequency_penalty, logprobs=self.top_logprobs_asked(),
                    min_p=self.min_p, repetition_penalty=self.repetition_penalty,
                    min_tokens=self.min_tokens, stop_token_ids=list(self.stop_token_ids or []),
                    logit_bias=sorted((int(t), b) for t, b in (self.logit_bias or {}).items()))


class CompletionRequest(_SamplingFields):
    model_config = ConfigDict(json_schema_extra=COMPLETION_RULES)
    # Text, a batch of exactly one text, or token ids (a batch of several is not supported).
    prompt: Annotated[
        Annotated[PROMPT_TEXT, refused_as({"string_too_short": EMPTY_PROMPT}, whole=True)]
        | Annotated[list[PROMPT_TEXT], Field(min_length=1, json_schema_extra={"maxItems": 1}),
                    AfterValidator(_one_prompt), refused_as(
                        {"too_short": EMPTY_PROMPT, "string_too_short": EMPTY_PROMPT}, whole=True)]
        | Annotated[list[TOKEN_ID], Field(min_length=1, json_schema_extra=server_bound(
            maxItems="max_prompt_ids")), refused_as({"too_short": EMPTY_PROMPT}, whole=True)],
        Field(description=PROMPT_DOC)]
    max_tokens: MAX_TOKENS | None = None
    echo: bool = False
    logprobs: LOGPROBS | None = None
    suffix: Annotated[str, Field(json_schema_extra=server_bound(maxLength="max_prompt_chars"),
                                 description=(
        "fill in the middle: the text after the hole, the prompt the text before it; for "
        "models with FIM tokens (Qwen2.5-Coder's <|fim_prefix|>...), else 400; the prompt and "
        "the suffix together at most max_prompt_chars (422)"))] | None = None

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
    # An earlier answer's thinking, under either name, sent back as clients do: accepted, and
    # dropped from the prompt as vLLM and the reasoning models' own templates drop it.
    reasoning_content: str | None = Field(default=None, exclude=True)
    reasoning: str | None = Field(default=None, exclude=True)

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    model_config = ConfigDict(json_schema_extra=CHAT_RULES)
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: MAX_TOKENS | None = None
    max_completion_tokens: MAX_TOKENS | None = None
    logprobs: bool = False
    top_logprobs: LOGPROBS | None = None
    # vLLM's chat template controls: no assistant turn opened after the messages, the last
    # message continued (its end of turn cut), more variables for the template.
    add_generation_prompt: bool = True
    continue_final_message: Annotated[bool, Field(description=(
        "the last message is continued: needs add_generation_prompt false (400)"))] = False
    chat_template_kwargs: Annotated[dict[str, Any], Field(max_length=32, json_schema_extra={
        "propertyNames": {"not": {"enum": list(TEMPLATE_VARIABLES)}}})] | None = None
    # Tools (gateway/prompt/tools.py): rendered into the prompt, calls parsed from the output.
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def top_logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class GenerateRequest(RequestBase):
    """The native API: POST /v1/generate and /v1/generate/stream."""

    prompt: Annotated[PROMPT_TEXT, refused_as({"string_too_short": EMPTY_PROMPT}, whole=True),
                      Field(description=PROMPT_DOC)]
    max_new_tokens: MAX_TOKENS | None = None

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


class TokenizeRequest(RequestBase):
    """vLLM's /tokenize body: a prompt, or chat messages (rendered by the model's template)."""

    model_config = ConfigDict(json_schema_extra=TOKENIZE_RULES)
    prompt: PROMPT_TEXT | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: Annotated[bool | None, Field(description=(
        "a prompt: add the special tokens the model asks for (its bos), true by default; "
        "messages: ignored, the chat template writes its own"))] = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit of inputs in one request
EMBEDDING_TEXT = Annotated[str, Field(min_length=1, json_schema_extra=server_bound(
    maxLength="max_prompt_chars"))]
EMPTY_INPUT = "an input is empty"


class EmbeddingRequest(_Strict):
    """OpenAI's /v1/embeddings body: one input or a batch of them, each text or token ids."""

    model: Annotated[str | None, Field(json_schema_extra=server_bound(enum="model"))] = None
    input: Annotated[
        Annotated[EMBEDDING_TEXT, refused_as({"string_too_short": EMPTY_INPUT}, whole=True)]
        | Annotated[list[EMBEDDING_TEXT], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS),
                    refused_as({"too_short": EMPTY_INPUT, "string_too_short": EMPTY_INPUT},
                               whole=True)]
        | Annotated[list[TOKEN_ID], Field(min_length=1, json_schema_extra=server_bound(
            maxItems="max_prompt_ids")), refused_as({"too_short": EMPTY_INPUT}, whole=True)]
        | Annotated[list[Annotated[list[TOKEN_ID], Field(min_length=1, json_schema_extra=
                                                       server_bound(maxItems="max_prompt_ids"))]],
                    Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS),
                    refused_as({"too_short": EMPTY_INPUT}, whole=True)],
        Field(description="a text, token ids, or a batch of either; each input's tokens must fit "
              "the model's context (400 context_length_exceeded), the texts together at most "
              "max_prompt_chars (422)")]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: _int(ge=1, json_schema_extra=server_bound(enum="embedding_sizes"), description=(
        "the vector's size, which is the model's hidden size: any other is refused (400 "
        "unsupported_parameter), since these models' vectors cannot be shortened")) | None = None
    user: str | None = None
    timeout: Annotated[float, Field(gt=0.0, description=(
        "seconds from arrival to the answer, as the generation routes' timeout"))] | None = None

    def requested_max_tokens(self) -> int | None:
        return None

    def inputs(self) -> list[str] | list[list[int]]:
        """The inputs as a batch: texts, or token id lists."""
        x = self.input
        if isinstance(x, str):
            return [x]
        if x and isinstance(x[0], int):
            return [x]  # type: ignore[list-item]
        return x  # type: ignore[return-value]


class DetokenizeRequest(RequestBase):
    tokens: Annotated[list[TOKEN_ID], Field(max_length=1 << 20)]


class ModelRequest(_Strict):
    """POST /models/load and /models/unload (`kestrel serve --models-dir`): which model."""

    model: Annotated[str, Field(min_length=1, description=(
        "a model id of the models folder, as /v1/models lists it (any other: 404 "
        "model_not_found)"))]
