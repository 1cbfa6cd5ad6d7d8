"""The APIs this gateway speaks, each declared once, in one record (gateway.dialects.record): the
app mounts their routes from DIALECTS, each engine route's exchange reads its body and renders
its answer by its record, and /openapi.json documents them from the same records.

    OpenAI's own routes and the native API: bodies read as they are, OpenAI's formatters
    Responses, Anthropic's Messages, Ollama: another API's body parsed into the chat (or
        completion) request it asks for, the answer rendered back in that API's shapes
"""

from __future__ import annotations

from functools import partial

from gateway.dialects import anthropic, ollama, ollama_info, responses
from gateway.dialects.anthropic_reply import MessagesFormatter
from gateway.dialects.ollama_reply import OllamaFormatter, OllamaGenerateFormatter
from gateway.dialects.record import Dialect, Endpoint, SideRoute
from gateway.dialects.responses_reply import ResponsesFormatter
from gateway.http.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    GenerateRequest,
)
from gateway.output.formatters import (
    ChatFormatter,
    CompletionFormatter,
    EmbeddingFormatter,
    NativeFormatter,
)
from gateway.prompt.intake import Route

OPENAI = Dialect("openai", (
    Endpoint("/v1/completions", Route("completions", CompletionRequest), CompletionFormatter,
             "OpenAI text completion (stream: true for SSE)"),
    Endpoint("/v1/chat/completions", Route("chat", ChatCompletionRequest, default_max_tokens=None),
             ChatFormatter, "OpenAI chat completion (stream: true for SSE)"),
    Endpoint("/v1/embeddings", Route("embeddings", EmbeddingRequest, stream=False,
                                     generates=False), EmbeddingFormatter,
             "OpenAI embeddings: each input's pooled, normalised last hidden states"),
))

NATIVE = Dialect("native", (
    Endpoint("/v1/generate", Route("generate", GenerateRequest, stream=False), NativeFormatter,
             "native generation"),
    Endpoint("/v1/generate/stream", Route("generate_stream", GenerateRequest, stream=True),
             NativeFormatter, "native generation, streamed as SSE"),
))

RESPONSES = Dialect("responses", (
    Endpoint("/v1/responses", Route("responses", responses.ResponsesRequest,
                                    default_max_tokens=None, parse=responses.parse),
             ResponsesFormatter, "OpenAI's Responses API (stream: true for its SSE events); "
             "nothing is kept: previous_response_id is refused"),
))

ANTHROPIC = Dialect("anthropic", (
    Endpoint("/v1/messages", Route("messages", anthropic.MessagesRequest, default_max_tokens=None,
                                   parse=partial(anthropic.parse, anthropic.MessagesRequest)),
             MessagesFormatter, "Anthropic's Messages API (stream: true for its SSE events)"),
), error_schema=("AnthropicError", anthropic.ERROR_SCHEMA))

OLLAMA = Dialect("ollama", (
    Endpoint("/api/chat", Route("ollama_chat", ollama.OllamaChatRequest, default_max_tokens=None,
                                parse=ollama.parse_chat), OllamaFormatter,
             "Ollama's chat (streamed as JSON lines unless stream: false)"),
    Endpoint("/api/generate", Route("ollama_generate", ollama.OllamaGenerateRequest,
                                    default_max_tokens=None, parse=ollama.parse_generate),
             OllamaGenerateFormatter,
             "Ollama's generate (streamed as JSON lines unless stream: false)"),
), side_routes=(
    SideRoute("/api/tags", "GET", ollama_info.tags,
              "Ollama's list of the models this server can serve"),
    SideRoute("/api/ps", "GET", ollama_info.ps, "Ollama's list of the models loaded now"),
    SideRoute("/api/show", "POST", ollama_info.show, None),  # its body has no schema here
    SideRoute("/api/version", "GET", ollama_info.version,
              "the Ollama API version this server speaks"),
), error_schema=("OllamaError", ollama.ERROR_SCHEMA))

DIALECTS: tuple[Dialect, ...] = (OPENAI, NATIVE, RESPONSES, ANTHROPIC, OLLAMA)
