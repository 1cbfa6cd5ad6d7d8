"""The sandbox a chat template runs in, with bounds on what one of its operations may build.

A chat template is code from the model's files (a worker's Hello). jinja's sandbox keeps it
away from Python's internals, and the render's trace function (gateway.tokens.chat_template) stops a
loop at its deadline, but one operation is one bytecode step: `10 ** 2500000` holds the GIL for
over a second, `'x' * 10**9` allocates a gigabyte, and jinja folds a constant `10 ** 12000000`
while it compiles the template, before any render has a deadline. So every operation that can
build something much larger than its operands is checked before it runs:

    operators    *  **  +  %  //     (intercepted: jinja then never folds them at compile time)
    `~`          the concatenation's parts, summed, before they are joined
    filters      center, indent, format, join, replace, wordwrap
    str methods  center, ljust, rjust, zfill, expandtabs, replace, join, format (and `%` specs)

A value past the bounds raises TemplateTooBig (a jinja SecurityError): the render fails, and the
request gets a 400 naming the operation. The bounds are far above what a real template builds
(a prompt of a whole context is a few megabytes of text; its arithmetic is on loop indexes).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sized
from typing import Any

import jinja2.compiler
import jinja2.filters
from jinja2 import nodes
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

MAX_CHARS = 1 << 23  # of one string or sequence a template builds (8 Mi)
MAX_INT_BITS = 1 << 16  # of one integer (about 19,700 decimal digits)
MAX_WIDTH = 10_000  # a width or precision in a format specification


class TemplateTooBig(SecurityError):
    """An operation of the template would have built a value past the sandbox's bounds."""


def _size(value: Any) -> int:
    return len(value) if isinstance(value, Sized) and not isinstance(value, dict) else 0


def _check_size(what: str, size: int) -> None:
    if size > MAX_CHARS:
        raise TemplateTooBig(f"the chat template's {what} would build a value of length "
                             f"{size:,}, over the sandbox's limit of {MAX_CHARS:,}")


def _check_bits(what: str, bits: int) -> None:
    if bits > MAX_INT_BITS:
        raise TemplateTooBig(f"the chat template's {what} would build an integer of about "
                             f"{bits:,} bits, over the sandbox's limit of {MAX_INT_BITS:,}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int)  # bool included: True * 'x' is 'x'


def _sequence(value: Any) -> bool:
    return isinstance(value, str | list | tuple | bytes)


_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")
_BRACE_SPEC = re.compile(r"\{[^{}]*:([^{}]*)\}|\{[^{}]*:[^}]*\{")


def _check_widths(what: str, numbers: list[str]) -> None:
    for number in numbers:
        if number == "*" or (number and int(number) > MAX_WIDTH):
            raise TemplateTooBig(f"the chat template's {what} asks for a width of {number}, "
                                 f"over the sandbox's limit of {MAX_WIDTH:,}")


def check_percent_format(fmt: str) -> None:
    """`fmt % args`: no width or precision given by an argument (`*`) or over MAX_WIDTH."""
    for match in _PERCENT_SPEC.finditer(fmt):
        _check_widths("% format", [g for g in match.groups() if g])


def check_brace_format(fmt: str) -> None:
    """`fmt.format(...)`: no nested field in a spec, no width or precision over MAX_WIDTH."""
    for match in _BRACE_SPEC.finditer(fmt):
        spec = match.group(1)
        if spec is None:
            raise TemplateTooBig("the chat template's str.format nests a field in a format "
                                 "specification, which the sandbox's limit on widths refuses")
        _check_widths("str.format", re.findall(r"\d+", spec))


def check_binop(op: str, left: Any, right: Any) -> None:
    """Raises TemplateTooBig where `left op right` would build a value past the bounds."""
    if op == "**" and _is_int(left) and _is_int(right) and right > 0 and abs(left) > 1:
        _check_bits("power", math.ceil(right * math.log2(abs(left))))
    elif op == "*":
        if _is_int(left) and _is_int(right):
            _check_bits("product", abs(left).bit_length() + abs(right).bit_length())
        elif _sequence(left) and _is_int(right):
            _check_size("repetition", _size(left) * max(right, 0))
        elif _sequence(right) and _is_int(left):
            _check_size("repetition", _size(right) * max(left, 0))
    elif op == "+" and _sequence(left) and _sequence(right):
        _check_size("concatenation", _size(left) + _size(right))
    elif op == "%" and isinstance(left, str):
        check_percent_format(left)


def bounded_concat(parts: tuple[Any, ...]) -> str:
    """`a ~ b ~ ...`: jinja's str_join, once the parts' lengths are known to fit."""
    texts = [str(part) for part in parts]
    _check_size("~ concatenation", sum(len(t) for t in texts))
    return "".join(texts)


class _CodeGenerator(jinja2.compiler.CodeGenerator):
    """jinja's code generator, with `~` joined by the environment's bounded_concat."""

    @jinja2.compiler.optimizeconst
    def visit_Concat(self, node: nodes.Concat, frame: jinja2.compiler.Frame) -> None:
        self.write("environment.bounded_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


def _replaced_size(text: Any, old: Any, new: Any, count: Any = -1) -> int:
    text, old, new = str(text), str(old), str(new)
    hits = text.count(old) if old else len(text) + 1
    if isinstance(count, int) and count >= 0:
        hits = min(hits, count)
    return len(text) + hits * (len(new) - len(old))


def _str_method_check(name: str, text: str, args: tuple[Any, ...],
                      kwargs: dict[str, Any]) -> None:
    first = args[0] if args else next(iter(kwargs.values()), None)
    if name in ("center", "ljust", "rjust", "zfill") and _is_int(first):
        _check_size(f"str.{name}", first)
    elif name == "expandtabs":
        tab = first if _is_int(first) else 8
        _check_size("str.expandtabs", len(text) + text.count("\t") * max(tab, 0))
    elif name == "replace" and len(args) >= 2:
        _check_size("str.replace", _replaced_size(text, *args[:3]))
    elif name == "join" and args and isinstance(args[0], list | tuple | str):
        items = args[0]
        _check_size("str.join", sum(len(str(i)) for i in items)
                    + len(text) * max(len(items) - 1, 0))


def _bounded_filter(name: str, check: Callable[..., None]) -> Callable[..., Any]:
    inner = jinja2.filters.FILTERS[name]

    def bounded(*args: Any, **kwargs: Any) -> Any:
        check(*args, **kwargs)
        return inner(*args, **kwargs)

    if hasattr(inner, "jinja_pass_arg"):  # a filter given the environment or context keeps it
        bounded.jinja_pass_arg = inner.jinja_pass_arg  # type: ignore[attr-defined]
    return bounded


def _center(value: Any, width: int = 80) -> None:
    if _is_int(width):
        _check_size("center filter", width)


def _indent(value: Any, width: Any = 4, *args: Any, **kwargs: Any) -> None:
    pad = width if _is_int(width) else len(str(width))
    _check_size("indent filter", len(str(value)) + (str(value).count("\n") + 1) * max(pad, 0))


def _format(value: Any, *args: Any, **kwargs: Any) -> None:
    check_percent_format(str(value))


def _join(*args: Any, **kwargs: Any) -> None:
    # (eval_ctx, value, d="", attribute=None)
    value = args[1] if len(args) > 1 else kwargs.get("value", ())
    sep = args[2] if len(args) > 2 else kwargs.get("d", "")
    items = list(value) if isinstance(value, list | tuple | str) else []
    _check_size("join filter", sum(len(str(i)) for i in items)
                + len(str(sep)) * max(len(items) - 1, 0))


def _replace(*args: Any, **kwargs: Any) -> None:
    # (eval_ctx, s, old, new, count=None)
    rest = list(args[1:]) + list(kwargs.values())
    if len(rest) >= 3:
        count = rest[3] if len(rest) > 3 and _is_int(rest[3]) else -1
        _check_size("replace filter", _replaced_size(rest[0], rest[1], rest[2], count))


def _wordwrap(*args: Any, **kwargs: Any) -> None:
    # (environment, s, width=79, break_long_words=True, wrapstring=None, ...)
    text = str(args[1]) if len(args) > 1 else ""
    wrap = kwargs.get("wrapstring") or (args[4] if len(args) > 4 else "\n")
    _check_size("wordwrap filter", len(text) * (1 + len(str(wrap or "\n"))))


_FILTER_CHECKS = {"center": _center, "indent": _indent, "format": _format, "join": _join,
                  "replace": _replace, "wordwrap": _wordwrap}


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """jinja's immutable sandbox, with the bounds above on what one operation may build."""

    code_generator_class = _CodeGenerator
    intercepted_binops = frozenset({"*", "**", "+", "%", "//"})

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        for name, check in _FILTER_CHECKS.items():
            self.filters[name] = _bounded_filter(name, check)
        self.bounded_concat = bounded_concat

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        check_binop(operator, left, right)
        return super().call_binop(context, operator, left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, str):
            _str_method_check(getattr(__obj, "__name__", ""), owner, args, kwargs)
        return super().call(__context, __obj, *args, **kwargs)

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        owner = getattr(value, "__self__", None)
        if isinstance(owner, str) and getattr(value, "__name__", "") in ("format", "format_map"):
            check_brace_format(owner)
        return super().wrap_str_format(value)
