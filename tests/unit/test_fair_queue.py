"""The central queue's order (``FairQueue``): arrival within a tenant, start-time fairness
across tenants, and with a size weight (the core's SLO-aware queueing) shorter first."""

from __future__ import annotations

from switchyard.scheduler.queue import FairQueue
from switchyard.scheduler.state import Tracked
from tests.support.factories import make_spec


def _queue(weight: float, prompts: list[tuple[str, str, int]]) -> list[str]:
    """The order ``prompts`` (request id, tenant, tokens), pushed in turn, leave in."""
    queue = FairQueue(weight)
    tracked = {}
    for order, (rid, tenant, tokens) in enumerate(prompts):
        tracked[rid] = Tracked(spec=make_spec(rid, prompt_len=tokens, tenant=tenant), enqueued_at=0.0, order=order)
        queue.push(tracked[rid])
    out = []
    while (head := queue.head()) is not None:
        queue.pop_head(tracked[head])
        out.append(head)
    return out


def test_without_a_size_weight_one_tenant_is_served_in_arrival_order() -> None:
    prompts = [("long", "t", 5_000), ("mid", "t", 2_000), ("short", "t", 100)]
    assert _queue(0.0, prompts) == ["long", "mid", "short"]


def test_with_a_size_weight_shorter_prompts_go_first() -> None:
    prompts = [("long", "t", 5_000), ("mid", "t", 2_000), ("short", "t", 100)]
    assert _queue(64.0, prompts) == ["short", "mid", "long"]


def test_a_long_prompt_passes_the_shorter_ones_that_came_long_enough_after_it() -> None:
    # 10 x 1,000 tokens after a 2,000-token prompt. With weight 4 its key is 0 + 4 x 2,000;
    # the i-th short one's is its virtual start (2,000 + 1,000 i) + 4 x 1,000: s0 and s1 pass.
    prompts = [("long", "t", 2_000)] + [(f"s{i}", "t", 1_000) for i in range(10)]
    assert _queue(4.0, prompts)[:4] == ["s0", "s1", "long", "s2"]


def test_with_a_size_weight_a_tenant_that_floods_the_queue_does_not_starve_another() -> None:
    flood = [(f"f{i}", "flood", 1_000) for i in range(50)]
    order = _queue(64.0, [*flood, ("other", "quiet", 1_000)])
    assert order.index("other") == 1  # behind the flood's first only, not its 50
