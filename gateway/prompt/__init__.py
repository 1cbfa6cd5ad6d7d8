"""A body becomes an engine request: the tokenizer, chat templates (sandboxed), tools in the prompt,
structured output's grammars."""
