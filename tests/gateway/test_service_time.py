"""Tests for gateway/service_time.py: each worker's measured rates per batch size, a request's
own service estimate from them, and the fit check admission makes with it."""

from __future__ import annotations

import pytest

from gateway.service_time import DoesNotFit, ServiceTimes, bucket, check_fit


def test_buckets_are_powers_of_two_up_to_64() -> None:
    assert [bucket(b) for b in (0, 1, 2, 3, 4, 7, 8, 16, 33, 64, 500)] == \
        [1, 1, 2, 2, 4, 4, 8, 16, 32, 64, 64]


def test_estimate_is_prefill_plus_tokens_at_the_batch_it_joins() -> None:
    st = ServiceTimes()
    assert st.estimate([("w", 0)], 100, 10) is None  # nothing measured: no opinion
    st.observe("w", 1, 100, 0.5, 0.02)  # 5 ms a prompt token; 20 ms a token alone
    st.observe("w", 16, 100, 0.5, 0.33)  # 330 ms a token among 16 (no native bf16, say)
    assert st.estimate([("w", 0)], 100, 10) == pytest.approx(0.5 + 10 * 0.02)
    # joining 15 running sequences is a batch of 16: its own rate, not one row's
    assert st.estimate([("w", 15)], 100, 10) == pytest.approx(0.5 + 10 * 0.33)
    # n=4 choices join as four sequences: 3 running + 4 is bucket 4, unmeasured: the nearest
    # measured bucket above (16) is used as it is, never a faster guess
    assert st.estimate([("w", 3)], 0, 10, extra=4) == pytest.approx(3.3)


def test_a_larger_unmeasured_batch_is_never_estimated_faster() -> None:
    st = ServiceTimes()
    st.observe("w", 2, 10, 0.01, 0.04)
    assert st.rates("w").step(2) == pytest.approx(0.04)
    assert st.rates("w").step(8) == pytest.approx(0.04 * 2)  # sqrt(8 / 2)
    assert st.rates("w").step(1) == pytest.approx(0.04)  # a smaller one borrows from above


def test_the_estimate_learns_and_takes_the_fastest_worker() -> None:
    st = ServiceTimes()
    for _ in range(20):
        st.observe("slow", 1, 10, 0.1, 0.1)
        st.observe("fast", 1, 10, 0.1, 0.01)
    assert st.estimate([("slow", 0), ("fast", 0)], 10, 10) == pytest.approx(0.1 + 0.1)
    for _ in range(20):  # the fast one slows down: the estimate follows within a few requests
        st.observe("fast", 1, 10, 0.1, 0.2)
    assert st.estimate([("slow", 0), ("fast", 0)], 10, 10) == pytest.approx(1.1, rel=0.01)
    st.forget(["slow"])
    assert st.rates("fast") is None


def test_tokens_within_a_deadline() -> None:
    st = ServiceTimes()
    st.observe("w", 1, 10, 0.1, 0.05)
    assert st.tokens_within([("w", 0)], 10, 1.0) == 18
    assert st.tokens_within([("w", 0)], 10, 0.05) == 0
    assert st.tokens_within([], 10, 1.0) is None


def test_check_fit_refuses_what_no_worker_could_finish_and_what_the_load_delays() -> None:
    st = ServiceTimes()
    args = dict(prompt_tokens=10, n=1, budget_s=5.0, remaining_s=5.0, wait_s=0.0)
    check_fit(st, [("w", 0)], max_tokens=10_000, **args)  # unmeasured: admitted
    st.observe("w", 1, 10, 0.1, 0.03)
    st.observe("w", 8, 10, 0.1, 0.3)
    check_fit(st, [("w", 0)], max_tokens=100, **args)  # 0.1 + 3 s: fits
    with pytest.raises(DoesNotFit) as idle:
        check_fit(st, [("w", 0)], max_tokens=1000, **args)  # 30 s even alone
    assert idle.value.idle and "max_tokens=1000" in str(idle.value)
    assert "30 ms a token" in str(idle.value)
    with pytest.raises(DoesNotFit) as busy:  # alone it fits; among 8 it takes 30 s
        check_fit(st, [("w", 7)], max_tokens=100, **args)
    assert not busy.value.idle and busy.value.retry_after >= 1.0
    with pytest.raises(DoesNotFit) as queued:  # the wait in the queue counts too
        check_fit(st, [("w", 0)], max_tokens=100, **{**args, "wait_s": 4.0})
    assert not queued.value.idle


def test_an_idle_refusal_never_rests_on_a_busier_batch_measured_alone() -> None:
    """Only a batch of 16 was measured (1.1 s a step on a crowded host): a lone request of 80
    tokens might take 88 s at that rate, but alone it could take as little as 80 x 1.1 / 16 =
    5.5 s. A 400 ("even on an idle worker") must be certain, and a 429 for an unmeasured batch
    size would keep it unmeasured for ever; among 16 running, the measured figure refuses."""
    st = ServiceTimes()
    st.observe("w", 16, 10, 0.1, 1.1)
    assert st.rates("w").step(1, lower_bound=True) == pytest.approx(1.1 / 16)
    assert st.rates("w").step(1) == pytest.approx(1.1)  # the load estimate stays cautious
    args = dict(prompt_tokens=10, n=1, budget_s=30.0, remaining_s=30.0, wait_s=0.0)
    check_fit(st, [("w", 0)], max_tokens=80, **args)  # idle: fits by the lower bound
    with pytest.raises(DoesNotFit) as busy:
        check_fit(st, [("w", 15)], max_tokens=80, **args)  # among 16: 88 s
    assert not busy.value.idle
    with pytest.raises(DoesNotFit) as idle:
        check_fit(st, [("w", 0)], max_tokens=1000, **args)  # 1000 x 1.1 / 16 = 69 s: certain
    assert idle.value.idle


def test_a_deadline_already_passed_is_refused_even_unmeasured() -> None:
    with pytest.raises(DoesNotFit) as exc:
        check_fit(ServiceTimes(), [("w", 0)], 10, 10, 1, budget_s=1e-9, remaining_s=-0.001,
                  wait_s=0.0)
    assert exc.value.idle and exc.value.param == "timeout"


def test_short_prompts_teach_a_prefills_fixed_cost_not_a_rate_per_token() -> None:
    """A 3-token prefill of 30 ms under load is one forward's cost: taken per token (10 ms) it
    made a near-full context of 1,000 tokens look like 10 s, and a plain request got a 400
    deadline_unreachable (the flaky test_a_prompt_beyond_the_context_gets_400...)."""
    st = ServiceTimes()
    for _ in range(5):
        st.observe("w", 1, 3, 0.03, 0.01)
    assert st.estimate([("w", 0)], 1000, 5) == pytest.approx(0.03 + 5 * 0.01)
    args = dict(prompt_tokens=1000, n=1, budget_s=1.0, remaining_s=1.0, wait_s=0.0)
    check_fit(st, [("w", 0)], max_tokens=5, **args)  # admitted
    st.observe("w", 1, 200, 0.4, 0.01)  # a long prompt teaches the rate: 2 ms a token
    assert st.estimate([("w", 0)], 1000, 0) == pytest.approx(2.0)
    assert st.estimate([("w", 0)], 10, 0) == pytest.approx(0.03)  # never below the short cost
