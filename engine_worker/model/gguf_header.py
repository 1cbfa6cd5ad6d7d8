"""A GGUF file's header read directly, without gguf.GGUFReader (which parses every array first:
3 s for SmolLM2's file, 9 s for Qwen2.5's on a 2-core host):

    [magic, version, n_tensors, n_kv] [n_kv metadata entries] [n_tensors tensor infos] | data

`gguf_string` reads one metadata string, `gguf_array_len` one array's length; `HeaderReader`
all of the metadata at once, in the shape transformers' GGUF loader reads from a GGUFReader
(its config and tokenizer conversion: 0.3 s instead of 10 s for Qwen2.5's 151,936 tokens);
`header_digest`
hashes everything before the data (the metadata and the tensor table), the part a conversion
reads: the converted-model cache is keyed by it, so an edit of a token id or a template is seen
even when the file keeps its size. `tensor_table` lists the tensors as GGUFReader does (its own
ReaderTensor, data a read-only memory map of the file) from the tensor table alone: 3.8 s of
every start of SmolLM2's file on a Zen 5 core became milliseconds.
"""

from __future__ import annotations

import hashlib
import mmap
import struct
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

# GGUF value types (gguf.GGUFValueType): fixed sizes in bytes; 8 is a string, 9 an array.
_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
T = TypeVar("T")


def _skip(buf: mmap.mmap, pos: int, vtype: int) -> int:
    """The offset just past one value of type `vtype` at `pos`."""
    if vtype == _STRING:
        return pos + 8 + struct.unpack_from("<Q", buf, pos)[0]
    if vtype != _ARRAY:
        return pos + _SIZES[vtype]
    sub, count = struct.unpack_from("<IQ", buf, pos)
    pos += 12
    if sub in _SIZES:
        return pos + count * _SIZES[sub]
    for _ in range(count):
        pos = _skip(buf, pos, sub)
    return pos


def _entries(path: Path, buf: mmap.mmap):  # noqa: ANN202 (a generator of (name, type, offset))
    """Each metadata entry as (name bytes, value type, offset of its value)."""
    if len(buf) < 24:
        raise ValueError(f"{path}: {len(buf)} bytes, shorter than a GGUF header")
    magic, version, _tensors, n_kv = struct.unpack_from("<4sIQQ", buf, 0)
    if magic != b"GGUF" or not 2 <= version < 256:  # v1 had 32-bit lengths; big-endian files
        raise ValueError(f"{path}: not a little-endian GGUF v2+ file")
    if n_kv > len(buf) // 12:  # each entry takes at least 12 bytes
        raise ValueError(f"{path}: the header claims {n_kv:,} metadata entries, more than its "
                         f"{len(buf):,} bytes can hold")
    pos = 24
    for i in range(n_kv):
        n = struct.unpack_from("<Q", buf, pos)[0]
        if pos + 12 + n > len(buf):
            raise ValueError(f"{path}: metadata entry {i} of {n_kv} has a name of {n:,} bytes, "
                             "past the end of the file")
        name = buf[pos + 8 : pos + 8 + n]
        vtype = struct.unpack_from("<I", buf, pos + 8 + n)[0]
        if vtype not in _SIZES and vtype not in (_STRING, _ARRAY):
            raise ValueError(f"{path}: metadata entry {name.decode(errors='replace')!r} has an "
                             f"unknown value type {vtype}")
        pos += 12 + n
        yield name, vtype, pos
        pos = _skip(buf, pos, vtype)
        if pos > len(buf):
            raise ValueError(f"{path}: metadata entry {name.decode(errors='replace')!r} runs "
                             "past the end of the file")


def _metadata(path: Path, key: str, vtype: int, read: Callable[[mmap.mmap, int], T]) -> T | None:
    """`read(buf, offset)` of one metadata value of type `vtype`, or None when the key is absent.
    Reads the header only up to that key."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        want = key.encode()
        for name, found, pos in _entries(path, buf):
            if name == want:
                if found != vtype:
                    raise ValueError(f"{path}: {key} has GGUF type {found}, not {vtype}")
                return read(buf, pos)
    return None


def gguf_string(path: Path, key: str) -> str | None:
    """One string of a GGUF file's metadata, or None."""
    def read(buf: mmap.mmap, pos: int) -> str:
        n = struct.unpack_from("<Q", buf, pos)[0]
        return buf[pos + 8 : pos + 8 + n].decode("utf-8")
    return _metadata(path, key, _STRING, read)


def gguf_array_len(path: Path, key: str) -> int | None:
    """How many items one array of a GGUF file's metadata holds, or None."""
    return _metadata(path, key, _ARRAY, lambda buf, pos: int(struct.unpack_from("<IQ", buf,
                                                                                 pos)[1]))


def header_digest(path: Path) -> str:
    """sha256 of the file's header, metadata and tensor table (everything before the data)."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        pos = 24
        for _name, vtype, value in _entries(path, buf):
            pos = _skip(buf, value, vtype)
        n_tensors = struct.unpack_from("<Q", buf, 8)[0]
        for _ in range(n_tensors):  # name, n_dims, dims, type, offset
            n = struct.unpack_from("<Q", buf, pos)[0]
            dims = struct.unpack_from("<I", buf, pos + 8 + n)[0]
            pos += 8 + n + 4 + 8 * dims + 4 + 8
        if pos > len(buf):
            raise ValueError(f"{path}: the header runs past the end of the file")
        return hashlib.sha256(buf[:pos]).hexdigest()


# GGUF tensor types whose data GGUFReader views as numbers (the rest as bytes per block row)
_NUMERIC = {0: "float32", 1: "float16", 24: "int8", 25: "int16", 26: "int32", 27: "int64",
            28: "float64"}
_ALIGNMENT_KEY, _UINT32 = b"general.alignment", 4


def tensor_table(path: Path) -> dict:  # noqa: ANN201 -> dict[str, gguf.ReaderTensor]
    """Every tensor of the file by name, as `gguf.GGUFReader(path).tensors` gives them (field
    None): type, dims (innermost first), element and byte counts, data offset, and the data as a
    view of one read-only np.memmap of the file. ValueError where the table is malformed: a
    duplicated name, an unknown type, data past the end of the file."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, ReaderTensor
    from gguf.quants import quant_shape_to_byte_shape

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        pos, alignment = 24, 32
        for name, vtype, value in _entries(path, buf):
            if name == _ALIGNMENT_KEY and vtype == _UINT32:
                alignment = struct.unpack_from("<I", buf, value)[0]
            pos = _skip(buf, value, vtype)
        if alignment == 0 or alignment & (alignment - 1):
            raise ValueError(f"{path}: general.alignment {alignment} is not a power of two")
        n_tensors = struct.unpack_from("<Q", buf, 8)[0]
        if n_tensors > len(buf) // 24:
            raise ValueError(f"{path}: the header claims {n_tensors:,} tensors, more than its "
                             f"{len(buf):,} bytes can hold")
        infos = []
        for _ in range(n_tensors):  # name, n_dims, dims, type, offset
            n = struct.unpack_from("<Q", buf, pos)[0]
            name = bytes(buf[pos + 8 : pos + 8 + n]).decode("utf-8")
            n_dims = struct.unpack_from("<I", buf, pos + 8 + n)[0]
            if n_dims > 8:
                raise ValueError(f"{path}: tensor {name!r} claims {n_dims} dimensions")
            dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 12 + n)
            raw_type, offset = struct.unpack_from("<IQ", buf, pos + 12 + n + 8 * n_dims)
            infos.append((name, dims, raw_type, offset))
            pos += 8 + n + 4 + 8 * n_dims + 4 + 8
        start = pos + (-pos % alignment)
    data = np.memmap(path, mode="r")
    out: dict = {}
    for name, dims, raw_type, offset in infos:
        if name in out:
            raise ValueError(f"{path}: tensor {name!r} is listed twice")
        ggml_type = GGMLQuantizationType(raw_type)
        n_elems = int(np.prod(dims, dtype=np.uint64)) if dims else 1
        block, type_size = GGML_QUANT_SIZES[ggml_type]
        n_bytes = n_elems * type_size // block
        begin = start + offset
        if begin + n_bytes > len(data):
            raise ValueError(f"{path}: tensor {name!r} ({n_bytes:,} bytes at {begin:,}) runs "
                             f"past the end of the file ({len(data):,} bytes)")
        np_dims = tuple(reversed(dims))
        if raw_type in _NUMERIC:
            view = data[begin : begin + n_bytes].view(np.dtype(_NUMERIC[raw_type]))
        else:
            view = data[begin : begin + n_bytes]
            np_dims = quant_shape_to_byte_shape(np_dims, ggml_type)
        out[name] = ReaderTensor(name=name, tensor_type=ggml_type,
                                 shape=np.array(dims, dtype=np.uint64), n_elements=n_elems,
                                 n_bytes=n_bytes, data_offset=begin,
                                 data=view.reshape(np_dims), field=None)
    return out


# value type -> struct format of one scalar (strings and arrays apart)
_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}
_NP = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8",
       11: "<i8", 12: "<f8"}


class HeaderField:
    """One metadata entry as GGUFReader's ReaderField shows it to a reader that takes value i as
    `parts[data[i]]` with `types` ([type], or [9, item type] for an array): a scalar's part is a
    one-item list, a string's its bytes."""

    def __init__(self, name: str, types: list[int], parts: list) -> None:
        self.name, self.types, self.parts = name, types, parts
        self.data = list(range(len(parts)))


def _values(buf: mmap.mmap, pos: int, vtype: int, count: int) -> list:
    if vtype == _STRING:
        out = []
        for _ in range(count):
            n = struct.unpack_from("<Q", buf, pos)[0]
            out.append(bytes(buf[pos + 8 : pos + 8 + n]))
            pos += 8 + n
        return out
    import numpy as np

    items = np.frombuffer(buf, dtype=np.dtype(_NP[vtype]), count=count, offset=pos)
    return [[v] for v in items.tolist()]


class HeaderReader:
    """The file's metadata (`fields`, name -> HeaderField) and tensors (`tensors`, as
    tensor_table's) for transformers' GGUF loader, which otherwise builds gguf.GGUFReader: that
    parses each array item into numpy views (5.9 M calls for Qwen2.5's tokenizer, 10 s on a
    Zen 5 core). An array of arrays (no file of ours has one) raises NotImplementedError."""

    def __init__(self, path: str | Path, *_args: object, **_kwargs: object) -> None:
        path = Path(path)
        self.fields: dict[str, HeaderField] = {}
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            entries = list(_entries(path, buf))  # checks the header first
            version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
            for name, vtype, value in (("GGUF.version", 4, version),
                                       ("GGUF.tensor_count", 10, n_tensors),
                                       ("GGUF.kv_count", 10, n_kv)):  # as GGUFReader lists them
                self.fields[name] = HeaderField(name, [vtype], [[value]])
            for raw, vtype, pos in entries:
                name = bytes(raw).decode("utf-8")
                if vtype == _ARRAY:
                    sub, count = struct.unpack_from("<IQ", buf, pos)
                    if sub == _ARRAY or (sub != _STRING and sub not in _FORMATS):
                        raise NotImplementedError(f"{path}: {name} is an array of type {sub}")
                    self.fields[name] = HeaderField(name, [_ARRAY, sub],
                                                    _values(buf, pos + 12, sub, count))
                else:
                    self.fields[name] = HeaderField(name, [vtype], _values(buf, pos, vtype, 1))
        self.tensors = list(tensor_table(path).values())
