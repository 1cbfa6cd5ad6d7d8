"""`kestrel-loadgen`: flags ──▶ LoadConfig (validated once) ──▶ run_load / run_sweep ──▶ reports.

    kestrel-loadgen run   --base-url URL --mode open --rate 4 --num-requests 100 ...
    kestrel-loadgen run   --base-url URL --mode closed --concurrency 8 --duration 60 ...
    kestrel-loadgen sweep --base-url URL --rates 1,2,4,8 --plot sweep.png ...
    kestrel-loadgen run   --rate 8 --burstiness 0.5 --max-concurrency 16 --dataset sharegpt.json
    kestrel-loadgen sweep --rates auto --points 6 --csv sweep.csv  (finds its own range)

The summary table goes to stdout, progress to stderr (so `> file` captures only the report).
Exit status: 0 after a run (whatever the server answered; the report says how it went), 1 when
the run could not start (e.g. GET /models failed), 2 for bad flags, 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import aiohttp

from loadgen.config import LengthDist, LoadConfig, WorkloadConfig, parse_percentiles
from loadgen.csv_out import summary_row, write_csv
from loadgen.report import format_table, markdown_section, markdown_table, write_markdown
from loadgen.runner import RunResult, run_load
from loadgen.sweep import (
    SWEEP_HEAD,
    SweepPoint,
    parse_rates,
    run_auto_sweep,
    run_sweep,
    sweep_rows,
)

DEFAULT_NUM_REQUESTS = 100


def _arg_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """Wrap a parser so argparse shows its own message ("bad length 'x': ...")."""
    def wrapped(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    wrapped.__name__ = parse.__name__
    return wrapped


def _json_object(text: str) -> dict[str, Any]:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object, got {text!r}")
    return value


def _common(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default=os.environ.get("KESTREL_LOADGEN_BASE_URL",
                                                        "http://127.0.0.1:8000/v1"),
                   help="OpenAI-compatible base URL, with /v1 (default: %(default)s)")
    g.add_argument("--api-key", default=os.environ.get("KESTREL_LOADGEN_API_KEY"),
                   help="sent as 'Authorization: Bearer KEY' (env KESTREL_LOADGEN_API_KEY)")
    g.add_argument("--model", help="model id (default: the first id from GET /models)")
    g.add_argument("--api", choices=["completions", "chat"], default="completions")
    g.add_argument("--no-ignore-eos", action="store_true",
                   help="do not send ignore_eos (for servers that reject it); outputs may be "
                        "shorter than --output-len")
    g.add_argument("--extra-body", type=_arg_type(_json_object), default={}, metavar="JSON",
                   help='extra request fields, e.g. \'{"temperature": 0}\'')
    g.add_argument("--timeout", type=float, default=300.0, help="per-request seconds")
    g.add_argument("--no-keepalive", action="store_true",
                   help="a new connection per request: for servers that close idle keep-alive "
                        "connections just as the client reuses one (llama.cpp's llama-server "
                        "failed a third of 16-stream requests so, 'Can not write request body')")

    g = p.add_argument_group("load shape")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="open loop: gamma inter-arrival shape (1: Poisson; < 1 burstier, "
                        "> 1 more regular; CV of the gaps = 1/sqrt(burstiness)), as in "
                        "vllm bench serve (default 1)")
    g.add_argument("--max-concurrency", type=int, metavar="N",
                   help="open loop: at most N requests in flight; an arrival waits for a slot")
    g.add_argument("--no-stream", action="store_true",
                   help="ask for whole responses (stream false): TTFT is then the whole latency")
    g.add_argument("--warmup", type=int, default=0, metavar="N",
                   help="send N requests first and leave them out of the results")

    g = p.add_argument_group("length of the run")
    g.add_argument("--num-requests", type=int,
                   help=f"requests to send (default {DEFAULT_NUM_REQUESTS} unless --duration)")
    g.add_argument("--duration", type=float, help="stop sending after this many seconds")

    g = p.add_argument_group("workload (lengths in tokens)")
    g.add_argument("--prompt-len", type=_arg_type(LengthDist.parse), default=LengthDist.fixed(128),
                   help="fixed:N or uniform:MIN,MAX (default: fixed:128)")
    g.add_argument("--output-len", type=_arg_type(LengthDist.parse), default=LengthDist.fixed(64),
                   help="fixed:N or uniform:MIN,MAX (default: fixed:64)")
    g.add_argument("--dataset", type=Path, metavar="FILE",
                   help="JSONL or a JSON array: objects with 'prompt' (text) or 'prompt_len', "
                        "and 'output_len'; or ShareGPT ('conversations') or OpenAI-style "
                        "('messages') conversations: the first user turn is sent, its reply's "
                        "length is the output length")
    g.add_argument("--tokenizer-json", type=Path,
                   help="a tokenizers JSON file: cut synthetic prompts to exact token counts")
    g.add_argument("--shared-prefix-frac", type=float, default=0.0, metavar="F",
                   help="fraction of requests that start with the same system prompt")
    g.add_argument("--shared-prefix-len", type=int, default=0, metavar="L",
                   help="length of that shared prompt in tokens")
    g.add_argument("--seed", type=int, default=0, help="fixes the schedule and the prompts")

    g = p.add_argument_group("report")
    g.add_argument("--slo-ttft-ms", type=float, help="goodput: TTFT target")
    g.add_argument("--slo-tpot-ms", type=float, help="goodput: TPOT target")
    g.add_argument("--out", type=Path, metavar="JSON",
                   help="write the results as JSON (sweep: default PLOT with .json)")
    g.add_argument("--percentiles", type=_arg_type(parse_percentiles),
                   default=(50.0, 90.0, 95.0, 99.0), metavar="P,P,...",
                   help="latency percentiles to report, e.g. 50,90,99 (default 50,90,95,99)")
    g.add_argument("--csv", type=Path, metavar="CSV",
                   help="write the summary as CSV (sweep: one row per point)")
    g.add_argument("--markdown", type=Path, metavar="MD", help="add a Markdown section here")
    g.add_argument("--markdown-mode", choices=["append", "write"], default="append")
    g.add_argument("--title", help="title of the Markdown section")
    g.add_argument("--no-progress", action="store_true", help="no progress line on stderr")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kestrel-loadgen", allow_abbrev=False,
        description="Load generator for OpenAI-compatible servers: open loop (Poisson arrivals) "
                    "or closed loop (fixed concurrency), streamed, with latency percentiles.")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="one load run (open or closed loop)", allow_abbrev=False)
    run.add_argument("--mode", choices=["open", "closed"], default="open",
                     help="open: Poisson arrivals at --rate; closed: --concurrency workers")
    run.add_argument("--rate", type=float, default=1.0,
                     help="open loop: mean requests/s (default 1); 'inf' sends all at once")
    run.add_argument("--concurrency", type=int, default=1, help="closed loop: workers (default 1)")
    run.add_argument("--no-records", action="store_true",
                     help="leave per-request records out of --out")
    _common(run)
    sweep = sub.add_parser("sweep", help="open-loop runs at several rates, and the hockey stick",
                           allow_abbrev=False)
    sweep.add_argument("--rates", type=_arg_type(_rates_or_auto), required=True,
                       help="offered loads in req/s, e.g. 1,2,4,8; or 'auto': find the "
                            "synchronous rate (one request at a time) and the saturating rate "
                            "(all at once), then sweep --points rates between them")
    sweep.add_argument("--points", type=int, default=5,
                       help="--rates auto: how many rates, both ends included (default 5)")
    sweep.add_argument("--plot", type=Path, default=Path("sweep.png"),
                       help="PNG to draw (default sweep.png)")
    sweep.add_argument("--cooldown", type=float, default=0.0, help="seconds between points")
    _common(sweep)
    return parser


def _rates_or_auto(text: str) -> list[float] | str:
    return "auto" if text.strip().lower() == "auto" else parse_rates(text)


def config_from_args(args: argparse.Namespace) -> LoadConfig:
    num = args.num_requests
    if num is None and args.duration is None:
        num = DEFAULT_NUM_REQUESTS
    workload = WorkloadConfig(args.prompt_len, args.output_len, args.dataset,
                              args.shared_prefix_frac, args.shared_prefix_len, args.tokenizer_json)
    return LoadConfig(
        base_url=args.base_url, api=args.api, model=args.model, api_key=args.api_key,
        mode=getattr(args, "mode", "open"), rate=getattr(args, "rate", 1.0),
        concurrency=getattr(args, "concurrency", 1), num_requests=num, duration_s=args.duration,
        workload=workload, ignore_eos=not args.no_ignore_eos, seed=args.seed,
        timeout_s=args.timeout, keepalive=not args.no_keepalive,
        slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms,
        extra_body=args.extra_body, progress=not args.no_progress,
        burstiness=args.burstiness, max_concurrency=args.max_concurrency,
        stream=not args.no_stream, warmup=args.warmup, percentiles=args.percentiles)


def _details(cfg: LoadConfig, model: str) -> str:
    w = cfg.workload
    lengths = (f"dataset `{w.dataset}`" if w.dataset else
               f"prompt {w.prompt_len}, output {w.output_len} tokens")
    prefix = (f", shared prefix {w.shared_prefix_len} tokens on {w.shared_prefix_frac:g} "
              "of requests" if w.shared_prefix_frac else "")
    return (f"`{cfg.base_url}` ({cfg.api}), model `{model}`, {lengths}{prefix}, seed {cfg.seed}, "
            f"ignore_eos {'on' if cfg.ignore_eos else 'off'}")


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {path}", file=sys.stderr)


async def _cmd_run(args: argparse.Namespace, cfg: LoadConfig) -> int:
    result: RunResult = await run_load(cfg)
    print(format_table(result.summary))
    if args.out:
        _write_json(args.out, result.to_dict(records=not args.no_records))
    if args.csv:
        write_csv(args.csv, [summary_row(result.summary)])
        print(f"wrote {args.csv}", file=sys.stderr)
    if args.markdown:
        load = (f"open loop {cfg.rate:g} req/s" if cfg.mode == "open"
                else f"closed loop x{cfg.concurrency}")
        title = args.title or f"Load test: {load}"
        write_markdown(args.markdown, markdown_section(result.summary, title,
                                                       _details(cfg, result.model)),
                       append=args.markdown_mode == "append")
    return 0


async def _cmd_sweep(args: argparse.Namespace, cfg: LoadConfig) -> int:
    from loadgen.plot import plot_sweep  # matplotlib only when a plot is drawn

    model: list[str] = []

    def on_point(point: SweepPoint, result: RunResult) -> None:
        model[:] = [result.model]
        s = point.summary
        print(f"rate {point.rate:g}: {s.request_throughput:.2f} req/s achieved, TTFT P99 "
              f"{s.ttft.p99:.0f} ms, E2E P99 {s.e2e.p99:.0f} ms, 429 {s.rejection_rate:.1%}",
              file=sys.stderr)

    def on_probe(name: str, result: RunResult) -> None:
        model[:] = [result.model]
        print(f"{name}: {result.summary.request_throughput:.2f} req/s", file=sys.stderr)

    if args.rates == "auto":
        result = await run_auto_sweep(cfg, args.points, cooldown_s=args.cooldown,
                                      on_point=on_point, on_probe=on_probe)
        print(f"synchronous rate {result.synchronous_rate:.3g} req/s, saturating rate "
              f"{result.max_rate:.3g} req/s")
    else:
        result = await run_sweep(cfg, args.rates, cooldown_s=args.cooldown, on_point=on_point)
    print(markdown_table(SWEEP_HEAD, sweep_rows(result)))
    if args.csv:
        write_csv(args.csv, [summary_row(p.summary, rate=p.rate) for p in result.points])
        print(f"wrote {args.csv}", file=sys.stderr)
    sat = (f"saturation at {result.saturation_rate:g} req/s: {result.saturation_reason}"
           if result.saturation_index is not None else "no saturation in the rates swept")
    print(sat)
    plot_sweep(result, args.plot, title=args.title or "kestrel load sweep")
    print(f"wrote {args.plot}", file=sys.stderr)
    # Every point's numbers are always kept: next to the plot unless --out says where.
    _write_json(args.out or args.plot.with_suffix(".json"),
                {"model": model[0] if model else cfg.model, "config": RunResult.config_dict(cfg),
                 **result.to_dict()})
    if args.markdown:
        image = os.path.relpath(args.plot.resolve(), args.markdown.resolve().parent)
        text = "\n".join([f"## {args.title or 'Load sweep'}", "",
                          _details(cfg, model[0] if model else str(cfg.model)), "",
                          markdown_table(SWEEP_HEAD, sweep_rows(result)), "",
                          f"Latencies in ms; `*` marks the {sat}." if result.saturation_index
                          is not None else sat + ".", "", f"![load sweep]({image})", ""])
        write_markdown(args.markdown, text + "\n", append=args.markdown_mode == "append")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cfg = config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    command = _cmd_run if args.command == "run" else _cmd_sweep
    try:
        return asyncio.run(command(args, cfg))
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except (RuntimeError, aiohttp.ClientError, OSError) as exc:
        print(f"kestrel-loadgen: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
