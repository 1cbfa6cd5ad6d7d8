"""The pre-tokenizer a GGUF's byte-level BPE vocabulary declares, as `tokenizers` JSON.

A GGUF carries a vocabulary and its merges, but of the rule that cuts text into words before the
merges run it carries only a name, `tokenizer.ggml.pre` ("smollm", "qwen2", "llama-bpe", ...).
llama.cpp maps each name to a list of regexes (src/llama-vocab.cpp, `llm_tokenizer_bpe`).
transformers' GGUF converter knows some of the names and gives the others GPT-2's rule: for
SmolLM2 ("smollm": every digit a word of its own) it cut "CONDITIONS\\n\\n  0." into `ĊĊĠ`,
`Ġ`, `0` where llama.cpp and SmolLM2's own tokenizer.json give `ĊĊĠĠ`, `0`. Here each name
becomes the pre-tokenizer the model's own tokenizer.json has:

    GGUF --gguf_string("tokenizer.ggml.pre")--> "smollm" --_NAMES--> rule (steps, ignore_merges)
    tokenizer.json from transformers --apply_pre_tokenizer(tok_json, "smollm")--> the same with
        pre_tokenizer = Sequence[Digits, ByteLevel(GPT-2 regex)] (and model.ignore_merges)
    loader.save_gguf_tokenizer --rewrite_tokenizer_json(gguf, folder)--> folder/tokenizer.json

Each of llama.cpp's regexes is one `Split(behavior="Isolated")` (llama.cpp keeps both the matches
and the text between them as words, then cuts each word again with the next regex), followed by
`ByteLevel(use_regex=False)`. Where the model's own tokenizer.json spells a rule differently
(GPT-2's and StarCoder's family keep the GPT-2 regex inside ByteLevel, StarCoder's digits are a
`Digits` step) we write its spelling: the same words, and the same file a reader expects.

An unknown name is refused with a ValueError naming it: llama.cpp refuses it too ("unknown
pre-tokenizer type"), and a guessed rule tokenizes wrong without a sign (merges learned on one
cut, applied to another). A file without the key gets llama.cpp's fallback, "default", with a
warning, as llama.cpp does. Only byte-level BPE vocabularies (`tokenizer.ggml.model` "gpt2") have
a pre-tokenizer in llama.cpp; sentencepiece and unigram files are left as transformers wrote them.
No normalizer is added: llama.cpp runs none on a BPE vocabulary (Qwen2's own tokenizer.json has
NFC; the two differ only on text that is not NFC already, and we follow the GGUF's runtime).
"""

from __future__ import annotations

import copy
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine_worker.model.gguf_header import gguf_string

log = logging.getLogger("kestrel.tokenizer")

# The models' own tokenizer.json spellings (case-insensitive contractions as `(?i:...)`; llama.cpp
# spells them `'[sS]|...` because std::regex lacks inline flags: the same words).
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
         r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3 = QWEN2.replace(r"|\p{N}|", r"|\p{N}{1,3}|")  # digits in runs of up to three
QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
          r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# llama.cpp's rule for "default" and for a file that names none (not GPT-2's: four cuts in turn).
DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")


def _split(regex: str) -> dict[str, Any]:
    return {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}


def _byte_level(gpt2_regex: bool) -> dict[str, Any]:
    return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
            "use_regex": gpt2_regex}


@dataclass(frozen=True)
class Rule:
    """How one family cuts text: `steps` (pre_tokenizer JSON) run in order, then ByteLevel (with
    GPT-2's regex inside it when `gpt2_regex`); `ignore_merges`: a word that is a whole vocabulary
    entry is taken as is before any merge (llama.cpp's flag, Llama 3's tokenizer.json has it)."""

    steps: tuple[dict[str, Any], ...]
    gpt2_regex: bool = False
    ignore_merges: bool = False

    def pre_tokenizer(self) -> dict[str, Any]:
        if not self.steps:
            return _byte_level(self.gpt2_regex)
        return {"type": "Sequence",
                "pretokenizers": [*self.steps, _byte_level(self.gpt2_regex)]}


_GPT2_RULE = Rule((), gpt2_regex=True)
_STARCODER = Rule(({"type": "Digits", "individual_digits": True},), gpt2_regex=True)
_QWEN2 = Rule((_split(QWEN2),))
_LLAMA3 = Rule((_split(LLAMA3),), ignore_merges=True)

# tokenizer.ggml.pre -> rule, for the names llama.cpp gives the same regexes (llama-vocab.cpp).
_NAMES: dict[str, Rule] = {
    **dict.fromkeys(("gpt-2", "phi-2", "mpt", "olmo", "jais", "exaone4", "gigachat", "a.x-4.0",
                     "mellum", "trillion", "granite-docling"), _GPT2_RULE),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone",
                     "minerva-7b", "mellum2"), _STARCODER),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2",
                     "hunyuan", "solar-open"), _QWEN2),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                     "midm-2.0", "lfm2", "jina-v5-nano"), _LLAMA3),
    **dict.fromkeys(("dbrx", "smaug-bpe"), Rule((_split(LLAMA3),))),  # Llama 3's cut, all merges
    "qwen35": Rule((_split(QWEN35),)),
    "default": Rule(tuple(_split(r) for r in DEFAULT)),
}
KNOWN = frozenset(_NAMES)


def rule_for(pre: str) -> Rule:
    """The rule `tokenizer.ggml.pre` names; ValueError for a name we have no rule for."""
    try:
        return _NAMES[pre]
    except KeyError:
        raise ValueError(
            f"unknown GGUF pre-tokenizer type {pre!r} (tokenizer.ggml.pre): tokenizing with a "
            f"guessed rule would give other tokens than the model was trained on; known: "
            f"{', '.join(sorted(KNOWN))} (engine_worker/model/pretokenizer.py)") from None


def apply_pre_tokenizer(tok_json: dict[str, Any], pre: str) -> dict[str, Any]:
    """A copy of a byte-level BPE tokenizer.json with the pre-tokenizer `pre` names."""
    rule = rule_for(pre)
    if tok_json.get("model", {}).get("type") != "BPE":
        raise ValueError(f"pre-tokenizer {pre!r} is for a BPE vocabulary, this tokenizer.json "
                         f"has a {tok_json.get('model', {}).get('type')!r} model")
    out = copy.copy(tok_json)  # shallow: only the two entries below change
    out["pre_tokenizer"] = rule.pre_tokenizer()
    out["model"] = {**tok_json["model"], "ignore_merges": rule.ignore_merges}
    return out


def rewrite_tokenizer_json(gguf: Path, folder: Path) -> str | None:
    """Give folder/tokenizer.json (transformers' conversion of `gguf`) the pre-tokenizer the file
    declares. Returns the name applied, or None for a vocabulary that is not byte-level BPE."""
    if gguf_string(gguf, "tokenizer.ggml.model") != "gpt2":
        return None
    pre = gguf_string(gguf, "tokenizer.ggml.pre")
    if pre is None:
        log.warning("%s names no pre-tokenizer (tokenizer.ggml.pre); using llama.cpp's fallback "
                    "'default', as llama.cpp does: tokens may differ from the model's own", gguf)
        pre = "default"
    path = Path(folder) / "tokenizer.json"
    tok_json = apply_pre_tokenizer(json.loads(path.read_text(encoding="utf-8")), pre)
    path.write_text(json.dumps(tok_json, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
    return pre
