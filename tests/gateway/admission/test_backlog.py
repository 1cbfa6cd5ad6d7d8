"""gateway/admission/backlog.py: when a request would finish behind the work admitted before it, and
what it costs the deadlines admitted before it."""

from __future__ import annotations

import pytest

from gateway.admission.backlog import MARGIN, Backlog, Capacity, Work, capacity_of
from protocol import messages as m

# 0.1 s a decode step at one row, 0.15 s at sixteen; 1 ms a prompt row.
COSTS = m.StepCosts([(1.0, 0.1), (16.0, 0.1)], [(16, 0.001)], 0.5, 512)


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def backlog(seats: int = 2, workers: int = 1, costs: m.StepCosts | None = COSTS) -> Backlog:
    cap = None if costs is None else Capacity(costs, seats, workers)
    return Backlog(lambda model: cap if model == "m" else None, Clock())


def finish(b: Backlog, w: Work) -> float:
    d = b.decide(w)
    assert d is not None
    return d.finish_s


def test_alone_a_request_takes_its_prompt_and_its_tokens() -> None:
    b = backlog()
    w = Work("m", prompt_tokens=100, max_tokens=10)
    assert finish(b, w) == pytest.approx(MARGIN * (100 * 0.001 + 10 * 0.1))
    assert b.idle_s(w) == pytest.approx(100 * 0.001 + 10 * 0.1)  # no margin


def test_a_burst_not_yet_running_counts_in_full_seats_included() -> None:
    """Two seats: the third request of a burst waits for the first to finish its 10 tokens,
    although none of them has reached a worker yet."""
    b = backlog(seats=2)
    works = [Work("m", 10, 10) for _ in range(3)]
    for w in works:
        b.add(w)
    first, second, third = (finish(b, w) for w in works)
    assert second > first  # the prompt ahead of it
    assert third == pytest.approx(MARGIN * (30 * 0.001 + (10 + 10) * 0.1))
    assert len(b.ahead_of(works[2])) == 2 and b.ahead_of(works[0]) == []


def test_what_a_running_request_has_produced_no_longer_counts() -> None:
    b = backlog(seats=1)
    running = Work("m", 10, 100)
    b.add(running)
    new = Work("m", 10, 10)
    before = finish(b, new)
    running.generated = lambda: 90  # its prompt is done and 10 tokens are left
    after = finish(b, new)
    assert after == pytest.approx(MARGIN * (10 * 0.001 + (10 + 10) * 0.1)) and after < before
    b.remove(running)
    assert finish(b, new) == pytest.approx(MARGIN * (10 * 0.001 + 10 * 0.1))


def test_a_later_admission_spends_the_slack_of_the_deadlines_before_it() -> None:
    """A request with 1 s of work (margin included) due in 1 s more than that has 1 s to spare:
    a later one whose prompt would add more than that to its steps is refused, however loose
    its own deadline; a smaller one is admitted, and spends what it adds."""
    b = backlog(seats=4)
    tight = Work("m", 0, 10, deadline=b._clock() + MARGIN * 1.0 + 1.0)
    b.add(tight)
    b.commit(tight, b.decide(tight))
    assert tight.slack == pytest.approx(1.0)
    rows_over = int(1.2 / (MARGIN * 0.001))  # adds 1.2 s to tight's steps
    big = Work("m", rows_over, 1, deadline=b._clock() + 1000)
    decision = b.decide(big)
    assert decision is not None and decision.short_by == pytest.approx(0.2, abs=0.01)
    small = Work("m", int(0.4 / (MARGIN * 0.001)), 1, deadline=b._clock() + 1000)  # 0.4 s
    fits = b.decide(small)
    assert fits is not None and fits.short_by <= 0
    b.add(small)
    b.commit(small, fits)
    assert b.spent == pytest.approx(0.4, abs=0.01)
    assert b.decide(Work("m", int(0.7 / (MARGIN * 0.001)), 1)).short_by > 0  # 0.4 + 0.7 > 1


def test_other_models_and_unmeasured_models_do_not_count() -> None:
    b = backlog(seats=1)
    b.add(Work("other", 10, 1000))
    assert finish(b, Work("m", 10, 10)) == pytest.approx(MARGIN * (0.01 + 1.0))
    assert b.decide(Work("other", 10, 10)) is None  # no costs reported for it
    assert backlog(costs=None).decide(Work("m", 10, 10)) is None


def test_n_choices_take_n_seats_and_the_slowest_worker_stands_for_all() -> None:
    b = backlog(seats=2)
    b.add(Work("m", 10, 10, n=2))  # both seats until its 10 tokens
    assert finish(b, Work("m", 10, 10)) == pytest.approx(MARGIN * (20 * 0.001 + 20 * 0.1))
    fast = m.StepCosts([(1.0, 0.01)], [(16, 0.001)], 0.5, 512)
    cap = capacity_of([(fast, 4), (COSTS, 4), (None, 8)])
    assert cap is not None and cap.costs is COSTS and (cap.seats, cap.workers) == (16, 3)
    assert capacity_of([(None, 4)]) is None


def test_deciding_again_after_tokenizing_does_not_count_its_own_cost_twice() -> None:
    b = backlog(seats=4)
    tight = Work("m", 0, 10, deadline=b._clock() + MARGIN * 1.0 + 1.0)  # 1 s to spare
    b.add(tight)
    b.commit(tight, b.decide(tight))
    later = Work("m", int(0.75 / (MARGIN * 0.001)), 1, deadline=b._clock() + 100)  # 0.75 s
    b.add(later)
    b.commit(later, b.decide(later))
    later.prompt_tokens = int(0.6 / (MARGIN * 0.001))  # tokenized: fewer tokens than chars
    again = b.decide(later)
    assert again is not None and again.short_by <= 0  # 0.6 s spent in all, not 0.75 + 0.6
    b.commit(later, again)
    assert b.spent == pytest.approx(0.6, abs=0.01)
