"""A generation becomes a response: the worker's frames, detokenized, stop strings, tool calls and
reasoning read back, OpenAI's JSON shapes."""
