"""What a gateway needs to tokenize for a checkpoint, from plain json files (no torch).

    folder --tokenizer_info--> protocol TokenizerInfo (tokenizer.json, chat template, special
                               tokens, end-of-turn ids), sent in the worker's Hello
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine_worker.model.loader import read_json
from protocol.messages import TokenizerInfo


def _token_text(tok: Any) -> str | None:
    """A special token as saved: a string or an AddedToken dict {"content": ...}."""
    if isinstance(tok, dict):
        return tok.get("content")
    return tok if isinstance(tok, str) else None


def tokenizer_info(path: Path) -> TokenizerInfo:
    """What a gateway needs to tokenize for this checkpoint, from plain json files."""
    path = Path(path)
    tok_json_path = path / "tokenizer.json"
    if not tok_json_path.is_file():
        raise FileNotFoundError(f"no tokenizer.json in {path}")
    tok_json = tok_json_path.read_text(encoding="utf-8")
    tok_cfg = read_json(path / "tokenizer_config.json")
    special = read_json(path / "special_tokens_map.json")

    template: str | None = None
    if (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text(encoding="utf-8")
    elif isinstance(tok_cfg.get("chat_template"), str):
        template = tok_cfg["chat_template"]
    elif isinstance(tok_cfg.get("chat_template"), list):  # named templates: take "default"
        named = {t.get("name"): t.get("template") for t in tok_cfg["chat_template"]}
        template = named.get("default") or next(iter(named.values()), None)

    bos = _token_text(tok_cfg.get("bos_token")) or _token_text(special.get("bos_token"))
    eos = _token_text(tok_cfg.get("eos_token")) or _token_text(special.get("eos_token"))

    eos_ids: list[int] = []
    for src in (read_json(path / "generation_config.json"), read_json(path / "config.json")):
        e = src.get("eos_token_id")
        for i in [] if e is None else e if isinstance(e, list) else [e]:
            if int(i) not in eos_ids:
                eos_ids.append(int(i))
    if eos is not None:  # the tokenizer's own end token ends a turn too (chat models)
        added = {t["content"]: t["id"] for t in json.loads(tok_json).get("added_tokens", [])}
        if eos in added and added[eos] not in eos_ids:
            eos_ids.append(int(added[eos]))

    return TokenizerInfo(
        tokenizer_json=tok_json,
        chat_template=template,
        bos_token=bos,
        eos_token=eos,
        eos_token_ids=eos_ids,
        add_bos_token=bool(tok_cfg.get("add_bos_token", False)),
    )
