"""The gateway installs and runs without torch: start it where `import torch` fails."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx

from tests.procs import GatewayProc, WorkerProc

BLOCKER = '''
import sys

class _NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked for this gateway test")
        return None

sys.meta_path.insert(0, _NoTorch())
'''


def test_gateway_serves_where_torch_cannot_be_imported(tmp_path: Path,
                                                       tiny_model_dir: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text(BLOCKER)
    env = {"PYTHONPATH": str(tmp_path)}
    probe = subprocess.run([sys.executable, "-c", "import torch"], env={**os.environ, **env},
                           capture_output=True, text=True)
    assert probe.returncode != 0 and "torch is blocked" in probe.stderr
    with GatewayProc(env=env) as gw, WorkerProc(tiny_model_dir, gw.engine_address):
        gw.wait_ready()
        resp = httpx.post(gw.base_url + "/v1/chat/completions", timeout=30, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "ignore_eos": True})
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] == 4
        assert httpx.get(gw.base_url + "/metrics").status_code == 200
    assert "torch is blocked" not in gw.output()
