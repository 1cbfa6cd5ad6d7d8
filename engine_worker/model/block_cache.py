"""A GGUF file's rewritten blocks, kept on disk so that a later start maps them instead of
rewriting them (issue 39: the 1.5B Qwen's K-quants took ~9 s of numpy per start).

    BlockCache.beside(gguf, folder): folder/blocks-v<FORMAT>-<size>-<mtime_ns>/ (the converted
        config's folder, keyed by the file's header; the name adds the file's size and mtime, so
        a file rewritten in place gets a new cache, and the older ones are removed)
    read(tensor):
        NAME.json (fmt, n, k, dtype, shape, bytes, sha256) and NAME.bin, both present and the
        .bin's size and sha256 what the .json says? -> a read-only numpy memmap of NAME.bin
        else ggml_types.read_tensor(tensor); when its bytes are not the file's own (a K-quant or
        Q5_1 rewritten, a type dequantized) they are written as NAME.bin, then NAME.json, each
        through a temporary file and a rename (two workers starting at once both write whole
        files; a reader never sees half of one), read-only (0444)

    packed(key, fmt, raw, n, k):
        packed/KEY.json and its parts (qs, d, m) as packed/KEY.PART.bin, sealed as above -> the
        matrix in the integer-dot kernel's layout (int_dot.Packed) over read-only maps of them
        else int_dot.pack(fmt, raw(), ...), written, then mapped: a later start does not pack
        again (~1 s for the 1.5B Qwen). A worker's builder then copies them into 2 MiB pages
        (model/huge_pages.py: a decode step streams them, ~10 % faster so); with
        --huge-pages off these file pages serve, which two workers of one file share and the
        host can take back under pressure. KEY names the layer (blk.3.mlp.gate_up_proj);
        the json holds int_dot.LAYOUT.

A tensor served as stored (Q4_0, Q4_1, Q8_0, Q5_0) is already a view of the file: nothing is
written for it (its packed layout is). A .bin whose seal does not match (a disk error, an edit)
is rebuilt, never served. A seal is signed (HMAC-SHA256 over its folder, its name and its fields,
the .bin's sha256 among them) with a key the worker keeps outside the cache, in a file only its
user can read and write (seal_key: KESTREL_BLOCK_CACHE_KEY, else ~/.local/state/kestrel/
block-cache.key, made once, 0600): whoever can write the cache folder but not the key cannot make
a tampered .bin pass, even by rewriting its sha256 beside it (issue 54). Without a usable key the
cache is not used. Where the folder cannot be written, the rewrite is served and the
cache skipped (logged once). The checksum reads every cached byte at each start (~2 GB/s with
SHA extensions) through the file, not the mapping: the pages come into the page cache without
being mapped into this process, so a tensor read in place (the token embedding) holds only the
rows it looks up.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import shutil
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine_worker import int_dot
from engine_worker.model.ggml_types import Blocks, read_tensor

log = logging.getLogger("kestrel.gguf")

# bump when ggml_types' rewrite of any type changes its output (2: Q6_K as q6_16, was q8_16;
# 3: Q4_K and Q6_K as stored, q4_k and q6_k; 4: Q5_K as stored, q5_k)
FORMAT = 4


KEY_ENV = "KESTREL_BLOCK_CACHE_KEY"  # the seal key's file, if not the default
KEY_BYTES = 32


def seal_key(path: Path | None = None) -> bytes | None:
    """The key that signs the cache's seals: read from `path` (KEY_ENV's file, else
    ~/.local/state/kestrel/block-cache.key), made there once (random, mode 0600, its folder
    0700) when absent. None (no cache) where it cannot be read or made, or where others than its
    owner may read or write it."""
    path = Path(path or os.environ.get(KEY_ENV) or
                Path.home() / ".local" / "state" / "kestrel" / "block-cache.key")
    try:
        if not path.exists():
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.write(fd, secrets.token_bytes(KEY_BYTES))
                os.close(fd)
                os.link(tmp, path)  # whole or not at all; a worker beside us may win
            except FileExistsError:
                pass
            finally:
                tmp.unlink(missing_ok=True)
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            key = f.read(KEY_BYTES + 1)
        if st.st_mode & 0o077 or st.st_uid != os.getuid() or len(key) != KEY_BYTES:
            log.warning("block cache: the seal key %s is not this user's alone (0600, %d "
                        "bytes); serving without the cache", path, KEY_BYTES)
            return None
        return key
    except OSError as exc:
        log.warning("block cache: no seal key at %s (%s); serving without the cache", path, exc)
        return None


class BlockCache:
    def __init__(self, folder: Path, key: bytes | None = None) -> None:
        self.folder = folder
        self.hits = self.writes = 0
        self.packed_hits = self.packed_writes = 0
        self.key = key if key is not None else seal_key()
        self.writable = self.key is not None  # without a key, neither read nor written

    def _sign(self, name: str, meta: dict[str, Any]) -> str:
        """The seal's signature: its folder (the GGUF file's size and mtime), its file's name
        and its fields, so that no seal serves another tensor, file or version."""
        assert self.key is not None
        body = json.dumps(meta, sort_keys=True, separators=(",", ":"))
        return hmac.new(self.key, f"{self.folder.name}/{name}\n{body}".encode(),
                        hashlib.sha256).hexdigest()

    def _signed(self, name: str, meta: dict[str, Any]) -> bytes:
        return json.dumps({**meta, "hmac": self._sign(name, meta)}).encode()

    def _seal(self, path: Path) -> dict[str, Any] | None:
        """The seal in `path` when its signature is ours (else None; OSError, ValueError)."""
        if self.key is None:
            return None
        meta = json.loads(path.read_text())
        mac = meta.pop("hmac", None) if isinstance(meta, dict) else None
        name = path.relative_to(self.folder).as_posix()
        if not isinstance(mac, str) or not hmac.compare_digest(mac, self._sign(name, meta)):
            log.warning("block cache: %s is not signed with this worker's key; rewriting it",
                        path)
            return None
        return meta

    @classmethod
    def beside(cls, gguf: Path, folder: Path) -> BlockCache:
        st = Path(gguf).stat()
        name = f"blocks-v{FORMAT}-{st.st_size}-{st.st_mtime_ns}"
        for old in Path(folder).glob("blocks-v*"):
            if old.name != name and old.is_dir():  # an older file's, or an older format's
                shutil.rmtree(old, ignore_errors=True)
        return cls(Path(folder) / name)

    def read(self, t: Any) -> Blocks:
        """The tensor's Blocks: mapped from the cache when sealed there, else rewritten (and
        written to the cache when the rewrite is not a view of the file)."""
        name = str(t.name)
        cached = self._load(name)
        if cached is not None:
            self.hits += 1
            return cached
        blocks = read_tensor(t)
        if self.writable and not np.may_share_memory(blocks.raw, np.asarray(t.data)):
            self._store(name, blocks)
        return blocks

    def packed(self, key: str, fmt: str, raw: Callable[[], Any], n: int, k: int
               ) -> int_dot.Packed:
        """The matrix `key` in the kernel's layout, mapped from the cache (see the module)."""
        got = self._load_packed(key, fmt, n, k)
        if got is not None:
            self.packed_hits += 1
            return got
        p = int_dot.pack(fmt, raw(), n, k)
        if not self.writable:
            return p
        parts = {"qs": p.qs, "d": p.d} | ({} if p.m is None else {"m": p.m})
        folder = self.folder / "packed"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            sealed = {part: _sealed_write(folder / f"{key}.{part}.bin", t.numpy())
                      for part, t in parts.items()}
            _write(folder / f"{key}.json", self._signed(f"packed/{key}.json", {
                "fmt": fmt, "n": n, "k": k, "layout": int_dot.LAYOUT, "parts": sealed}))
        except OSError as exc:
            self.writable = False
            log.warning("block cache: cannot write under %s (%s); serving without it",
                        self.folder, exc)
            return p
        self.packed_writes += 1
        return self._load_packed(key, fmt, n, k) or p

    def _load_packed(self, key: str, fmt: str, n: int, k: int) -> int_dot.Packed | None:
        folder = self.folder / "packed"
        try:
            meta = self._seal(folder / f"{key}.json")
            if meta is None:
                return None
            if (meta["fmt"], meta["n"], meta["k"], meta["layout"]) != (fmt, n, k, int_dot.LAYOUT):
                return None
            tensors = {}
            for part, info in meta["parts"].items():
                raw = self._sealed(folder / f"{key}.{part}.bin", info)
                if raw is None:
                    return None
                with warnings.catch_warnings():  # a read-only map: the kernel only reads it
                    warnings.simplefilter("ignore", UserWarning)
                    tensors[part] = torch.from_numpy(raw)
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return int_dot.Packed(fmt, n, k, tensors["qs"], tensors["d"], tensors.get("m"))

    def _load(self, name: str) -> Blocks | None:
        try:
            meta = self._seal(self.folder / f"{name}.json")
            if meta is None:
                return None
            raw = self._sealed(self.folder / f"{name}.bin", meta)
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return None if raw is None else Blocks(meta["fmt"], raw, int(meta["n"]), int(meta["k"]))

    @staticmethod
    def _sealed(path: Path, meta: dict[str, Any]) -> np.memmap | None:
        """A read-only map of `path` when its size and sha256 are `meta`'s (else None; OSError
        where it cannot be read). One open file: the bytes checked are those mapped."""
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size != meta["bytes"]:
                return None
            if hashlib.file_digest(f, "sha256").hexdigest() != meta["sha256"]:
                log.warning("block cache: %s does not match its seal; rewriting it", path)
                return None
            return np.memmap(f, dtype=np.dtype(meta["dtype"]), mode="r",
                             shape=tuple(meta["shape"]))

    def _store(self, name: str, b: Blocks) -> None:
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            seal = _sealed_write(self.folder / f"{name}.bin", b.raw)
            _write(self.folder / f"{name}.json",
                   self._signed(f"{name}.json", {"fmt": b.fmt, "n": b.n, "k": b.k, **seal}))
            self.writes += 1
        except OSError as exc:
            self.writable = False
            log.warning("block cache: cannot write under %s (%s); serving without it",
                        self.folder, exc)


def _sealed_write(path: Path, array: np.ndarray) -> dict[str, Any]:
    """Write the array's bytes to `path` (see _write); its seal as `_sealed` reads it."""
    raw = np.ascontiguousarray(array)
    _write(path, raw.data)
    return {"dtype": raw.dtype.str, "shape": list(raw.shape), "bytes": raw.nbytes,
            "sha256": hashlib.sha256(raw.data).hexdigest()}


def _write(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o444)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
