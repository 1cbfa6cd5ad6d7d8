"""A body becomes an engine request: the model, the prompt (tools in it), the tenant's prefix
cache, structured output's grammars, the tokens (through gateway.tokens)."""
