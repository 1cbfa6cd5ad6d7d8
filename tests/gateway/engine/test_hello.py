"""Vetting a Hello: a tokenizer built lately is not built again for the next model or worker
that brings the same one (a worker restarting in a loop, a model whose worker comes back)."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest

from gateway.engine import hello as hello_module
from gateway.engine.hello import Built, Vetted, vet_hello
from gateway.engine.registry import Registry
from gateway.tokens.tokenizer import GatewayTokenizer
from protocol import codec
from protocol import messages as m
from tests.e2e.link_peers import tiny_hello


def test_the_same_tokenizer_is_built_once_for_several_models(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hello_module, "BUILT", Built())
    builds: list[m.TokenizerInfo] = []
    real = GatewayTokenizer.from_info

    def counted(info: m.TokenizerInfo) -> GatewayTokenizer:
        builds.append(info)
        return real(info)

    monkeypatch.setattr(GatewayTokenizer, "from_info", staticmethod(counted))
    first = tiny_hello(tiny_model_dir, model_id="a")
    no_template = dataclasses.replace(first.tokenizer, chat_template=None)

    async def vet(h: m.Hello) -> Vetted:
        got = await vet_hello(Registry(), codec.encode(h))
        assert isinstance(got, Vetted), got
        return got

    async def main() -> list[Vetted]:
        return [await vet(first), await vet(dataclasses.replace(first, model_id="b")),
                await vet(dataclasses.replace(first, model_id="c", tokenizer=no_template,
                                              tokenizer_digest=""))]

    a, b, c = asyncio.run(main())
    assert a.tokenizer is b.tokenizer  # built once
    assert c.tokenizer is not a.tokenizer and c.tokenizer is not None
    assert not c.tokenizer.has_chat_template and a.tokenizer is not None
    assert a.tokenizer.has_chat_template
    assert len(builds) == 2


def test_built_keeps_the_newest_few() -> None:
    built = Built(keep=2)
    tokenizers = [object() for _ in range(3)]
    for i, tok in enumerate(tokenizers):
        built.keep(str(i), tok)  # type: ignore[arg-type]
    assert built.get("0") is None and built.get("2") is tokenizers[2]
