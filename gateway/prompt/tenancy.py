"""Who may share whose prefix cache: the salt a request's blocks are hashed under.

    API key (None when keys are off) + the request's own `cache_salt` (vLLM's extension)
      ──cache_salt()──▶ "" (keys off, no salt: one shared cache, as before)
                     or a digest: the worker's block chains start from it (block_manager
                        .root_hash), the router's prefix index hashes with it

With keys set, each key is its own tenant by default: a cached prefix is found, and
`usage.prompt_tokens_details.cached_tokens` counts it, only for requests of the key that cached
it, so no client can learn from hit counts what another client's prompts contained. The salt is a
keyed digest, never the key: it crosses the link and may appear in a worker's memory dumps.
"""

from __future__ import annotations

import hashlib


def cache_salt(key: str | None, request_salt: str | None) -> str:
    """The salt for a request by `key` asking for `request_salt`; "" for neither."""
    if key is None and request_salt is None:
        return ""
    h = hashlib.sha256(b"kestrel prefix cache tenant\0")
    h.update((key or "").encode("utf-8", "surrogatepass") + b"\0")
    h.update((request_salt or "").encode("utf-8", "surrogatepass"))
    return h.hexdigest()[:32]
