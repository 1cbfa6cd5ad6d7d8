"""Speculative decoding: decode speed with speculation off, n-gram lookup, and a draft model.

    python benchmarks/bench_speculative.py [--model default] [--draft tiny] [--batch 1,16]
        [--max-tokens 128] [--modes off,ngram,draft,draft@auto,draft@0.5] [--rounds 1]

Runs the engine in process (no HTTP), greedy, one workload at a time, alternating the modes
inside each (workload, batch) so a shared machine's drift hits them alike. Workloads:
  rewrite  input-grounded: rewrite a given ~300-token text, keeping every fact
  code     input-grounded: return a given function with a variable renamed
  write    code writing: a function from a one-line description, nothing to copy from
  chat     plain chat: an open question, nothing to copy from
Decode speed = output tokens after each request's first / time from the step where every
request had its first token to the end (prefill excluded; a draft model's pass over the prompt,
in the first decode step, included); "after the first step": the same from the end of the first
decode step (the steady state a long answer approaches); the medians over --rounds. Engine
steps = forward passes of the target in that span: a figure no other load on the machine moves.
Prints a markdown table with the speed-up over "off", the draft model's forward passes, and the
acceptance (accepted / proposed drafts, mean accepted per verify); with --rounds > 1, each
mode's ratio in each round to that round's own "off" run (the modes take turns, so a round's
pair shares the host's minute: its speed moves by a fifth within minutes on a 2-vCPU VM).
"draft@C" stops a round's drafts where the odds of the next one fall below C, "draft@auto"
below the measured price of a draft (--speculative-draft-confidence; the worker's default is
auto, "draft" here is 0);
"draft@auto/k6" drafts at most 6 a round (--k for the others);
"draft@auto:none" takes the draft as --draft-quantization none loads it (its file's own blocks;
the default, q4_0, is the worker's); "draft@auto~whole" its whole head every pass where the
worker would read only the vocabulary's hot prefix (engine_worker/speculative/hot_vocab.py).
--anatomy times every forward pass by model and rows and prints each mode's last run split that
way: where a speculative round's time goes (draft passes, the target's verifications by rows,
the rest), beside the plain run's one-row steps.

The default draft is the tiny random Llama (shares SmolLM2's tokenizer): its drafts are almost
never accepted, so it shows correctness and the backoff's cost, not a speed-up. A real draft pair
is a small and a large model of one family sharing a tokenizer, e.g. SmolLM2-135M drafting for
SmolLM2-1.7B, or Qwen2.5-0.5B for Qwen2.5-7B.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from engine_worker.config import cache_dir_from_env
from engine_worker.engine import Engine
from engine_worker.model.loader import gguf_source, resolve_checkpoint
from engine_worker.model.tokenizer import tokenizer_info
from engine_worker.model_runner import ModelRunner
from engine_worker.runner_config import RunnerConfig
from engine_worker.speculative import hot_vocab
from engine_worker.speculative.decoder import SpecDecoder
from engine_worker.speculative.draft import DraftModelProposer
from engine_worker.speculative.ngram import NgramProposer
from protocol import messages as m

TEXT = (
    "The kestrel is a small falcon that hunts over open country, farmland, heaths and the edges "
    "of towns. It is best known for hovering: it faces into the wind, spreads its tail and beats "
    "its wings fast enough to hold its head perfectly still while it scans the ground below for "
    "voles, mice, shrews, beetles and large insects. When it spots prey it drops in steps, then "
    "falls steeply with its wings half closed and takes the animal in its talons. A kestrel may "
    "hover and drop many times an hour, and in winter, when voles are scarce, it spends longer "
    "perched on posts and wires, watching instead of flying, to save energy. Kestrels do not "
    "build nests of their own. They lay their eggs in holes in trees, on cliff ledges, in the "
    "old nests of crows and magpies, and more and more often on buildings: church towers, "
    "bridges and the ledges of tall office blocks in the middle of cities. A pair usually "
    "raises four or five chicks, which leave the nest after about a month but stay near their "
    "parents for several weeks more while they learn to hunt. The species declined sharply in "
    "the second half of the twentieth century as farming changed and pesticides entered the "
    "food chain, and in some regions its numbers are still falling today."
)
CODE = '''def summarize(records, cutoff):
    totals = {}
    for rec in records:
        if rec["score"] < cutoff:
            continue
        name = rec["name"].strip().lower()
        totals[name] = totals.get(name, 0) + rec["score"]
    ranked = sorted(totals.items(), key=lambda item: item[1], reverse=True)
    best = [name for name, total in ranked[:10]]
    report = []
    for name in best:
        report.append(f"{name}: {totals[name]}")
    return "\\n".join(report)
'''
WORKLOADS = {
    "rewrite": "Rewrite the following text in clear, simple English. Keep every fact and keep "
               "the order of the sentences.\n\n" + TEXT,
    "code": "Rename the variable `totals` to `score_by_name` in this Python function and "
            "return the whole function, unchanged otherwise.\n\n```python\n" + CODE + "```",
    "write": "Write a Python function `merge_intervals(intervals)` that takes a list of "
             "(start, end) pairs and returns the list with overlapping intervals merged, sorted "
             "by start. Include a docstring and type hints.",
    "chat": "What are some good habits for staying productive when working from home? "
            "Give a detailed answer.",
}


def chat_ids(path: Path, text: str) -> list[int]:
    import jinja2
    from tokenizers import Tokenizer

    info = tokenizer_info(path)
    rendered = jinja2.Template(info.chat_template or "").render(
        messages=[{"role": "user", "content": text}], add_generation_prompt=True)
    return Tokenizer.from_str(info.tokenizer_json).encode(rendered,
                                                          add_special_tokens=False).ids


def run(runner: ModelRunner, spec: SpecDecoder | None, prompt: list[int], batch: int,
        max_tokens: int) -> tuple[float, int, SpecDecoder | None, list[int], float]:
    """(decode tok/s, engine steps after every request's first token, the spec decoder, the
    first request's output tokens, tok/s after the first decode step)."""
    out: list[int] = []
    e = Engine(runner, max_num_seqs=max(batch, 1), max_num_batched_tokens=2048, spec=spec)
    e.probe()  # as a worker does at start: the step costs a draft's price is weighed against
    for i in range(batch):
        # A distinct first token per request keeps the prefix cache from merging them.
        ids = [prompt[0]] + [100 + i] + prompt[1:]
        e.add(m.Generate(f"r{i}", ids, m.SamplingParams(max_tokens=max_tokens,
                                                        temperature=0.0, ignore_eos=True)))
    started: set[str] = set()
    t_first = t_second = None
    tokens_after = tokens_second = 0
    steps = 0
    while e.has_work:
        if t_first is not None:
            steps += 1
        outs = e.step()
        if t_second is not None:
            tokens_second += sum(len(o.token_ids) for o in outs)
        elif steps:  # the first decode step: a draft model's pass over the prompt is in it
            t_second = time.perf_counter()
        for o in outs:
            if o.request_id == "r0":
                out += o.token_ids
            if o.request_id in started:
                tokens_after += len(o.token_ids)
            elif o.token_ids:
                started.add(o.request_id)
                tokens_after += len(o.token_ids) - 1
        if t_first is None and len(started) == batch:
            t_first = time.perf_counter()
    assert t_first is not None and t_second is not None
    end = time.perf_counter()
    return (tokens_after / (end - t_first), steps, spec, out,
            tokens_second / (end - t_second))


def _anatomy(spent: dict[tuple[str, int], list[float]], wall: float) -> str:
    """One run's forward passes as 'model rows: count x mean ms', and what was outside them."""
    parts = [f"{name} {'>8' if rows == 9 else rows} rows: {len(ts)} x "
             f"{statistics.mean(ts) * 1e3:.2f} ms" for (name, rows), ts in sorted(spent.items())]
    inside = sum(sum(ts) for ts in spent.values())
    return "; ".join(parts) + f"; outside them {(wall - inside) * 1e3:.0f} ms of {wall:.2f} s"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--draft", default="tiny", help="draft checkpoint; 'tiny': tiny-llama-seed0")
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--modes", default="off,ngram,draft")
    ap.add_argument("--workloads", default="rewrite,code,chat")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-batch", type=int, default=4, help="--speculative-max-batch")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--draft-quantization", default="q4_0",
                    help="a GGUF draft's blocks re-quantized at load: q4_0 (the worker's auto) "
                    "or none; several (q4_0,none): a mode 'draft@auto:none' names one")
    ap.add_argument("--threads", type=int, default=0,
                    help="the worker's --threads: a fixed count (0: chosen while serving, the "
                    "worker's default, whose probes run some steps at fewer threads)")
    ap.add_argument("--anatomy", action="store_true",
                    help="time every forward pass by model and rows; print each mode's last run "
                    "(prefill and the start-up probe fall in the rows >8 bucket)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cache = cache_dir_from_env()
    path = resolve_checkpoint(args.model, cache, weights=gguf_source(args.model) is None)
    # the target as a worker serves it by default (a GGUF from its own blocks)
    cfg = RunnerConfig.from_settings(args.model, kv_cache_mb=256, cache_dir=str(cache),
                                     threads=args.threads)
    runner = ModelRunner(cfg)
    modes = args.modes.split(",")
    passes = [0]

    def counted(execute):  # the draft model's forward passes: a count no VM noise moves
        def run(items, **kw):
            passes[0] += 1
            return execute(items, **kw)
        return run

    spent: dict[tuple[str, int], list[float]] = {}  # (model, rows; 9: more) -> pass times

    def timed(name: str, execute):  # --anatomy: every forward pass's time, by model and rows
        def run(items, **kw):
            t = time.perf_counter()
            try:
                return execute(items, **kw)
            finally:
                rows = sum(len(it.token_ids) for it in items)
                spent.setdefault((name, min(rows, 9)), []).append(time.perf_counter() - t)
        return run

    if args.anatomy:
        runner.execute = timed("target", runner.execute)
    drafts: dict[str, ModelRunner] = {}  # by --draft-quantization
    hots: dict[str, hot_vocab.HotHead | None] = {}  # their heads over the hot prefix, as built
    if any(mo.startswith("draft") for mo in modes):
        texts = hot_vocab.texts_of(path, runner.config.vocab_size)
        dgguf = None if args.draft == "tiny" else gguf_source(args.draft)
        dpath = cache / "tiny-llama-seed0" if args.draft == "tiny" else resolve_checkpoint(
            args.draft, cache, weights=dgguf is None)
        for rq in args.draft_quantization.split(","):
            draft = ModelRunner(replace(cfg.for_draft(dpath, dgguf, rq),
                                        kv_budget_bytes=128 << 20))
            draft.execute = counted(timed("draft", draft.execute) if args.anatomy
                                    else draft.execute)
            drafts[rq] = draft
            hots[rq] = hot_vocab.attach(draft.model, texts)  # as the worker's builder does

    def make(mode: str) -> SpecDecoder | None:
        if mode == "off":
            return None
        k = args.k
        mode, _, kk = mode.partition("/k")  # "mode/kN": at most N drafts a round, not --k
        if kk:
            kk, colon, rq = kk.partition(":")
            k, mode = int(kk), mode + colon + rq
        if mode == "ngram":
            proposer = NgramProposer()
        else:  # "draft": k drafts a round; "draft@C": stop where the next one's odds < C;
            # "...:Q": the draft re-quantized to Q (default: the first --draft-quantization);
            # "...~whole": its whole head every pass (not the hot prefix where it has one)
            mode, whole, _ = mode.partition("~")
            mode, _, rq = mode.partition(":")
            conf = mode.partition("@")[2] or "0"
            rq = rq or next(iter(drafts))
            proposer = DraftModelProposer(drafts[rq], min_confidence=None if conf == "auto"
                                          else float(conf), hot=None if whole else hots[rq])
        return SpecDecoder(proposer, k, max_batch=args.max_batch, min_acceptance=0.3)

    # Warm-up: first calls of oneDNN kernels are slow.
    run(runner, make("ngram"), chat_ids(path, "Hi"), 1, 8)
    # As the worker does once loaded (engine_worker/main.py): what start-up built is out of the
    # collector's sight, so a full collection does not walk it mid-run (unfrozen, the 0.5B's
    # one-row pass spent ~5 % of its samples in gc_collect_main)
    gc.collect()
    gc.freeze()
    print(f"model {path.name}, k={args.k}, speculative max batch {args.max_batch}, greedy, "
          f"draft {args.draft} ({args.draft_quantization}), "
          f"{args.max_tokens} new tokens, torch threads {torch.get_num_threads()}\n")
    print("| workload | batch | mode | decode tok/s | vs off | after the first step | vs off "
          "| engine steps | draft passes | accepted/proposed | accepted per verify "
          "| same text as off |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for wl in args.workloads.split(","):
        prompt = chat_ids(path, WORKLOADS[wl])
        for batch in (int(b) for b in args.batch.split(",")):
            speeds: dict[str, list[float]] = {mo: [] for mo in modes}
            steady: dict[str, list[float]] = {mo: [] for mo in modes}
            stats: dict[str, str] = {}
            steps: dict[str, int] = {}
            drafted: dict[str, int] = {}
            texts: dict[str, list[int]] = {}
            anatomy: dict[str, str] = {}
            for _ in range(args.rounds):
                for mode in modes:
                    passes[0] = 0
                    spent.clear()
                    t_run = time.perf_counter()
                    tps, steps[mode], spec, texts[mode], later = run(
                        runner, make(mode), prompt, batch, args.max_tokens)
                    if args.anatomy:
                        anatomy[mode] = _anatomy(spent, time.perf_counter() - t_run)
                    drafted[mode] = passes[0]
                    speeds[mode].append(tps)
                    steady[mode].append(later)
                    if spec is not None:
                        s = spec.stats
                        rate = s.accepted / s.proposed if s.proposed else 0.0
                        per = s.accepted / s.verify_steps if s.verify_steps else 0.0
                        stats[mode] = f"{s.accepted}/{s.proposed} ({rate:.0%}) | {per:.2f}"
            # Medians: on a shared machine one slow round should not decide a row.
            base = statistics.median(speeds["off"]) if "off" in speeds else None
            base2 = statistics.median(steady["off"]) if "off" in steady else None
            for mode in modes:
                tps, later = statistics.median(speeds[mode]), statistics.median(steady[mode])
                ratio = f"{tps / base:.2f}x" if base else "-"
                ratio2 = f"{later / base2:.2f}x" if base2 else "-"
                same = "-" if "off" not in texts else (
                    "yes" if texts[mode] == texts["off"] else "NO")
                print(f"| {wl} (prompt {len(prompt)}) | {batch} | {mode} | {tps:.1f} | {ratio} | "
                      f"{later:.1f} | {ratio2} | {steps[mode]} | {drafted[mode]} | "
                      f"{stats.get(mode, '- | -')} | {same} |", flush=True)
            if "off" in speeds and args.rounds > 1:  # each round against its own plain run
                for mode in modes:
                    if mode != "off":
                        pairs = ", ".join(
                            f"{a / b:.2f}x ({c / d:.2f}x)" for a, b, c, d in zip(
                                speeds[mode], speeds["off"], steady[mode], steady["off"],
                                strict=True))
                        print(f"\n{wl}, {mode} against the same round's off: {pairs}",
                              flush=True)
            for mode, line in anatomy.items():
                print(f"\n{wl}, {mode}, the last run's passes: {line}", flush=True)


if __name__ == "__main__":
    main()
