"""The gateway's HTTP floor, which imports nothing of the gateway above it: errors in OpenAI's
shape, bodies read with limits, the request schemas and their rules, SSE framing, and uvicorn's
missing timers."""
