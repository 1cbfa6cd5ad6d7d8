"""engine_worker/thread_choice.py alone, on step times made up by a host model (no threads are
changed: the setter is a recorder), and wired into the runner of the stack-served SmolLM2 GGUF."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine_worker.thread_choice import ThreadChoice


def serve(choice: ThreadChoice, ms_at: dict[int, float], steps: int, rows: int = 1) -> list[int]:
    """Run `steps` decode steps whose time depends only on the thread count; the counts used."""
    used = []
    for _ in range(steps):
        t = choice.threads()
        used.append(t)
        choice.record(rows, ms_at[t] / 1e3)
    return used


def test_a_shared_host_moves_to_fewer_threads_and_a_quiet_one_stays() -> None:
    calls: list[int] = []
    busy = ThreadChoice(2, every=50, probe=4, first=10, set_threads=calls.append)
    used = serve(busy, {2: 25.0, 1: 18.0}, 200)
    assert busy.current == 1 and used[-1] == 1
    assert used[:10] == [2] * 10 and used[10:15] == [1] * 5  # the first probe, then kept
    assert calls[0] == 1  # torch's count was set for the probe
    quiet = ThreadChoice(2, every=50, probe=4, first=10, set_threads=lambda n: None)
    used = serve(quiet, {2: 10.0, 1: 17.0}, 200)
    assert quiet.current == 2
    assert used.count(1) == 4 * 5  # four probes of 1 + 4 steps each in 200 steps


def test_a_host_that_changes_is_followed_both_ways() -> None:
    c = ThreadChoice(2, every=40, probe=4, first=10, set_threads=lambda n: None)
    serve(c, {2: 25.0, 1: 18.0}, 120)  # a neighbour holds a core
    assert c.current == 1
    serve(c, {2: 10.0, 1: 17.0}, 120)  # it left
    assert c.current == 2


def test_a_difference_within_the_margin_changes_nothing() -> None:
    c = ThreadChoice(2, every=20, probe=4, first=5, margin=0.05, set_threads=lambda n: None)
    serve(c, {2: 10.0, 1: 9.7}, 200)
    assert c.current == 2


def test_the_step_after_a_change_is_not_counted() -> None:
    c = ThreadChoice(2, every=100, probe=2, first=1, set_threads=lambda n: None)
    c.threads()
    c.record(1, 0.010)  # at 2 threads: counted; a probe of 1 thread is due
    assert c.threads() == 1
    c.record(1, 5.0)  # threads waking: not counted
    for _ in range(2):
        assert c.threads() == 1
        c.record(1, 0.008)
    assert c.means[(1, 1)] == pytest.approx(0.008) and c.current == 1


def test_rows_are_compared_within_their_bucket() -> None:
    c = ThreadChoice(2, every=100, probe=2, first=2, set_threads=lambda n: None)
    for _ in range(2):
        c.threads()
        c.record(16, 0.050)  # 16 rows at 2 threads
    for _ in range(3):
        c.threads()
        c.record(1, 0.020)  # probe steps at 1 thread, of 1 row: no figure at 16 rows to beat
    assert c.current == 2 and (1, 1) in c.means and (1, 16) not in c.means


@pytest.mark.smollm
def test_the_runner_of_a_stack_served_gguf_measures_its_decode_steps(
        int_dot_kernel: None, cache_dir: Path) -> None:
    from engine_worker.model_runner import ModelRunner
    from engine_worker.runner_config import RunnerConfig
    from engine_worker.step import StepItem
    threads = torch.get_num_threads()
    if threads < 2:
        pytest.skip("one thread here: nothing to choose")
    try:
        runner = ModelRunner(RunnerConfig.from_settings("default", kv_cache_mb=16,
                                                        max_num_seqs=4))
        if runner.decode_stack is None:
            pytest.skip("no decode stack here")
        assert runner.thread_choice is not None
        runner.execute([StepItem([1, 2, 3], 0, [0])])  # a prefill: not a decode step
        assert runner.thread_choice.means == {}
        for pos in range(3, 6):
            runner.execute([StepItem([7], pos, [0])])
        assert set(runner.thread_choice.means) == {(threads, 1)}
        fixed = ModelRunner(RunnerConfig.from_settings("default", kv_cache_mb=16,
                                                       max_num_seqs=4, threads=threads))
        assert fixed.thread_choice is None  # --threads N: fixed
    finally:
        torch.set_num_threads(threads)
