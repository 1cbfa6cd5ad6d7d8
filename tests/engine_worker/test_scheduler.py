"""Scheduler: FCFS, continuous batching, chunked prefill, preemption, n > 1, finishing. No torch.

A fake model stands in for the engine: it writes each computed token into a fake paged KV cache
(through the block tables) and predicts the next token from what it reads back, so a wrong block
table or a stale cached block changes the output and fails the test.
"""

from __future__ import annotations

import pytest

from engine_worker.block_manager import BlockManager
from engine_worker.scheduler import RequestTooLarge, Scheduler
from engine_worker.sequence import Sequence, SequenceGroup, SequenceStatus
from engine_worker.step import ScheduledChunk
from protocol.messages import SamplingParams

BS = 4
EOS = 2


def make_scheduler(
    num_blocks: int = 64,
    *,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 256,
    prefix_caching: bool = True,
) -> Scheduler:
    return Scheduler(
        BlockManager(num_blocks, BS, enable_prefix_caching=prefix_caching),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        eos_token_ids=[EOS],
    )


def make_seq(request_id: str, prompt_len: int, max_tokens: int = 8, **params: object) -> Sequence:
    base = sum(map(ord, request_id)) * 10  # distinct prompts per request id
    prompt = [base + i for i in range(prompt_len)]
    return Sequence(request_id, prompt, SamplingParams(max_tokens=max_tokens, **params))


class FakeModel:
    """Paged 'attention' over a dict: (block id, offset) -> token id."""

    def __init__(self, block_size: int = BS) -> None:
        self.block_size = block_size
        self.kv: dict[tuple[int, int], int] = {}

    def _slot(self, seq: Sequence, pos: int) -> tuple[int, int]:
        return seq.block_table[pos // self.block_size], pos % self.block_size

    def run(self, chunks: list[ScheduledChunk]) -> list[int | None]:
        for c in chunks:  # write every chunk's K/V first, as one forward pass would
            for pos in range(c.start_pos, c.start_pos + c.num_tokens):
                self.kv[self._slot(c.seq, pos)] = c.seq.token_ids[pos]
        out: list[int | None] = []
        for c in chunks:
            if not c.sample:
                out.append(None)
                continue
            end = c.start_pos + c.num_tokens
            context = [self.kv[self._slot(c.seq, p)] for p in range(end)]
            assert context == c.seq.token_ids[:end], "KV cache does not hold the sequence"
            out.append(100 + (sum(context) * 7 + end * 13) % 50)  # never EOS
        return out


def step(sched: Scheduler, model: FakeModel) -> list[ScheduledChunk]:
    chunks = sched.schedule()
    sched.update(chunks, model.run(chunks))
    return chunks


def run_to_completion(
    sched: Scheduler, model: FakeModel | None = None, max_steps: int = 5000
) -> list[list[ScheduledChunk]]:
    model = model or FakeModel()
    steps = []
    while sched.has_work:
        steps.append(step(sched, model))
        assert steps[-1], "a step with work scheduled nothing"
        assert len(steps) < max_steps, "no progress"
    return steps


def test_waiting_requests_are_admitted_first_come_first_served() -> None:
    sched = make_scheduler(max_num_seqs=1)
    seqs = [make_seq(rid, 5, max_tokens=3) for rid in ("a", "b", "c")]
    for seq in seqs:
        sched.add(seq)
    first_seen: list[Sequence] = []
    for chunks in run_to_completion(sched):
        for c in chunks:
            if c.seq not in first_seen:
                first_seen.append(c.seq)
    assert first_seen == seqs


def test_waiting_head_that_cannot_allocate_blocks_the_queue() -> None:
    sched, model = make_scheduler(num_blocks=4), FakeModel()
    sched.add(make_seq("x", 8))
    step(sched, model)  # x: 9 tokens, 3 blocks once its decode slot is added
    big, small = make_seq("big", 12, 4), make_seq("small", 2)  # 3 blocks (cannot), 1 block (could)
    sched.add(big)
    sched.add(small)
    chunks = sched.schedule()
    assert {c.seq.request_id for c in chunks}.isdisjoint({"big", "small"})
    assert sched.num_waiting == 2


def test_request_added_mid_flight_joins_at_the_next_step() -> None:
    sched, model = make_scheduler(), FakeModel()
    a = make_seq("a", 6, max_tokens=20)
    sched.add(a)
    for _ in range(3):
        step(sched, model)
    b = make_seq("b", 10)
    sched.add(b)
    chunks = step(sched, model)
    by_seq = {c.seq.request_id: c for c in chunks}
    assert by_seq["a"].num_tokens == 1 and by_seq["a"].sample  # a keeps decoding
    assert by_seq["b"].start_pos == 0 and by_seq["b"].num_tokens == 10
    assert b.num_output_tokens == 1


def test_long_prompt_is_prefilled_in_chunks_while_another_decodes() -> None:
    budget = 8
    sched, model = make_scheduler(max_num_batched_tokens=budget), FakeModel()
    a = make_seq("a", 3, max_tokens=30)
    sched.add(a)
    step(sched, model)
    b = make_seq("b", 30, max_tokens=2)
    sched.add(b)
    b_chunks: list[ScheduledChunk] = []
    while b.num_output_tokens == 0:
        chunks = step(sched, model)
        assert sum(c.num_tokens for c in chunks) <= budget
        assert any(c.seq is a and c.num_tokens == 1 for c in chunks), "a skipped a decode"
        b_chunks += [c for c in chunks if c.seq is b]
    assert [c.num_tokens for c in b_chunks] == [7, 7, 7, 7, 2]
    assert [c.start_pos for c in b_chunks] == [0, 7, 14, 21, 28]
    assert [c.sample for c in b_chunks] == [False] * 4 + [True]


def _workload() -> list[Sequence]:
    lengths = [(5, 16), (12, 9), (3, 14), (9, 12), (7, 16), (11, 5), (4, 11)]
    seqs = [make_seq(f"r{i}", p, max_tokens=m) for i, (p, m) in enumerate(lengths)]
    seqs.append(Sequence("shared", seqs[1].prompt_token_ids, SamplingParams(max_tokens=10)))
    return seqs


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_under_a_tiny_block_budget_changes_no_output(prefix_caching: bool) -> None:
    def run(num_blocks: int) -> tuple[Scheduler, list[Sequence]]:
        sched = make_scheduler(num_blocks, max_num_batched_tokens=16, prefix_caching=prefix_caching)
        seqs = _workload()
        for seq in seqs:
            sched.add(seq)
        run_to_completion(sched)
        return sched, seqs

    roomy, reference = run(256)
    tight, seqs = run(8)  # the longest sequence alone needs 6 blocks
    assert roomy.preemptions == 0
    assert tight.preemptions > 0
    assert [s.output_token_ids for s in seqs] == [s.output_token_ids for s in reference]
    assert all(s.finish_reason == "length" for s in seqs)
    assert all(s.num_output_tokens == s.params.max_tokens for s in seqs)
    assert tight.block_manager.num_used_blocks == 0 and tight.num_running == 0
    assert not tight.has_work


def test_a_decode_without_a_free_block_preempts_the_newest_sequence() -> None:
    sched, model = make_scheduler(num_blocks=4), FakeModel()
    a, b, c = (make_seq(rid, 7, max_tokens=10) for rid in "abc")
    for seq in (a, b, c):
        sched.add(seq)
    step(sched, model)  # a, b prefilled: 2 blocks each, 8 tokens each; c waits
    step(sched, model)  # decode position 7: still in block 1
    chunks = step(sched, model)  # position 8 needs a third block each; none is free
    assert [ch.seq for ch in chunks] == [a]
    assert sched.preemptions == 1 and b.num_preemptions == 1
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0
    assert b.block_table == []
    assert sched.get("b") == [b] and sched.num_waiting == 2
    # b went back to the FRONT of the queue: it is re-admitted before c, which came later.
    order = [ch.seq for chunks in run_to_completion(sched, model) for ch in chunks]
    assert order.index(b) < order.index(c)
    assert [s.num_output_tokens for s in (a, b, c)] == [10, 10, 10]


def test_the_newest_sequence_preempts_itself_when_it_needs_the_block() -> None:
    sched, model = make_scheduler(num_blocks=4), FakeModel()
    a, b = make_seq("a", 5, max_tokens=10), make_seq("b", 8, max_tokens=9)
    sched.add(a)
    sched.add(b)
    step(sched, model)  # a: 6 tokens in 2 blocks; b: 9 tokens, needs a 3rd block next
    chunks = step(sched, model)
    assert [c.seq for c in chunks] == [a]
    assert b.status is SequenceStatus.WAITING and sched.preemptions == 1


def test_request_too_large_for_the_context_is_refused() -> None:
    sched = make_scheduler(max_model_len=32)
    with pytest.raises(RequestTooLarge, match="context length"):
        sched.add(make_seq("a", 30, max_tokens=3))
    sched.add(make_seq("b", 30, max_tokens=2))  # exactly fits
    assert sched.num_waiting == 1


def test_request_too_large_for_the_whole_cache_is_refused() -> None:
    sched = make_scheduler(num_blocks=4)  # 16 tokens of cache
    with pytest.raises(RequestTooLarge, match="KV blocks"):
        sched.add(make_seq("a", 10, max_tokens=8))
    sched.add(make_seq("b", 10, max_tokens=7))  # 16 tokens cached at most: fits
    assert issubclass(RequestTooLarge, ValueError)


def test_abort_frees_blocks_and_finishes_every_sequence_with_abort() -> None:
    sched, model = make_scheduler(max_num_seqs=1), FakeModel()
    group = SequenceGroup("g", [5, 6, 7, 8, 9], SamplingParams(max_tokens=8, n=2))
    for seq in group.seqs:
        sched.add(seq)
    sched.add(make_seq("other", 4))
    step(sched, model)
    assert sched.num_running == 1 and sched.num_waiting == 2
    aborted = sched.abort("g")
    assert aborted == group.seqs
    assert all(s.finish_reason == "abort" and s.is_finished for s in aborted)
    assert sched.block_manager.num_used_blocks == 0
    assert sched.get("g") == [] and sched.num_waiting == 1
    assert sched.abort("g") == []  # unknown or finished: nothing to do


def test_a_sequence_aborted_between_schedule_and_update_is_skipped() -> None:
    sched, model = make_scheduler(), FakeModel()
    sched.add(make_seq("a", 5))
    chunks = sched.schedule()
    sampled = model.run(chunks)
    sched.abort("a")
    assert sched.update(chunks, sampled) == []


def test_siblings_wait_for_the_leader_then_share_its_prompt_blocks() -> None:
    sched, model = make_scheduler(max_num_batched_tokens=8), FakeModel()
    prompt = list(range(1000, 1018))  # 18 tokens: 4 full blocks cover [0, 16)
    seqs = Scheduler.make_group("n3", prompt, SamplingParams(max_tokens=6, n=3))
    for seq in seqs:
        sched.add(seq)
    leader, siblings = seqs[0], seqs[1:]
    for _ in range(3):  # leader prefills 8 + 8 + 2 tokens
        chunks = step(sched, model)
        assert all(c.seq is leader for c in chunks)
    step(sched, model)  # siblings admitted
    assert [s.index for s in seqs] == [0, 1, 2]
    assert all(s.status is SequenceStatus.RUNNING for s in seqs)
    assert all(s.block_table[:4] == leader.block_table[:4] for s in siblings)
    assert len({s.block_table[4] for s in seqs}) == 3  # own tail blocks
    assert leader.num_prefilled_tokens_total == 18
    assert [s.num_prefilled_tokens_total for s in siblings] == [2, 2]
    assert [s.num_cached_tokens for s in seqs] == [0, 16, 16]
    run_to_completion(sched, model)
    assert all(s.num_output_tokens == 6 for s in seqs)
    assert sched.block_manager.num_used_blocks == 0


def test_max_num_seqs_caps_the_running_batch() -> None:
    sched, model = make_scheduler(max_num_seqs=2), FakeModel()
    for i in range(5):
        sched.add(make_seq(f"r{i}", 4, max_tokens=3))
    while sched.has_work:
        chunks = step(sched, model)
        assert sched.num_running <= 2
        assert len({c.seq.seq_id for c in chunks}) <= 2


def _finish_after(sched: Scheduler, seq: Sequence, tokens: list[int]) -> list[Sequence]:
    sched.add(seq)
    new: list[Sequence] = []
    for token in tokens:
        chunks = sched.schedule()
        new = sched.update(chunks, [token])
    return new


@pytest.mark.parametrize(
    "params, tokens, reason, num_out",
    [
        ({}, [7, EOS], "stop", 2),
        ({"stop_token_ids": [9]}, [7, 9], "stop", 2),
        ({"ignore_eos": True, "stop_token_ids": [9]}, [EOS, 9], "stop", 2),
        ({"max_tokens": 3}, [7, 7, 7], "length", 3),
        ({"max_tokens": 3, "ignore_eos": True}, [EOS, EOS, EOS], "length", 3),
    ],
)
def test_finish_reasons(params: dict, tokens: list[int], reason: str, num_out: int) -> None:
    sched = make_scheduler()
    seq = make_seq("a", 5, **{"max_tokens": 8, **params})
    new = _finish_after(sched, seq, tokens)
    assert new == [seq]
    assert seq.finish_reason == reason and seq.is_finished
    assert seq.num_output_tokens == num_out and seq.output_token_ids == tokens
    assert sched.block_manager.num_used_blocks == 0 and not sched.has_work


def test_sequence_keeps_running_until_a_finish_condition() -> None:
    sched = make_scheduler()
    seq = make_seq("a", 5, max_tokens=8)
    _finish_after(sched, seq, [7, 8])
    assert seq.status is SequenceStatus.RUNNING and seq.finish_reason is None
    assert sched.get("a") == [seq]


def test_budget_smaller_than_max_num_seqs_is_refused() -> None:
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        make_scheduler(max_num_seqs=8, max_num_batched_tokens=4)


def test_siblings_waiting_for_their_leader_do_not_hold_up_later_requests() -> None:
    sched, model = make_scheduler(max_num_batched_tokens=16), FakeModel()
    seqs = Scheduler.make_group("n2", list(range(1000, 1018)), SamplingParams(max_tokens=4, n=2))
    for seq in seqs:
        sched.add(seq)
    later = make_seq("later", 3, max_tokens=4)
    sched.add(later)
    chunks = step(sched, model)  # the leader's first 16 prompt tokens fill the budget
    assert [c.seq for c in chunks] == [seqs[0]]
    chunks = step(sched, model)  # the leader's last 2 tokens leave room for more
    # Before: the gated sibling at the head of the queue stopped every admission behind it.
    assert later in [c.seq for c in chunks]
    assert seqs[1].status is SequenceStatus.WAITING
    run_to_completion(sched, model)
    assert all(s.num_output_tokens == 4 for s in [*seqs, later])
    assert sched.block_manager.num_used_blocks == 0


def test_one_choice_can_be_aborted_while_its_siblings_go_on() -> None:
    sched, model = make_scheduler(), FakeModel()
    seqs = Scheduler.make_group("n3", list(range(1000, 1010)), SamplingParams(max_tokens=6, n=3))
    for seq in seqs:
        sched.add(seq)
    step(sched, model)  # the leader's prompt
    step(sched, model)  # the siblings join
    assert sched.abort_seq("n3", 1) is seqs[1]
    assert seqs[1].finish_reason == "abort" and not seqs[1].block_table
    assert sched.abort_seq("n3", 1) is None  # no longer live
    run_to_completion(sched, model)
    assert [s.finish_reason for s in seqs] == ["length", "abort", "length"]
    assert sched.block_manager.num_used_blocks == 0


def test_a_waiting_choice_can_be_aborted() -> None:
    sched, model = make_scheduler(), FakeModel()
    seqs = Scheduler.make_group("n2", list(range(1000, 1010)), SamplingParams(max_tokens=3, n=2))
    for seq in seqs:
        sched.add(seq)
    step(sched, model)  # only the leader runs: its sibling waits
    assert sched.abort_seq("n2", 1) is seqs[1]
    assert sched.num_waiting == 0
    run_to_completion(sched, model)
    assert seqs[0].num_output_tokens == 3 and sched.block_manager.num_used_blocks == 0


def test_the_leader_cannot_be_aborted_alone_before_its_prompt_is_computed() -> None:
    sched, model = make_scheduler(), FakeModel()
    seqs = Scheduler.make_group("n2", list(range(1000, 1010)), SamplingParams(max_tokens=3, n=2))
    for seq in seqs:
        sched.add(seq)
    assert sched.abort_seq("n2", 0) is None  # its sibling would wait for it forever
    run_to_completion(sched, model)
    assert [s.num_output_tokens for s in seqs] == [3, 3]
