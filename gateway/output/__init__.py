"""A generation becomes a response: the worker's frames, detokenized, stop strings, reasoning read
back, OpenAI's JSON shapes (tool calls read back by the request's plan: gateway.prompt.tools)."""
