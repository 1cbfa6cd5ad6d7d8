"""The HTTP surface: the Starlette app, OpenAI's routes and request schemas, errors in OpenAI's
shape, bodies read with limits, SSE."""
