"""Text and token ids, a model's own: its tokenizer (the `tokenizers` library) and its chat
template, rendered in jinja2's sandbox within bounds. Below the engine link, which builds one per
model from a worker's Hello, and everything that reads or writes a prompt."""
