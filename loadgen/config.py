"""The load generator's settings: one frozen dataclass per run, validated once when built.

The CLI parses flags into a `LoadConfig` (a Python caller builds one directly); `run_load` reads it
and never changes it. Length distributions are small value objects parsed from strings such as
`fixed:128` or `uniform:64,256`, so the same spelling works on the command line and in code.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

Api = Literal["chat", "completions"]
Mode = Literal["open", "closed"]


@dataclass(frozen=True)
class LengthDist:
    """A length in tokens: `fixed` always `low`; `uniform` is an integer in [low, high]."""

    kind: Literal["fixed", "uniform"]
    low: int
    high: int

    def __post_init__(self) -> None:
        if self.low < 0 or self.high < self.low:
            raise ValueError(f"bad length range {self.low}..{self.high}")
        if self.kind == "fixed" and self.high != self.low:
            raise ValueError("a fixed length has low == high")

    @classmethod
    def fixed(cls, n: int) -> LengthDist:
        return cls("fixed", n, n)

    @classmethod
    def uniform(cls, low: int, high: int) -> LengthDist:
        return cls("uniform", low, high)

    @classmethod
    def parse(cls, text: str) -> LengthDist:
        """`128`, `fixed:128`, `uniform:64,256` (or `uniform:64:256`)."""
        kind, _, rest = text.strip().partition(":")
        try:
            if not rest:
                return cls.fixed(int(kind))
            if kind == "fixed":
                return cls.fixed(int(rest))
            if kind == "uniform":
                low, high = rest.replace(":", ",").split(",")
                return cls.uniform(int(low), int(high))
        except ValueError as exc:
            raise ValueError(f"bad length {text!r}: {exc}") from None
        raise ValueError(f"bad length {text!r}: expected fixed:N or uniform:MIN,MAX")

    def sample(self, rng: random.Random) -> int:
        # A fixed length draws nothing from rng: the seed fixes the whole workload as configured.
        return self.low if self.kind == "fixed" else rng.randint(self.low, self.high)

    def __str__(self) -> str:
        return f"fixed:{self.low}" if self.kind == "fixed" else f"uniform:{self.low},{self.high}"


@dataclass(frozen=True)
class WorkloadConfig:
    """What each request asks for. `dataset` (JSONL) overrides the drawn lengths line by line."""

    prompt_len: LengthDist = LengthDist.fixed(128)
    output_len: LengthDist = LengthDist.fixed(64)
    dataset: Path | None = None
    shared_prefix_frac: float = 0.0
    shared_prefix_len: int = 0
    tokenizer_json: Path | None = None

    def __post_init__(self) -> None:
        if self.output_len.low < 1:
            raise ValueError("output lengths must be >= 1 token")
        if not 0.0 <= self.shared_prefix_frac <= 1.0:
            raise ValueError("shared_prefix_frac must be in [0, 1]")
        if self.shared_prefix_len < 0:
            raise ValueError("shared_prefix_len must be >= 0")
        if self.shared_prefix_frac > 0 and self.shared_prefix_len == 0:
            raise ValueError("shared_prefix_frac > 0 needs shared_prefix_len > 0")
        if self.dataset is not None and not Path(self.dataset).is_file():
            raise ValueError(f"dataset {self.dataset} is not a file")
        if self.tokenizer_json is not None and not Path(self.tokenizer_json).is_file():
            raise ValueError(f"tokenizer_json {self.tokenizer_json} is not a file")


@dataclass(frozen=True)
class LoadConfig:
    """One load run. Open loop: `rate` requests/s (math.inf: all at once), gamma gaps of shape
    `burstiness` (1: Poisson), at most `max_concurrency` in flight when set (an arrival waits for
    a free slot, as in `vllm bench serve`). Closed loop: `concurrency` workers back to back.
    Either stops after `num_requests` or `duration_s` (whichever comes first when both are set;
    in-flight requests always finish). `warmup` requests go first, unrecorded; `stream` False
    asks for whole responses; `percentiles` are reported for every latency."""

    base_url: str
    api: Api = "completions"
    model: str | None = None  # None: the first id from GET {base_url}/models
    api_key: str | None = None
    mode: Mode = "open"
    rate: float = 1.0
    concurrency: int = 1
    num_requests: int | None = 100
    duration_s: float | None = None
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    ignore_eos: bool = True
    seed: int = 0
    timeout_s: float = 300.0
    keepalive: bool = True  # reuse connections; False: one new connection per request
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    extra_body: Mapping[str, Any] = field(default_factory=dict)
    progress: bool = False
    burstiness: float = 1.0
    max_concurrency: int | None = None
    stream: bool = True
    warmup: int = 0
    percentiles: tuple[float, ...] = (50.0, 90.0, 95.0, 99.0)

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must be http(s)://..., got {self.base_url!r}")
        if self.api not in ("chat", "completions"):
            raise ValueError(f"api must be chat or completions, got {self.api!r}")
        if self.mode not in ("open", "closed"):
            raise ValueError(f"mode must be open or closed, got {self.mode!r}")
        if self.mode == "open" and not (self.rate > 0 and not math.isnan(self.rate)):
            raise ValueError("open loop needs rate > 0")
        if self.mode == "closed" and self.concurrency < 1:
            raise ValueError("closed loop needs concurrency >= 1")
        if self.num_requests is None and self.duration_s is None:
            raise ValueError("set num_requests, duration_s, or both")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError("num_requests must be >= 1")
        if self.duration_s is not None and self.duration_s <= 0:
            raise ValueError("duration_s must be > 0")
        if self.mode == "open" and math.isinf(self.rate) and self.num_requests is None:
            raise ValueError("an infinite rate needs num_requests")
        if not isinstance(self.extra_body, Mapping):
            raise ValueError("extra_body must be a JSON object")
        if self.timeout_s <= 0:
            raise ValueError("timeout_s must be > 0")
        if not (self.burstiness > 0 and math.isfinite(self.burstiness)):
            raise ValueError("burstiness must be a finite number > 0")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("max_concurrency must be >= 1")
        if self.warmup < 0:
            raise ValueError("warmup must be >= 0")
        if not self.percentiles or not all(0 < p <= 100 for p in self.percentiles):
            raise ValueError("percentiles must be in (0, 100]")

    @property
    def url_base(self) -> str:
        return self.base_url.rstrip("/")

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def parse_percentiles(text: str) -> tuple[float, ...]:
    """`50,90,99` -> (50.0, 90.0, 99.0), sorted, duplicates removed."""
    try:
        values = tuple(sorted({float(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        raise ValueError(f"bad percentiles {text!r}: expected numbers like 50,90,99") from None
    if not values or not all(0 < p <= 100 for p in values):
        raise ValueError(f"bad percentiles {text!r}: each must be in (0, 100]")
    return values
