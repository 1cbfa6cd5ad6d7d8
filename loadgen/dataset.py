"""Datasets: a file of requests, as rows the Workload turns into RequestSpecs.

    JSONL (one object a line) or JSON (an array of objects) ──load_dataset──▶ rows, in file order

Three shapes of row, told apart by their keys (a file may mix them):
- ours: `prompt` (text) or `prompt_len` (a length for synthetic text), optional `output_len`;
- ShareGPT: `conversations: [{"from": "human"|"gpt"|"system", "value": text}, ...]`;
- OpenAI-style: `messages: [{"role": "user"|"assistant"|"system", "content": text}, ...]`.
A conversation becomes the turns up to its first user turn (any system turn before it included)
and, when the next turn is the assistant's, that reply as the reference answer, whose length in
tokens sets the request's output length unless the row has `output_len`. That is the rule of
`vllm bench serve`'s ShareGPT dataset (first turn and its reply), so the numbers compare. A
conversation without a user turn is skipped, as vLLM skips those under two turns.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "bard": "assistant", "bing": "assistant",
                  "model": "assistant", "system": "system"}


def _objects(path: Path) -> list[tuple[str, Any]]:
    """(where, object) for every row of a JSON array file or a JSONL file."""
    text = Path(path).read_text()
    if text.lstrip().startswith("["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not JSON: {exc}") from None
        return [(f"{path}[{i}]", row) for i, row in enumerate(data)]
    rows = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append((f"{path}:{lineno}", json.loads(line)))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{lineno}: not JSON: {exc}") from None
    return rows


def _text(content: Any) -> str:
    """A message's text: a string, or OpenAI's list of parts (text parts joined)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def _turns(row: dict[str, Any], where: str) -> list[dict[str, str]]:
    if "conversations" in row:
        turns = row["conversations"]
        if not isinstance(turns, list):
            raise ValueError(f"{where}: 'conversations' must be a list")
        out = []
        for t in turns:
            role = SHAREGPT_ROLES.get(str(t.get("from", "")).lower()) if isinstance(t, dict) \
                else None
            if role is None:
                raise ValueError(f"{where}: a ShareGPT turn needs 'from' (human, gpt, system) "
                                 "and 'value'")
            out.append({"role": role, "content": _text(t.get("value"))})
        return out
    turns = row["messages"]
    if not isinstance(turns, list) or not all(isinstance(t, dict) and "role" in t
                                              for t in turns):
        raise ValueError(f"{where}: 'messages' must be a list of {{role, content}} objects")
    return [{"role": str(t["role"]), "content": _text(t.get("content"))} for t in turns]


def _conversation(row: dict[str, Any], where: str) -> dict[str, Any] | None:
    turns = _turns(row, where)
    first_user = next((i for i, t in enumerate(turns) if t["role"] == "user"), None)
    if first_user is None:
        return None
    messages = turns[: first_user + 1]
    nxt = turns[first_user + 1] if first_user + 1 < len(turns) else None
    out: dict[str, Any] = {"messages": messages,
                           "prompt": "\n\n".join(m["content"] for m in messages)}
    if nxt is not None and nxt["role"] == "assistant" and nxt["content"]:
        out["answer"] = nxt["content"]
    if "output_len" in row:
        out["output_len"] = row["output_len"]
    return out


def load_dataset(path: Path) -> list[dict[str, Any]]:
    """Rows with `prompt` (text) or `prompt_len`, optional `output_len`, and for conversations
    `messages` (the turns sent to a chat API) and `answer` (the reference reply)."""
    rows: list[dict[str, Any]] = []
    for where, row in _objects(path):
        if not isinstance(row, dict):
            raise ValueError(f"{where}: expected an object")
        if "conversations" in row or "messages" in row:
            conv = _conversation(row, where)
            if conv is None:
                continue
            row = conv
        elif not isinstance(row.get("prompt"), str) and not _is_len(row.get("prompt_len")):
            raise ValueError(f"{where}: needs 'prompt' (text) or 'prompt_len' (int >= 0), "
                             "'conversations' (ShareGPT) or 'messages' (OpenAI)")
        out = row.get("output_len")
        if out is not None and not (_is_len(out) and out >= 1):
            raise ValueError(f"{where}: 'output_len' must be an int >= 1")
        rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no requests")
    return rows


def _is_len(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
