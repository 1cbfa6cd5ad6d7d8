"""The step costs a worker's start probe measured, kept in the cache dir so that a later start of
the same model on the same host begins from them instead of measuring again (3.4 s of the 1.5B
Qwen's start on a 2-core Zen 5).

    start ──ProbeRecord.for_runner(cache_dir, runner, worker settings)──▶ a record keyed by the
        host (CPU model, flags, cores, caps), torch, the threads, the model file and every
        setting that changes a step's cost (dtype, device, paths, batch, block size, context)
    found and valid? StepCosts.seed(its points) : Engine.probe(), then save(points)

A record is a start, not a verdict: every step the worker serves refines the figures as it
refines a fresh probe's (an EWMA per bucket), so a record measured on a busy first start does not
size steps for good. Records are written through a temporary file and a rename.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from engine_worker import kernel_build
from engine_worker.kernel_build import _cpu_flags
from engine_worker.step_costs import StepCosts

log = logging.getLogger("kestrel.engine")

FORMAT = 2  # bump when the probe's shapes or what a point means change
CAP_VARS = ("KESTREL_CPU_ISA", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


class ProbeRecord:
    def __init__(self, path: Path) -> None:
        self.path = path

    @classmethod
    def for_runner(cls, cache_dir: Path, runner: Any, settings: dict[str, Any]) -> ProbeRecord:
        """The record of this runner's model on this host with these settings."""
        rc = runner.runner_config
        model = Path(rc.gguf_path or rc.model_path)
        st = model.stat()
        key = {
            "format": FORMAT, "cpu": _cpu_model(), "flags": _cpu_flags(),
            "cores": os.cpu_count(), "caps": {v: os.environ.get(v, "") for v in CAP_VARS},
            "torch": torch.__version__, "threads": torch.get_num_threads(),
            "kernels": kernel_build.sources_digest(),
            "model": [str(model.resolve()), st.st_size, st.st_mtime_ns],
            "dtype": runner.dtype_name, "device": str(runner.device),
            "paged": runner.paged_decode, "stack": runner.use_stack, "plan": runner.plan.describe(),
            "compiled": runner.compiled is not None, "block_size": runner.block_size,
            # the probe's decode context is 16 blocks, shorter only in a shorter context; the
            # cache's size is no cost (a --kv-cache-memory fraction differs at every start)
            "context": min(runner.max_model_len, 16 * runner.block_size + 1),
            **settings,
        }
        digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode())
        return cls(Path(cache_dir) / "step_costs" / f"{digest.hexdigest()[:24]}.json")

    def seed(self, costs: StepCosts) -> bool:
        """Start `costs` from the record; False if there is none, or it is not valid."""
        try:
            data = json.loads(self.path.read_text())
            costs.seed(data["points"])
        except (OSError, ValueError, KeyError, TypeError):
            return False
        log.info("step costs from this host's earlier probe (%s); serving refines them",
                 time.strftime("%Y-%m-%d %H:%M", time.gmtime(data.get("measured", 0))))
        return True

    def save(self, costs: StepCosts) -> None:
        """Keep what `costs` learned; a cache dir that cannot be written is only logged."""
        body = json.dumps({"measured": time.time(), "points": costs.points()}).encode()
        tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_bytes(body)
            os.replace(tmp, self.path)
        except OSError as exc:
            log.warning("step costs not kept under %s: %s", self.path.parent, exc)
        finally:
            tmp.unlink(missing_ok=True)
