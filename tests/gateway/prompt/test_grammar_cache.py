"""gateway/prompt/grammar_cache.py: a schema compiles once, however many requests send it at
once."""

from __future__ import annotations

import asyncio

import pytest

from gateway.prompt.grammar_cache import GrammarCache, grammar_key


def test_concurrent_requests_for_one_schema_share_one_build_and_later_ones_hit() -> None:
    cache, builds = GrammarCache(), []

    async def build() -> str:
        builds.append(1)
        await asyncio.sleep(0.05)
        return "grammar"

    async def main() -> None:
        schema = {"type": "object", "properties": {"a": {"type": "string"}}}
        same = {"properties": {"a": {"type": "string"}}, "type": "object"}  # key order differs
        got = await asyncio.gather(*(cache.get("json", schema, build) for _ in range(5)))
        assert got == ["grammar"] * 5 and len(builds) == 1
        assert await cache.get("json", same, build) == "grammar" and len(builds) == 1
        assert await cache.get("regex", "a+", build) == "grammar" and len(builds) == 2

    asyncio.run(main())


def test_a_failed_build_reaches_every_waiter_and_is_not_kept() -> None:
    cache, calls = GrammarCache(), []

    async def bad() -> str:
        calls.append(1)
        await asyncio.sleep(0.02)
        raise ValueError("does not compile")

    async def main() -> None:
        results = await asyncio.gather(*(cache.get("json", {"x": 1}, bad) for _ in range(3)),
                                       return_exceptions=True)
        assert all(isinstance(r, ValueError) for r in results) and len(calls) == 1
        with pytest.raises(ValueError):
            await cache.get("json", {"x": 1}, bad)
        assert len(calls) == 2  # tried again, not served a stale failure

    asyncio.run(main())


def test_least_recently_used_go_first_and_huge_grammars_are_not_kept() -> None:
    cache = GrammarCache(entries=2, max_chars=10)

    async def main() -> None:
        for name in ("a", "b", "c"):
            async def build(name: str = name) -> str:
                return name
            await cache.get("regex", name, build)

        async def huge() -> str:
            return "x" * 11
        await cache.get("regex", "huge", huge)

    asyncio.run(main())
    kept = set(cache._done)
    assert kept == {grammar_key("regex", "b"), grammar_key("regex", "c")}
