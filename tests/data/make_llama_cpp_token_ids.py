"""Regenerate llama_cpp_token_ids.json: llama.cpp's own token ids for a corpus, per GGUF file.

    python tests/data/make_llama_cpp_token_ids.py LLAMA_TOKENIZE GGUF [GGUF ...]

LLAMA_TOKENIZE is llama.cpp's tools/tokenize binary (`cmake --build build --target
llama-tokenize`). Each corpus string goes to it on stdin, verbatim (--no-escape), without a BOS,
special tokens parsed as llama-server parses a prompt; the ids land under the GGUF's file name,
next to the ids already there for other files. tests/engine_worker/model/test_pretokenizer.py checks
that our tokenizer.json (save_gguf_tokenizer) gives the same ids.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

OUT = Path(__file__).with_name("llama_cpp_token_ids.json")

CORPUS = [
    "CONDITIONS\n\n  0. Definitions.",
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)"
    "\n\n\nprint([fib(i) for i in range(10)])\n",
    "\tfor (int i = 0; i < 1024; ++i) {\n\t\tsum += a[i] * b[i];\n\t}\n",
    "Pi is 3.14159265358979, e is 2.718; 1,000,000 and 2024-05-17T13:45:00Z",
    "0123456789012345678901234567890123456789 and 1234567 and 12 345 6789",
    "$1,234.56 + 7% = 99.9%; x^2 + y^2 = z^2; 0x1F 0b1010 1e-9",
    "I'm sure they'll say it's fine, don't you think? We've seen it. She'd've gone.",
    "IT'S DON'T WE'LL I'M THEY'RE YOU'VE HE'D; John's dog's bone; rock 'n' roll; 'quoted'",
    "Café naïve résumé façade Ångström Zürich São Paulo Dvořák",
    "Cafe\u0301 nai\u0308ve, e\u0301\u0301 combining marks; ภาษาไทย; क्षत्रिय",
    "你好，世界！这是一个测试。日本語のテキストとカタカナ ー 한국어 텍스트입니다",
    "Привет, мир! Γειά σου Κόσμε مرحبا بالعالم",
    "Emoji: 😀👍🏽🇺🇸 and ❤️ 👨\u200d👩\u200d👧 🚀🚀🚀",
    "multiple   internal    spaces  and trailing   ",
    "  leading spaces\n\n\n\nfour newlines\r\n\r\nCRLF\n \n \t \n mixed\n",
    " " * 20 + "x" + "\n" * 10 + "y" + "\t" * 5 + "z  \n  \n",
    "Wait... what?!?! --- (parens) [brackets] {braces} <<>> ::: ;;; ,,, ~~~ ***bold*** __init__",
    "@@ ## $$ %% ^^ && || \\\\ // `code` 'single' \"double\" end.\n\n\n(next)\n  - item\n\t* star",
    '{"key": [1, 2, 3], "nested": {"a": null, "b": true}}\n```python\nx = 1\n```\n',
    "https://example.com/path?q=1&r=two#frag user.name+tag@example.co.uk",
    "nbsp\u00a0here, thin\u2009space, ideographic\u3000space, zero\u200bwidth, nel\u0085line",
    "w048 7tuijk dsdfhu abc123def 3rd 21st 1st2nd3rd A1B2C3",
    "Roman Ⅻ, x² and ³, ½ ¾, ① ②, Arabic-Indic ٣٤٥, fullwidth １２３",
    "Hello, y'all! How are you 😁 ?我想在apple工作1314151天～",
    "'s 't 're 've 'm 'll 'd' ' ' 'hello' 'S 'T",
    "bell\x07 ctl\x01\x02 tab\tdel\x7f",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
]


def llama_ids(binary: Path, gguf: Path, text: str) -> list[int]:
    out = subprocess.run(
        [str(binary), "-m", str(gguf), "--stdin", "--no-escape", "--ids", "--no-bos",
         "--log-disable"],
        input=text.encode("utf-8"), capture_output=True, check=True)
    return json.loads(out.stdout.decode().strip().splitlines()[-1])


def main(argv: list[str]) -> int:
    binary, ggufs = Path(argv[0]), [Path(p) for p in argv[1:]]
    data = json.loads(OUT.read_text(encoding="utf-8")) if OUT.is_file() else {}
    ids = data.get("ids", {}) if data.get("corpus") == CORPUS else {}
    for gguf in ggufs:
        ids[gguf.name] = [llama_ids(binary, gguf, text) for text in CORPUS]
    rows = {name: ",\n".join(f"      {json.dumps(r, separators=(',', ':'))}" for r in per)
            for name, per in sorted(ids.items())}
    OUT.write_text(
        "{\n"
        f'  "about": {json.dumps(__doc__.splitlines()[0])},\n'
        '  "corpus": [\n' + ",\n".join(f"    {json.dumps(t)}" for t in CORPUS) + "\n  ],\n"
        '  "ids": {\n' + ",\n".join(f"    {json.dumps(n)}: [\n{r}\n    ]" for n, r in rows.items())
        + "\n  }\n}\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
