"""The APIs the gateway speaks, each declared once in a record (record.py; the served ones in
served.py): OpenAI's own and the native API, and other APIs' dialects, each a thin translation
onto the one request path (its body into the gateway's request, its answer and errors back in its
own shapes): OpenAI's Responses API, Anthropic's Messages API and Ollama's API."""
