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

A tensor served as stored (Q4_0, Q4_1, Q8_0, Q5_0) is already a view of the file: nothing is
written for it. A .bin whose seal does not match (a disk error, an edit) is rebuilt, never
served. Where the folder cannot be written, the rewrite is served and the cache skipped (logged
once). The checksum reads every cached byte at each start (~2 GB/s with SHA extensions) through
the file, not the mapping: the pages come into the page cache without being mapped into this
process, so a tensor read in place (the token embedding) holds only the rows it looks up.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from engine_worker.model.ggml_types import Blocks, read_tensor

log = logging.getLogger("kestrel.gguf")

FORMAT = 2  # 2: Q6_K as q6_16 (was q8_16). Bump when ggml_types' rewrite of any type changes its output


class BlockCache:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.hits = self.writes = 0
        self.writable = True

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

    def _load(self, name: str) -> Blocks | None:
        meta_path, bin_path = self.folder / f"{name}.json", self.folder / f"{name}.bin"
        try:
            meta = json.loads(meta_path.read_text())
            with open(bin_path, "rb") as f:  # one open file: the bytes checked are those mapped
                if os.fstat(f.fileno()).st_size != meta["bytes"]:
                    return None
                if hashlib.file_digest(f, "sha256").hexdigest() != meta["sha256"]:
                    log.warning("block cache: %s does not match its seal; rewriting it",
                                bin_path)
                    return None
                raw = np.memmap(f, dtype=np.dtype(meta["dtype"]), mode="r",
                                shape=tuple(meta["shape"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return Blocks(meta["fmt"], raw, int(meta["n"]), int(meta["k"]))

    def _store(self, name: str, b: Blocks) -> None:
        raw = np.ascontiguousarray(b.raw)
        meta = {"fmt": b.fmt, "n": b.n, "k": b.k, "dtype": raw.dtype.str,
                "shape": list(raw.shape), "bytes": raw.nbytes,
                "sha256": hashlib.sha256(raw.data).hexdigest()}
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            _write(self.folder / f"{name}.bin", raw.data)
            _write(self.folder / f"{name}.json", json.dumps(meta).encode())
            self.writes += 1
        except OSError as exc:
            self.writable = False
            log.warning("block cache: cannot write under %s (%s); serving without it",
                        self.folder, exc)


def _write(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o444)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
