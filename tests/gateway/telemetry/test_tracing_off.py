"""Tracing is optional: with no OTLP endpoint neither process imports opentelemetry."""

from __future__ import annotations

import subprocess
import sys

from tests.procs import ROOT

PROBE = """
import sys
from gateway.config import GatewayConfig
from gateway.service import GatewayState
from engine_worker.main import WorkerLoop
from engine_worker.config import WorkerConfig
import gateway.api.app, gateway.prompt.structured, gateway.prompt.tools, engine_worker.grammar

class Link:
    worker_id = "w"

    def open_outbound(self):
        return None

    def quiet(self, seconds, wait_s=1.0):
        pass

state = GatewayState(GatewayConfig())
class Engine:
    grammars = None

loop = WorkerLoop(WorkerConfig(), Engine(), Link(), None)
assert state.accounting.tracer is None and loop.tracer is None
print(sorted(m for m in sys.modules if m.startswith("opentelemetry")))
"""


def test_no_endpoint_means_no_tracer_and_no_opentelemetry_import() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
