"""kestrel-loadgen: a load generator for OpenAI-compatible servers (ours, vLLM, any other).

    LoadConfig ──run_load──▶ RunResult(records, summary) ──report──▶ table / JSON / Markdown
    LoadConfig + rates ──run_sweep──▶ SweepResult ──plot──▶ hockey-stick PNG

From Python (a test against a running server, say):

    result = asyncio.run(run_load(LoadConfig(base_url="http://127.0.0.1:8000/v1", mode="closed",
                                             concurrency=4, num_requests=20)))
    result.summary.completion_tokens, [r.n_chunks for r in result.records]
"""

from loadgen.config import LengthDist, LoadConfig, WorkloadConfig
from loadgen.record import RequestRecord
from loadgen.report import Summary, summarize
from loadgen.runner import RunResult, run_load
from loadgen.sweep import SweepResult, run_sweep

__all__ = ["LengthDist", "LoadConfig", "RequestRecord", "RunResult", "Summary", "SweepResult",
           "WorkloadConfig", "run_load", "run_sweep", "summarize"]
