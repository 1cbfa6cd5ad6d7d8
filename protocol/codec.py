"""Frame codec: message dataclass <-> `[type byte, msgpack payload]`. Never pickle.

encode(msg) -> [bytes([type]), payload]      (the ROUTER side prepends the peer's routing id)
decode(frames) -> msg                         (raises DecodeError on anything malformed)

The decoder checks every frame: a known type byte, a msgpack map (StepOutputs: a list of
positional TokenOutput rows), every required field present with the declared type. A frame from a
buggy or hostile peer therefore becomes a DecodeError that the caller answers or logs; it never
reaches the engine or the HTTP layer half-built.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import operator
import types
import typing
from typing import Any

import msgpack

from protocol import messages as m

# One type byte per message. Never renumber: peers of different builds must agree.
TYPE_CODES: dict[type, int] = {
    m.Hello: 1,
    m.Welcome: 2,
    m.Generate: 3,
    m.TokenOutput: 4,
    m.RequestError: 5,
    m.Cancel: 6,
    m.Heartbeat: 7,
    m.Reset: 8,
    m.WorkerDying: 9,
    m.ProtocolError: 10,
    m.StepOutputs: 11,
}
CODE_TYPES: dict[int, type] = {code: cls for cls, code in TYPE_CODES.items()}

# Size limits. The socket's MAXMSGSIZE (protocol.transport) refuses anything over
# MAX_FRAME_BYTES before it is read whole; a Hello carries a tokenizer (~3.5 MB for SmolLM2,
# ~9 MB for Llama 3), every other message is small. A payload over its type's limit is refused
# before msgpack sees it, and msgpack itself is bounded so no frame can build huge containers.
MAX_FRAME_BYTES = 16 * 1024 * 1024
MAX_PAYLOAD_BYTES: dict[type, int] = {m.Hello: MAX_FRAME_BYTES, m.Generate: 4 * 1024 * 1024,
                                      m.StepOutputs: 2 * 1024 * 1024}
DEFAULT_MAX_PAYLOAD = 64 * 1024  # heartbeats, errors, cancels
MAX_ARRAY_LEN = 1 << 20  # longest list (a Generate's prompt token ids)
MAX_MAP_LEN = 64  # our maps are structs with a handful of fields


def hello_over_limit(hello: m.Hello) -> str | None:
    """Why this Hello cannot cross the link (a frame over MAX_FRAME_BYTES: the gateway's socket
    closes the connection before reading it, and neither side would hear of it), or None."""
    size = sum(len(frame) for frame in encode(hello))
    if size <= MAX_FRAME_BYTES:
        return None
    info, mib = hello.tokenizer, 1024 * 1024
    return (f"the Hello is {size / mib:.1f} MiB, over the engine link's frame limit of "
            f"{MAX_FRAME_BYTES // mib} MiB (its tokenizer JSON is "
            f"{len(info.tokenizer_json.encode()) / mib:.1f} MiB, its chat template "
            f"{len((info.chat_template or '').encode()) / mib:.1f} MiB): no gateway can take it")


class DecodeError(ValueError):
    """A frame that is not a valid message. Callers log it or answer ProtocolError."""


def encode(msg: Any) -> list[bytes]:
    code = TYPE_CODES.get(type(msg))
    if code is None:
        raise TypeError(f"not a protocol message: {type(msg).__name__}")
    plain = _step_rows(msg) if code == STEP_CODE else _to_plain(msg)
    return [bytes([code]), msgpack.packb(plain, use_bin_type=True)]


def peek_type(frames: list[bytes]) -> type | None:
    """The message class a frame claims to be, read from its type byte alone (no decoding), or
    None when the layout or the byte is wrong. For dropping unwanted frames cheaply."""
    if len(frames) != 2 or len(frames[0]) != 1:
        return None
    return CODE_TYPES.get(frames[0][0])


def step_rows(frames: list[bytes]) -> int | None:
    """How many rows a StepOutputs frame says it holds, from its msgpack array header alone
    (no decoding), or None when the payload does not start with one. For refusing a frame with
    more rows than its sender runs sequences before paying to decode it."""
    if len(frames) != 2 or not frames[1]:
        return None
    payload = frames[1]
    head = payload[0]
    if 0x90 <= head <= 0x9F:  # fixarray
        return head & 0x0F
    width = {0xDC: 2, 0xDD: 4}.get(head)
    if width is None or len(payload) < 1 + width:
        return None
    return int.from_bytes(payload[1:1 + width], "big")


def decode(frames: list[bytes]) -> Any:
    if len(frames) != 2:
        raise DecodeError(f"expected 2 frames [type, payload], got {len(frames)}")
    type_frame, payload = frames
    if len(type_frame) != 1 or type_frame[0] not in CODE_TYPES:
        raise DecodeError(f"unknown message type {type_frame[:8]!r}")
    cls = CODE_TYPES[type_frame[0]]
    limit = MAX_PAYLOAD_BYTES.get(cls, DEFAULT_MAX_PAYLOAD)
    if len(payload) > limit:
        raise DecodeError(f"{cls.__name__} payload of {len(payload)} bytes is over its "
                          f"limit of {limit}")
    try:
        data = msgpack.unpackb(payload, raw=False, strict_map_key=True, max_bin_len=limit,
                               max_str_len=limit, max_array_len=MAX_ARRAY_LEN,
                               max_map_len=MAX_MAP_LEN, max_ext_len=0)
    except Exception as exc:  # msgpack raises several unrelated types
        raise DecodeError(f"payload is not msgpack: {exc}") from None
    return _build_step(data) if cls is m.StepOutputs else _build(cls, data)


def tokenizer_digest(info: m.TokenizerInfo) -> str:
    """A stable sha256 over every field of a TokenizerInfo: two workers of one model agree."""
    h = hashlib.sha256()
    for part in (info.tokenizer_json, info.chat_template or "", info.bos_token or "",
                 info.eos_token or "", json.dumps(info.eos_token_ids), str(info.add_bos_token)):
        data = part.encode("utf-8", "surrogatepass")
        h.update(len(data).to_bytes(8, "big"))
        h.update(data)
    return h.hexdigest()


def _to_plain(obj: Any) -> Any:
    # asdict() recurses into nested dataclasses and copies lists: exactly the msgpack shape.
    return dataclasses.asdict(obj)


# StepOutputs carries every sequence of a step, so it skips the generic field-by-field walk:
# each TokenOutput is a positional row in its dataclass's field order (the order is written
# once, in protocol.messages), checked by _token_output.
STEP_CODE = TYPE_CODES[m.StepOutputs]
_OUT_FIELDS = tuple(f.name for f in dataclasses.fields(m.TokenOutput))
_OUT_ROW = operator.attrgetter(*_OUT_FIELDS)
_FINISH = frozenset(typing.get_args(m.FinishReason))


def _step_rows(msg: m.StepOutputs) -> list[tuple[Any, ...]]:
    return [_OUT_ROW(o) for o in msg.outputs]  # msgpack writes a tuple as an array


def _build_step(data: Any) -> m.StepOutputs:
    if not isinstance(data, list):
        raise DecodeError("StepOutputs: payload is not a list")
    return m.StepOutputs([_token_output(row, i) for i, row in enumerate(data)])


def _checked_output(f: dict[str, Any], i: int) -> None:
    """The checks of one decoded row's fields, by name (logprobs and the time converted in
    place); DecodeError naming the row."""
    if not (type(f["request_id"]) is str and type(f["index"]) is int
            and type(f["prompt_tokens"]) is int and type(f["completion_tokens"]) is int
            and type(f["cached_tokens"]) is int):
        raise DecodeError(f"StepOutputs[{i}]: request_id must be a string; index and counts "
                          "integers")
    ids = f["token_ids"]
    if type(ids) is not list or not (len(ids) == 1 and type(ids[0]) is int
                                     or all(type(t) is int for t in ids)):
        raise DecodeError(f"StepOutputs[{i}].token_ids: expected a list of integers")
    if f["finish_reason"] is not None and f["finish_reason"] not in _FINISH:
        raise DecodeError(f"StepOutputs[{i}].finish_reason: expected one of "
                          f"{', '.join(sorted(_FINISH))}")
    if f["since_scheduled_s"] is not None:
        f["since_scheduled_s"] = _check(float, f["since_scheduled_s"],
                                        f"StepOutputs[{i}].since_scheduled_s")
    vector = f["embedding"]
    if vector is not None and (type(vector) is not bytes or len(vector) % 4):
        raise DecodeError(f"StepOutputs[{i}].embedding: expected float32 bytes")
    if f["logprobs"] is not None:
        f["logprobs"] = _check(_hints(m.TokenOutput)["logprobs"], f["logprobs"],
                               f"StepOutputs[{i}].logprobs")


def _row_reader() -> Any:
    """`_token_output(row, i)`, written from TokenOutput's declaration: the row unpacked by
    position into a dict literal (a dict(zip()) a row was 1.7x slower over a 64-row step).
    Rows may grow at the end within one version; a newer peer's extra fields are ignored. A
    frozen dataclass's __init__ sets each field through object.__setattr__ (most of the time);
    its __dict__ set in one go makes the same object."""
    names = ", ".join(_OUT_FIELDS)
    fields = ", ".join(f"{n!r}: {n}" for n in _OUT_FIELDS)
    n = len(_OUT_FIELDS)
    source = (
        "def _token_output(row, i):\n"
        f"    if type(row) is not list or len(row) < {n}:\n"
        f"        raise DecodeError(f'StepOutputs[{{i}}]: expected a list of {n}')\n"
        f"    {names}, = row[:{n}]\n"
        f"    f = {{{fields}}}\n"
        "    checked(f, i)\n"
        "    out = new(TokenOutput)\n"
        "    put(out, '__dict__', f)\n"
        "    return out\n")
    scope = {"DecodeError": DecodeError, "checked": _checked_output, "new": object.__new__,
             "put": object.__setattr__, "TokenOutput": m.TokenOutput}
    exec(compile(source, "<protocol.codec: TokenOutput rows>", "exec"), scope)  # noqa: S102
    return scope["_token_output"]


_token_output = _row_reader()



_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _build(cls: type, data: Any) -> Any:
    if not isinstance(data, dict):
        raise DecodeError(f"{cls.__name__}: payload is not a map")
    hints = _hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            if required:
                raise DecodeError(f"{cls.__name__}: missing field {f.name!r}")
            continue
        kwargs[f.name] = _check(hints[f.name], data[f.name], f"{cls.__name__}.{f.name}")
    # Unknown keys are ignored: a newer peer may add optional fields within one version.
    return cls(**kwargs)


def _check(tp: Any, value: Any, where: str) -> Any:
    """Check `value` against the type hint `tp`; rebuild nested dataclasses."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _check(inner[0], value, where)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value)
    if origin is typing.Literal:
        if not isinstance(value, str) or value not in args:
            raise DecodeError(f"{where}: expected one of {', '.join(args)}")
        return value
    if origin is tuple:  # a fixed-shape record, sent as a list; stays a list
        if not isinstance(value, list) or len(value) != len(args):
            raise DecodeError(f"{where}: expected a list of {len(args)}")
        checked = enumerate(zip(args, value, strict=True))
        return [_check(a, v, f"{where}[{i}]") for i, (a, v) in checked]
    if origin is list or tp is list:
        if not isinstance(value, list):
            raise DecodeError(f"{where}: expected a list")
        if args:
            return [_check(args[0], v, f"{where}[]") for v in value]
        return value
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise DecodeError(f"{where}: expected a map")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise DecodeError(f"{where}: expected a number")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise DecodeError(f"{where}: expected an integer")
        return value
    if tp in (str, bool, bytes):
        if not isinstance(value, tp):
            raise DecodeError(f"{where}: expected {tp.__name__}")
        return value
    if tp is Any:
        return value
    raise DecodeError(f"{where}: unsupported type {tp!r}")
