"""loadgen/workload.py and the length settings of loadgen/config.py."""

from __future__ import annotations

import json
import string
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models

from loadgen.config import LengthDist, LoadConfig, WorkloadConfig
from loadgen.workload import VOCABULARY, Workload, build_request, load_dataset


def words(text: str) -> int:
    return len(text.split())


def test_length_parsing() -> None:
    assert LengthDist.parse("128") == LengthDist.fixed(128)
    assert LengthDist.parse("fixed:64") == LengthDist.fixed(64)
    assert LengthDist.parse("uniform:8,32") == LengthDist.uniform(8, 32)
    assert LengthDist.parse("uniform:8:32") == LengthDist.uniform(8, 32)
    assert str(LengthDist.uniform(8, 32)) == "uniform:8,32"
    for bad in ("", "fixed:", "uniform:9", "uniform:5,2", "normal:3,4", "fixed:-1"):
        with pytest.raises(ValueError):
            LengthDist.parse(bad)


def test_fixed_lengths() -> None:
    wl = Workload(WorkloadConfig(LengthDist.fixed(40), LengthDist.fixed(7)), seed=0)
    for spec in wl.take(20):
        assert spec.prompt_len == 40 and words(spec.prompt) == 40
        assert spec.output_len == 7
        assert not spec.shared_prefix
        assert set(spec.prompt.split()) <= set(VOCABULARY)


def test_uniform_lengths_stay_in_bounds_and_reach_them() -> None:
    wl = Workload(WorkloadConfig(LengthDist.uniform(1, 12), LengthDist.uniform(3, 9)), seed=1)
    specs = wl.take(600)
    prompt_lens = {s.prompt_len for s in specs}
    output_lens = {s.output_len for s in specs}
    assert prompt_lens == set(range(1, 13))
    assert output_lens == set(range(3, 10))
    assert all(words(s.prompt) == s.prompt_len for s in specs)


def test_seed_fixes_the_prompts() -> None:
    cfg = WorkloadConfig(LengthDist.uniform(5, 50), LengthDist.uniform(1, 9))
    a = Workload(cfg, seed=3).take(30)
    assert a == Workload(cfg, seed=3).take(30)
    assert a != Workload(cfg, seed=4).take(30)
    # Prompts differ from one another, so no accidental prefix sharing between requests.
    assert len({tuple(s.prompt.split()[:4]) for s in a}) > 25


def test_jsonl_dataset(tmp_path: Path) -> None:
    path = tmp_path / "w.jsonl"
    rows = [{"prompt": "hello there general kenobi", "output_len": 5},
            {"prompt_len": 17, "output_len": 3},
            {"prompt_len": 4}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    wl = Workload(WorkloadConfig(output_len=LengthDist.fixed(11), dataset=path), seed=0)
    specs = wl.take(7)
    assert specs[0].prompt == "hello there general kenobi" and specs[0].prompt_len == 4
    assert specs[0].output_len == 5
    assert specs[1].prompt_len == 17 and words(specs[1].prompt) == 17 and specs[1].output_len == 3
    assert specs[2].prompt_len == 4 and specs[2].output_len == 11  # falls back to --output-len
    assert specs[3].prompt == specs[0].prompt  # cycled in order
    assert [s.index for s in specs] == list(range(7))


@pytest.mark.parametrize("line", ['{"output_len": 3}', '[1, 2]', 'not json',
                                  '{"prompt_len": 3, "output_len": 0}',
                                  '{"prompt_len": -1}', '{"prompt_len": true}'])
def test_jsonl_dataset_rejects_bad_lines(tmp_path: Path, line: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ValueError, match="bad.jsonl"):
        load_dataset(path)


@pytest.mark.parametrize("frac", [0.0, 0.1, 0.25, 0.5, 1.0])
def test_shared_prefix_fraction(frac: float) -> None:
    cfg = WorkloadConfig(LengthDist.fixed(8), LengthDist.fixed(4), shared_prefix_frac=frac,
                         shared_prefix_len=30)
    specs = Workload(cfg, seed=0).take(200)
    shared = [s for s in specs if s.shared_prefix]
    assert len(shared) == int(200 * frac)
    assert len({s.prefix for s in shared}) <= 1  # one prefix, the same text every time
    for s in shared:
        assert words(s.prefix or "") == 30 and s.prefix_len == 30
        _, body = build_request(s, "completions", "m")
        assert body["prompt"].startswith(s.prefix + " ") and words(body["prompt"]) == 38
        _, chat = build_request(s, "chat", "m")
        assert chat["messages"][0] == {"role": "system", "content": s.prefix}
    for s in specs:
        if not s.shared_prefix:
            assert len(build_request(s, "chat", "m")[1]["messages"]) == 1
    if 0 < frac < 1:  # spread through the run, not bunched at its start
        first_half = sum(s.shared_prefix for s in specs[:100])
        assert abs(first_half - 100 * frac) <= 1


def test_shared_prefix_settings_are_validated() -> None:
    with pytest.raises(ValueError):
        WorkloadConfig(shared_prefix_frac=0.5)  # no length
    with pytest.raises(ValueError):
        WorkloadConfig(shared_prefix_frac=1.5, shared_prefix_len=4)
    with pytest.raises(ValueError):
        WorkloadConfig(output_len=LengthDist.fixed(0))
    with pytest.raises(ValueError):
        LoadConfig(base_url="http://x/v1", num_requests=None)
    with pytest.raises(ValueError):
        LoadConfig(base_url="localhost:8000")


def test_build_request_forces_the_output_length() -> None:
    spec = Workload(WorkloadConfig(LengthDist.fixed(5), LengthDist.fixed(9)), seed=0).next_spec()
    path, body = build_request(spec, "completions", "m", extra_body={"temperature": 0})
    assert path == "/completions"
    assert body["max_tokens"] == 9 and body["ignore_eos"] is True and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["temperature"] == 0 and body["model"] == "m"
    path, body = build_request(spec, "chat", "m", ignore_eos=False)
    assert path == "/chat/completions" and "ignore_eos" not in body
    assert body["messages"] == [{"role": "user", "content": spec.prompt}]


def char_tokenizer(path: Path) -> Path:
    """A tokenizer with one token per character: words are several tokens each, so only exact
    counting gets the lengths right."""
    alphabet = string.ascii_lowercase + " "
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.save(str(path))
    return path


def test_tokenizer_json_gives_exact_lengths(tmp_path: Path) -> None:
    tj = char_tokenizer(tmp_path / "tok.json")
    tok = Tokenizer.from_file(str(tj))
    cfg = WorkloadConfig(LengthDist.uniform(1, 60), LengthDist.fixed(2), tokenizer_json=tj,
                         shared_prefix_frac=0.5, shared_prefix_len=25)
    specs = Workload(cfg, seed=0).take(40)
    for s in specs:
        assert len(tok.encode(s.prompt).ids) == s.prompt_len
        assert len(s.prompt) == s.prompt_len  # one character per token
    prefix = next(s.prefix for s in specs if s.prefix)
    assert prefix is not None and len(tok.encode(prefix).ids) == 25


def test_one_word_is_about_one_token_for_smollm2(smollm2_dir: Path) -> None:
    # The served checkpoint's tokenizer (a cache another test happened to leave skipped this
    # test on a fresh machine).
    smollm_tokenizer = smollm2_dir / "tokenizer.json"
    tok = Tokenizer.from_file(str(smollm_tokenizer))
    for word in VOCABULARY:
        assert len(tok.encode(" " + word, add_special_tokens=False).ids) == 1, word
    spec = Workload(WorkloadConfig(LengthDist.fixed(300)), seed=0).next_spec()
    n = len(tok.encode(spec.prompt, add_special_tokens=False).ids)
    assert abs(n - 300) <= 2
    exact = Workload(WorkloadConfig(LengthDist.fixed(300), tokenizer_json=smollm_tokenizer),
                     seed=0).next_spec()
    assert len(tok.encode(exact.prompt, add_special_tokens=False).ids) == 300
