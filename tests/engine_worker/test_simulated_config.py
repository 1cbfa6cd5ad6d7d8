"""The simulated worker runs the real worker loop (engine_worker/main.py: serve, WorkerLoop), so
its config must carry every setting that loop reads from a WorkerConfig. Once it did not
(otlp_endpoint, read directly by WorkerLoop): every simulated worker died at start, and each test
on them waited 90 s for a worker that never joined."""

from __future__ import annotations

import dataclasses
import inspect
import re

from engine_worker import main
from engine_worker.simulated import SimWorkerConfig


def test_the_simulated_config_has_every_setting_the_worker_loop_reads() -> None:
    source = inspect.getsource(main.WorkerLoop) + inspect.getsource(main.serve) + \
        inspect.getsource(main.open_link)
    read = set(re.findall(r"\bcfg\.([a-z_]+)", source))
    fields = {f.name for f in dataclasses.fields(SimWorkerConfig)}
    assert read and read <= fields, sorted(read - fields)
