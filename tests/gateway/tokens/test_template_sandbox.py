"""Issue 42: a chat template's arithmetic is bounded before it runs
(gateway/tokens/template_sandbox.py).

One jinja operation is one bytecode step: `10 ** 2500000` held the GIL for 1.2 s inside a
render (its 2 s timeout never fired), `'x' * n` allocated 879 MB, and jinja folded a constant
`10 ** 12000000` while compiling a Hello's template, freezing the gateway for 26 s. Each such
operation is now refused at once, with the operation named; ordinary templates render as before.
"""

from __future__ import annotations

import time
import tracemalloc

import pytest

from gateway.tokens.chat_template import ChatTemplate, ChatTemplateError
from gateway.tokens.template_sandbox import MAX_CHARS, MAX_INT_BITS, MAX_WIDTH

BOOM = [{"role": "user", "content": "boom"}]  # 4 characters: the templates scale by it

HOSTILE = {
    "a constant power, folded at compile time before": ("{{ 10 ** 12000000 }}", "power"),
    "a power a message scales": (
        "{% set n = messages[0].content|length %}{{ 10 ** (n * 625000) }}", "power"),
    "an integer product": ("{% set x = 7 ** 20000 %}{{ x * x }}", "product"),
    "a string repetition": ("{{ 'x' * (messages[0].content|length * 250000000) }}",
                            "repetition"),
    "a list repetition": ("{{ ([1] * 100000000)|length }}", "repetition"),
    "a doubling by ~": ("{% set ns = namespace(x='ab') %}{% for i in range(40) %}"
                        "{% set ns.x = ns.x ~ ns.x %}{% endfor %}{{ ns.x|length }}",
                        "~ concatenation"),
    "a doubling by +": ("{% set ns = namespace(x='ab') %}{% for i in range(40) %}"
                        "{% set ns.x = ns.x + ns.x %}{% endfor %}{{ ns.x|length }}",
                        "concatenation"),
    "a % width": ("{{ '%0999999999d' % 1 }}", "% format"),
    "a % width from an argument": ("{{ '%*d' % (999999999, 1) }}", "% format"),
    "the format filter's width": ("{{ '%999999999s'|format('a') }}", "% format"),
    "the center filter": ("{{ 'a'|center(999999999) }}", "center filter"),
    "str.center": ("{{ 'a'.center(999999999) }}", "str.center"),
    "str.format's width": ("{{ '{:>999999999}'.format('a') }}", "str.format"),
    "str.format's nested width": ("{{ '{:>{w}}'.format('a', w=999999999) }}", "str.format"),
    "the replace filter": ("{% set s = 'a' * 100000 %}{{ s|replace('a', s)|length }}",
                           "replace filter"),
    "str.replace": ("{% set s = 'a' * 100000 %}{{ s.replace('a', s)|length }}", "str.replace"),
    "the join filter": ("{% set s = 'a' * 100000 %}{{ s|join(s)|length }}", "join filter"),
    "the indent filter": ("{{ ('a\\n' * 100000)|indent(100000)|length }}", "indent filter"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_an_operation_past_the_bounds_is_refused_at_once_without_the_memory(name: str) -> None:
    source, operation = HOSTILE[name]
    tracemalloc.start()
    start = time.monotonic()
    try:
        template = ChatTemplate(source, {})  # compiling folds nothing big
        with pytest.raises(ChatTemplateError, match=f"chat template's {operation} ") as err:
            template.render(BOOM, timeout_s=2.0)
        took = time.monotonic() - start
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "sandbox's limit" in str(err.value)
    assert took < 0.5, took  # refused before it ran, not stopped by the render's timeout
    assert peak < 64 << 20, peak  # (the largest doubling allowed is 8 Mi characters)
    assert template.broken is None  # the template stays usable for conversations it fits


def test_values_at_the_bounds_still_render() -> None:
    source = ("{{ (2 ** (MAXBITS - 1)).bit_length() }} {{ ('x' * MAXCHARS)|length }} "
              "{{ '%WIDTHd'|format(1)|length }} {{ ('{:>WIDTH}'.format('a'))|length }}")
    source = (source.replace("MAXBITS", str(MAX_INT_BITS)).replace("MAXCHARS", str(MAX_CHARS))
              .replace("WIDTH", str(MAX_WIDTH)))
    text = ChatTemplate(source, {}).render(BOOM, timeout_s=5.0)
    assert text.split() == [str(MAX_INT_BITS), str(MAX_CHARS), str(MAX_WIDTH), str(MAX_WIDTH)]


def test_ordinary_arithmetic_and_strings_render_as_jinja_renders_them() -> None:
    source = ("{% for m in messages %}{{ m.role ~ ': ' ~ m.content }}{% endfor %}|"
              "{{ 2 ** 10 }}|{{ 'ab' * 3 }}|{{ 3 * 'c' }}|{{ '%5d'|format(3) }}|{{ 7 // 2 }}|"
              "{{ -7 // 2 }}|{{ '%s-%s' % (1, 2) }}|{{ [1, 2] + [3] }}|{{ 2 ** -1 }}|"
              "{{ 10 % 4 }}|{{ '{:>4}'.format('a') }}|{{ 'a b'|replace(' ', '_') }}|"
              "{{ ['x', 'y']|join(', ') }}|{{ 'ab'|center(6) }}|{{ 1.5 * 2 }}")
    text = ChatTemplate(source, {}).render(BOOM, timeout_s=2.0)
    assert text == ("user: boom|1024|ababab|ccc|    3|3|-4|1-2|[1, 2, 3]|0.5|2|   a|a_b|x, y|"
                    "  ab  |3.0")
