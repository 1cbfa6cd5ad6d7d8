"""The worker in its image against the same worker on the host: same model, same flags, same load.

    podman and the images first (README, "Images with podman"), then:
    CONTAINERS_CONF=... PODMAN="podman --runtime runc --cgroup-manager cgroupfs" \\
        .venv/bin/python benchmarks/bench_container.py --out benchmarks/results/X.json

Each mode starts compose's gateway and worker (the services' commands, environment and CURVE
secrets from deploy/docker-compose.yml), on host networking: `host` runs those commands with this
checkout's .venv, `container` runs the two images. A warm-up request, then for each concurrency
C, C streamed completions of --tokens tokens at temperature 0 with ignore_eos, --rounds times:
inter-token gaps (ITL) and time to first token per mode, the container's ITL over the host's, and
the worker's log lines that name its compute paths (what the two must share). Run nothing else
while it times.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import openai

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine_worker.config import default_cache_dir  # noqa: E402
from tests.deploy.compose_files import project  # noqa: E402
from tests.deploy.test_images_run import (  # noqa: E402
    IMAGES,
    SERVICES,
    container,
    podman,
    ready,
    run_args,
    secrets_dir,
)
from tests.procs import free_port  # noqa: E402

PATH_WORDS = ("kernel", "decode attention", "int-dot", "int_dot", "decode stack", "matmul",
              "threads", "C++")
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def host_command(name: str, secrets: Path, env: dict[str, str]) -> tuple[list[str], dict]:
    """A compose service's command and environment run on this host: /run/secrets/X become the
    files make-secrets.sh wrote, the container's /models this host's cache."""
    svc = SERVICES[name]
    files = {f"/run/secrets/{k}": str(secrets / v["file"].removeprefix("./secrets/"))
             for k, v in project()["secrets"].items()}
    for volume in svc.get("volumes", []):
        src, dst = volume.split(":")[:2]
        files[dst] = str(secrets / src.removeprefix("./secrets/"))
    cmd = [files.get(a, a) for a in svc["command"]]
    cmd[0] = str(ROOT / ".venv/bin/python")
    merged = {k: files.get(str(v), str(v)) for k, v in svc["environment"].items()}
    merged.pop("KESTREL_CACHE_DIR", None)  # the host's own cache (the converted model is there)
    return cmd, {**os.environ, **merged, **env, "PYTHONPATH": str(ROOT)}


def stream_once(client: openai.OpenAI, model: str, tokens: int) -> tuple[float, list[float]]:
    t0 = time.perf_counter()
    stamps = []
    stream = client.completions.create(model=model, prompt=PROMPT, max_tokens=tokens,
                                       temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            stamps.append(time.perf_counter())
    ttft = stamps[0] - t0
    return ttft, [b - a for a, b in zip(stamps, stamps[1:], strict=False)]


def load(base: str, key: str, concurrency: int, tokens: int, rounds: int) -> dict:
    client = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    stream_once(client, model, 8)  # warm-up
    ttfts: list[float] = []
    gaps: list[float] = []
    lock = threading.Lock()

    def one() -> None:
        ttft, g = stream_once(client, model, tokens)
        with lock:
            ttfts.append(ttft)
            gaps.extend(g)

    for _ in range(rounds):
        threads = [threading.Thread(target=one) for _ in range(concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    q = statistics.quantiles(gaps, n=100)
    return {"concurrency": concurrency, "streams": len(ttfts), "gaps": len(gaps),
            "itl_p50_ms": round(1000 * q[49], 2), "itl_p99_ms": round(1000 * q[98], 2),
            "itl_mean_ms": round(1000 * statistics.fmean(gaps), 2),
            "ttft_p50_ms": round(1000 * statistics.median(ttfts), 1)}


def run_mode(mode: str, secrets: Path, args: argparse.Namespace) -> dict:
    http, link = free_port(), free_port()
    gw_env = {"PORT": str(http), "KESTREL_HOST": "127.0.0.1",
              "KESTREL_ENGINE_ADDRESS": f"tcp://127.0.0.1:{link}"}
    wk_env = {"KESTREL_GATEWAY_ADDRESS": f"tcp://127.0.0.1:{link}", **args.worker_env}
    base = f"http://127.0.0.1:{http}"
    procs: list[subprocess.Popen] = []
    started: list[str] = []
    logdir = Path(tempfile.mkdtemp(prefix=f"kestrel-bench-{mode}-"))
    try:
        for name, env in (("gateway", gw_env), ("worker", wk_env)):
            if mode == "host":
                cmd, full_env = host_command(name, secrets, env)
                out = open(logdir / f"{name}.log", "w")  # noqa: SIM115 (closed with the process)
                procs.append(subprocess.Popen(cmd, env=full_env, cwd=ROOT, stdout=out,
                                              stderr=subprocess.STDOUT))
            else:
                cmd = run_args(name, secrets, env)
                if name == "worker" and args.share_path_choice:
                    at = cmd.index(IMAGES["worker"])
                    cmd[at:at] = ["-v", f"{default_cache_dir()}/paths:/models/paths:ro"]
                run = podman(*cmd)
                assert run.returncode == 0, run.stderr
                started.append(name)
            if name == "gateway":
                time.sleep(2)
        t0 = time.monotonic()
        while not ready(base):
            assert time.monotonic() - t0 < 300, f"{mode}: not ready in 300 s"
            time.sleep(0.5)
        key = (secrets / "api_keys").read_text().split()[0]
        rows = [load(base, key, c, args.tokens, args.rounds) for c in args.concurrency]
    finally:
        if mode == "host":
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait(timeout=60)
            worker_log = (logdir / "worker.log").read_text()
        else:
            out = podman("logs", container("worker"))
            worker_log = out.stdout + out.stderr
            for name in started:
                podman("rm", "-f", "-t", "0", container(name), timeout=60)
    paths = [line.split(" ", 3)[-1] for line in worker_log.splitlines()
             if any(w in line for w in PATH_WORDS)]
    return {"mode": mode, "rows": rows, "paths": paths}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")],
                    default=[1, 4])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--modes", default="host,container")
    ap.add_argument("--worker-env", action="append", default=[], metavar="KEY=VALUE",
                    help="set in both modes' worker (a path flag both must share, say)")
    ap.add_argument("--share-path-choice", action="store_true",
                    help="the container reads the host's measured compute-path choice (this "
                         "host's cache, read-only) instead of measuring its own at start")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    args.worker_env = dict(kv.split("=", 1) for kv in args.worker_env)
    for image in IMAGES.values():
        assert podman("image", "exists", image).returncode == 0, f"no image {image}"
    with tempfile.TemporaryDirectory() as tmp:
        secrets = secrets_dir(Path(tmp))
        results = [run_mode(m, secrets, args) for m in args.modes.split(",")]
    cpu = next((line.split(":", 1)[1].strip() for line in
                Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")),
               platform.processor())
    report = {"cpu": cpu, "cores": os.cpu_count(), "tokens": args.tokens,
              "worker_env": args.worker_env, "share_path_choice": args.share_path_choice,
              "rounds": args.rounds, "results": results}
    by_mode = {r["mode"]: r for r in results}
    if {"host", "container"} <= by_mode.keys():
        report["container_over_host_itl_p50"] = [
            round(c["itl_p50_ms"] / h["itl_p50_ms"], 3)
            for h, c in zip(by_mode["host"]["rows"], by_mode["container"]["rows"],
                            strict=True)]
    for r in results:
        print(f"== {r['mode']}")
        for line in r["paths"]:
            print("   ", line)
        for row in r["rows"]:
            print("   ", row)
    print(json.dumps({k: v for k, v in report.items() if k != "results"}, indent=1))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
