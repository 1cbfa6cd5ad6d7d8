"""Other APIs' dialects, each a thin translation onto the one request path: its body into the
gateway's request (gateway.prompt.intake's ROUTES), its answer and errors back in its own shapes
(gateway.api.exchange's FORMATTERS): OpenAI's Responses API, Anthropic's Messages API and Ollama's
API."""
