"""Each placement policy on small, hand-built states (no index, no clock)."""

from __future__ import annotations

import pytest

from switchyard.scheduler.config import SchedulerConfig
from switchyard.scheduler.index import WorkerMatch
from switchyard.scheduler.policies import POLICIES, PlacementView, Prefix, Switchyard, decode_cost, make_policy
from switchyard.scheduler.state import Tracked, WorkerState
from tests.support.factories import make_spec


def worker(
    wid: str, load: int = 0, requests: int = 0, rate: float = 10_000.0, budget: int = 100_000, role: str = "prefill"
) -> WorkerState:
    w = WorkerState(worker_id=wid, role=role, token_budget=budget, block_size=16, last_seen=0.0, prefill_rate=rate)
    per = load // max(1, requests)
    for i in range(requests):
        w.assign(f"{wid}-r{i}", per if i < requests - 1 else load - per * (requests - 1))
    return w


def tracked(prompt_len: int = 1600) -> Tracked:
    return Tracked(spec=make_spec(prompt_len=prompt_len), enqueued_at=0.0, order=1)


def view(matches: dict[str, tuple[int, int]] | None = None, credit: float = 0.8, prompt: int = 1600) -> PlacementView:
    found = {wid: WorkerMatch(wid, device, blocks) for wid, (device, blocks) in (matches or {}).items()}
    return PlacementView.of(
        found, block_size=16, prefill_rate=lambda w: w.prefill_rate, fetch_credit=credit, prompt_tokens=prompt
    )


def test_registry_names_and_unknown_policy() -> None:
    assert set(POLICIES) == {"round_robin", "least_requests", "least_tokens", "prefix", "switchyard"}
    with pytest.raises(ValueError, match="unknown policy 'fastest'"):
        make_policy("fastest")
    with pytest.raises(ValueError, match="unknown policy"):
        SchedulerConfig(policy="fastest")


def test_each_policy_says_whether_it_takes_the_least_of_a_key() -> None:
    # The placer skips its filtering pass for these (``Placer._quick``): every policy
    # declares it, none is assumed.
    assert {name: make_policy(name).argmin for name in POLICIES} == {
        "round_robin": False,
        "least_requests": True,
        "least_tokens": True,
        "prefix": False,
        "switchyard": True,
    }


def test_round_robin_cycles_in_id_order() -> None:
    policy, ws = make_policy("round_robin"), [worker("b"), worker("a"), worker("c")]
    chosen = [policy.choose(tracked(), ws, view()).worker_id for _ in range(6)]
    assert chosen == ["a", "b", "c", "a", "b", "c"]


def test_least_requests_and_least_tokens_differ() -> None:
    ws = [worker("a", load=9000, requests=1), worker("b", load=300, requests=3)]
    assert make_policy("least_requests").choose(tracked(), ws, view()).worker_id == "a"
    assert make_policy("least_tokens").choose(tracked(), ws, view()).worker_id == "b"


def test_uncached_tokens_credit_device_and_fetchable_blocks() -> None:
    v, w = view({"a": (50, 80)}, credit=0.5), worker("a")
    # 100 blocks of 16: 50 on device (free), 30 more fetchable (half price), 20 to compute.
    assert v.uncached_tokens(w) == 1600 - 800 - 0.5 * 480
    assert v.uncached_tokens(worker("b")) == 1600
    assert v.need(w) == 560 and v.need(worker("b")) == 1600
    assert view({"a": (100, 100)}).need(w) == 1  # fully cached: still its last token


def test_prefix_follows_the_cache_while_balanced() -> None:
    ws = [worker("a", load=2000, requests=1), worker("b", load=0)]
    assert Prefix().choose(tracked(), ws, view({"a": (90, 90)})).worker_id == "a"
    assert Prefix().choose(tracked(), ws, view({"a": (2, 2)})).worker_id == "b"  # under min_match: balance


def test_prefix_balances_when_the_cached_worker_is_overloaded() -> None:
    ws = [worker("a", load=50_000, requests=5), worker("b", load=1000, requests=1)]
    assert Prefix(balance_abs=4096, balance_rel=1.5).choose(tracked(), ws, view({"a": (100, 100)})).worker_id == "b"


def test_switchyard_weighs_cache_queue_and_rate() -> None:
    t = tracked(prompt_len=1600)
    # a: warm but busy; b: cold and idle. a costs (8000 + 0)/10k = 0.8 s, b 1600/10k = 0.16 s.
    ws = [worker("a", load=8000, requests=2), worker("b")]
    assert Switchyard().choose(t, ws, view({"a": (100, 100)})).worker_id == "b"
    # a less busy: (1000 + 0)/10k = 0.1 s beats b's 0.16 s.
    ws = [worker("a", load=1000, requests=1), worker("b")]
    assert Switchyard().choose(t, ws, view({"a": (100, 100)})).worker_id == "a"
    # a fast worker beats an equally idle slow one.
    ws = [worker("slow", rate=2_000.0), worker("fast", rate=20_000.0)]
    assert Switchyard().choose(t, ws, view()).worker_id == "fast"


def test_switchyard_cost_is_the_predicted_wait() -> None:
    w, t = worker("a", load=2000, requests=1, rate=4000.0), tracked(prompt_len=1600)
    assert Switchyard.cost(w, t, view({"a": (50, 50)})) == pytest.approx((2000 + 800) / 4000.0)


def test_decode_cost_prefers_free_capacity_then_fewer_sequences() -> None:
    roomy = worker("a", load=10_000, requests=4, budget=100_000, role="decode")
    tight = worker("b", load=5_000, requests=1, budget=10_000, role="decode")
    assert min([roomy, tight], key=decode_cost).worker_id == "a"
