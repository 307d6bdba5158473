"""Each placement policy on small, hand-built states (no index, no clock)."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Literal

import pytest

from switchyard.scheduler import Action, Dispatch, SchedulerCore
from switchyard.scheduler.config import SchedulerConfig
from switchyard.scheduler.index import WorkerMatch
from switchyard.scheduler.peers import BlockLru, DynamoKv, Llmd, LlmdPrecise, SglangCacheAware
from switchyard.scheduler.policies import POLICIES, PlacementView, Switchyard, decode_cost, make_policy
from switchyard.scheduler.state import Tracked, WorkerState
from switchyard.schemas import DecodeTask, KvSnapshot, Role
from tests.support.factories import load_report, make_spec, prefill_done, request_finished


def worker(
    wid: str, load: int = 0, requests: int = 0, rate: float = 10_000.0, budget: int = 100_000, role: Role = "prefill"
) -> WorkerState:
    w = WorkerState(worker_id=wid, role=role, token_budget=budget, block_size=16, last_seen=0.0, own_rate=rate)
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
    assert set(POLICIES) == {
        "round_robin",
        "least_requests",
        "least_tokens",
        "sglang_cache_aware",
        "dynamo_kv",
        "llmd",
        "llmd_precise",
        "prefix",  # the retired straw man's name, kept for old configs
        "switchyard",
    }
    assert isinstance(make_policy("prefix"), SglangCacheAware)
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
        "sglang_cache_aware": False,
        "dynamo_kv": False,
        "llmd": False,
        "llmd_precise": False,
        "prefix": False,
        "switchyard": False,  # the near-equals are near the quickest of those that fit
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


def test_switchyard_alone_in_the_queue_computes_least_where_no_worker_is_safe() -> None:
    """No worker within half the time left before the SLO: with others waiting, the quickest;
    alone in the queue, the one that computes least (nobody waits behind what it takes). A
    safe worker still comes first, and a late request goes to the quickest either way."""
    t = tracked(prompt_len=1600)
    # warm: its cache holds the prompt, (8000 + 0)/10k = 0.8 s; cold: idle, 1600/10k = 0.16 s.
    ws = [worker("warm", load=8000, requests=2), worker("cold")]
    unsafe = replace(view({"warm": (100, 100)}), ttft_budget_s=0.3)  # half of it: 0.15 s
    assert Switchyard().choose(t, ws, unsafe).worker_id == "cold"
    assert Switchyard().choose(t, ws, replace(unsafe, alone=True)).worker_id == "warm"
    late = replace(unsafe, ttft_budget_s=-math.inf, alone=True)
    assert Switchyard().choose(t, ws, late).worker_id == "cold"
    cold_safe = replace(unsafe, ttft_budget_s=0.4, alone=True)  # 0.16 s is within 0.2 s
    assert Switchyard().choose(t, ws, cold_safe).worker_id == "cold"


def test_switchyard_cost_is_the_predicted_wait() -> None:
    w, t = worker("a", load=2000, requests=1, rate=4000.0), tracked(prompt_len=1600)
    assert Switchyard.cost(w, t, view({"a": (50, 50)})) == pytest.approx((2000 + 800) / 4000.0)


def test_decode_cost_prefers_free_capacity_then_fewer_sequences() -> None:
    roomy = worker("a", load=10_000, requests=4, budget=100_000, role="decode")
    tight = worker("b", load=5_000, requests=1, budget=10_000, role="decode")
    assert min([roomy, tight], key=decode_cost).worker_id == "a"


# --- the peers' routers --------------------------------------------------------------


def same_prompt(tokens: int = 1600, seed: int = 7) -> list[int]:
    """Token ids fixed by ``seed``: two specs built from it share every block key."""
    return [(seed * 1_000_003 + i) % 50_000 for i in range(tokens)]


def routed(prompt: list[int]) -> Tracked:
    return Tracked(spec=make_spec(prompt=prompt), enqueued_at=0.0, order=1)


def test_block_lru_matches_leading_blocks_and_evicts_tails_first() -> None:
    lru = BlockLru(capacity_tokens=3 * 16)
    lru.insert("a", [1, 2, 3, 4], block_size=16)
    # Touched back to front: the tail (4) is the oldest, so it goes first.
    assert lru.size("a") == 3 and lru.match("a", [1, 2, 3, 4]) == 3
    assert lru.match("a", [2, 3]) == 2 and lru.match("a", [9, 1]) == 0 and lru.match("b", [1]) == 0


def test_sglang_imbalance_counts_requests_not_tokens() -> None:
    t = routed(same_prompt())
    policy = SglangCacheAware()
    policy.trees.insert("b", t.spec.block_keys, 16)  # b holds the whole prompt
    # a: one huge request; b: 70 tiny ones. 70 - 1 > 64 and 70 > 1.5 x 1: out of balance,
    # so the fewest requests win, cache or not (least tokens would pick b).
    ws = [worker("a", load=90_000, requests=1), worker("b", load=700, requests=70)]
    assert policy.choose(t, ws, view()).worker_id == "a"
    assert make_policy("least_tokens").choose(t, ws, view()).worker_id == "b"
    # 60 tiny ones: 59 <= 64, balanced, and b's tree matches the whole prompt.
    ws = [worker("a", load=90_000, requests=1), worker("b", load=600, requests=60)]
    assert SglangCacheAware().choose(t, ws, view()).worker_id == "a"  # a fresh tree: a miss
    policy = SglangCacheAware()
    policy.trees.insert("b", t.spec.block_keys, 16)
    assert policy.choose(t, ws, view()).worker_id == "b"


def test_sglang_below_cache_threshold_goes_to_the_smallest_tree() -> None:
    t = routed(same_prompt())  # 100 blocks
    ws = [worker("a", load=500, requests=1), worker("b", load=0), worker("c", load=900, requests=2)]

    def policy(leading: int, miss: Literal["smallest_tree", "least_load"] = "smallest_tree") -> SglangCacheAware:
        p = SglangCacheAware(miss=miss)
        p.trees.insert("a", t.spec.block_keys[:leading], 16)
        p.trees.insert("b", make_spec(prompt_len=16 * 40).block_keys, 16)  # 40 other blocks
        p.trees.insert("c", make_spec(prompt_len=16 * 3).block_keys, 16)  # 3 other blocks
        return p

    assert policy(31).choose(t, ws, view()).worker_id == "a"  # 31 % of the prompt > 0.3
    assert policy(30).choose(t, ws, view()).worker_id == "c"  # 30 %: a miss, c's tree is smallest
    assert policy(30, miss="least_load").choose(t, ws, view()).worker_id == "b"  # newest gateway


def test_sglang_inserts_at_routing_time_so_the_same_prompt_follows_before_any_kv_event() -> None:
    policy, ws = SglangCacheAware(), [worker("a"), worker("b"), worker("c")]
    policy.trees.insert("a", make_spec(prompt_len=16 * 5).block_keys, 16)
    first = routed(same_prompt())
    assert policy.choose(first, ws, view()).worker_id == "b"  # b and c empty: the lower id
    # No KV event (the view is empty), and b's tree is now the largest: still b.
    assert policy.choose(routed(same_prompt()), ws, view()).worker_id == "b"
    assert policy.choose(routed(same_prompt(seed=8)), ws, view()).worker_id == "c"  # a new prompt: smallest tree


def test_dynamo_picks_the_lowest_overlap_weighted_cost() -> None:
    t, policy = tracked(prompt_len=1600), DynamoKv()
    # Prefill workers (disaggregated): no decode term. a: 800 queued, the prompt cached:
    # (800 + 0) / 16 = 50 blocks; b: idle, cold: 1600 / 16 = 100.
    ws = [worker("a", load=800, requests=1), worker("b")]
    v = view({"a": (100, 100)})
    assert policy.logit(ws[0], t, v) == 50.0 and policy.logit(ws[1], t, v) == 100.0
    assert policy.choose(t, ws, v).worker_id == "a"
    ws = [worker("a", load=2000, requests=1), worker("b")]  # (2000 + 0) / 16 = 125 > 100
    assert policy.choose(t, ws, v).worker_id == "b"
    # Fetchable (host) blocks are not cached for Dynamo: only the device tier counts.
    assert policy.logit(worker("a"), t, view({"a": (0, 100)})) == 100.0
    # A tie, 150 each ((800 + 1600) / 16 and (1600 + 800) / 16): the lower worker id.
    ws = [worker("b", load=1600, requests=1), worker("a", load=800, requests=1)]
    assert policy.choose(t, ws, view({"b": (50, 50)})).worker_id == "a"
    assert DynamoKv(overlap_weight=2.0).logit(worker("a", load=800, requests=1), t, view()) == 300.0


def test_dynamo_counts_active_blocks_on_colocated_workers_only() -> None:
    policy = DynamoKv()
    a, b = worker("a", role="both"), worker("b", role="both")
    r1 = routed(same_prompt())  # 100 blocks
    assert policy.choose(r1, [a, b], view()).worker_id == "a"  # 100 + 100 each: the lower id
    a.assign(r1.spec.request_id, 1600)  # what the core does with the placement
    r2, again = routed(same_prompt(seed=8)), routed(same_prompt())
    assert policy.decode_blocks(a, r2) == 200  # r1's 100 active + 100 new
    assert policy.decode_blocks(a, again) == 100  # the same prompt's blocks are counted once
    # a: (1600 + 1600) / 16 + 200 = 400; b: 100 + 100 = 200.
    assert policy.choose(r2, [a, b], view()).worker_id == "b"
    a.release(r1.spec.request_id)  # r1 done: its blocks stop counting at the next decision
    r3 = routed(same_prompt(seed=9))
    assert policy.choose(r2, [a], view()).worker_id == "a"  # forgets r1, takes r2
    assert policy.decode_blocks(a, r3) == 200  # r2's 100 + r3's 100 (with r1 still counted: 300)
    # Prefill workers: the disaggregated prefill router tracks no active blocks.
    p = worker("p")
    assert policy.choose(r1, [p], view()).worker_id == "p" and policy.decode_blocks(p, r2) == 0


def test_llmd_weighted_sum_and_max_score_picker() -> None:
    t = routed(same_prompt())
    # a: the prompt sent there before, 4 queued, 20 % of its budget; b: idle; c: 2 queued, 10 %.
    ws = [worker("a", load=20_000, requests=4), worker("b"), worker("c", load=10_000, requests=2)]
    policy = Llmd()
    policy.index.insert("a", t.spec.block_keys, 16)
    # prefix 3 x (1, 0, 0) + queue 2 x (0, 1, 0.5) + kv 2 x (0.8, 1, 0.9)
    assert policy.scores(t, ws, view()) == pytest.approx({"a": 4.6, "b": 4.0, "c": 2.8})
    assert policy.choose(t, ws, view()).worker_id == "a"
    # The precise profile (2, 1, 1), its prefix from KV events: the cache weighs less.
    precise = LlmdPrecise()
    assert precise.scores(t, ws, view({"a": (100, 100)})) == pytest.approx({"a": 2.8, "b": 2.0, "c": 1.4})
    assert precise.scores(t, ws, view({"a": (30, 30), "c": (100, 100)})) == pytest.approx(
        {"a": 0.8, "b": 2.0, "c": 3.4}
    )
    assert precise.choose(t, ws, view({"a": (30, 30), "c": (100, 100)})).worker_id == "c"
    # Equal scores: the lower worker id (llm-d shuffles).
    assert Llmd().choose(t, [worker("b"), worker("a")], view()).worker_id == "a"


def test_llmd_records_at_routing_time_and_precise_normalises_over_holders() -> None:
    policy, t = Llmd(), routed(same_prompt())
    ws = [worker("a"), worker("b")]
    assert policy.choose(t, ws, view()).worker_id == "a"
    assert policy.prefix_scores(routed(same_prompt()), ws, view()) == {"a": 1.0, "b": 0.0}
    precise, three = LlmdPrecise(), [worker("a"), worker("b"), worker("c")]
    assert precise.prefix_scores(t, three, view({"a": (20, 20), "b": (60, 60)})) == {"a": 0.0, "b": 1.0, "c": 0.0}
    assert precise.prefix_scores(t, three, view({"a": (20, 20)})) == {"a": 1.0, "b": 0.0, "c": 0.0}
    assert precise.prefix_scores(t, three, view()) == {"a": 0.0, "b": 0.0, "c": 0.0}


def decoder(wid: str, kv: int = 0, decodes: int = 0) -> WorkerState:
    """A decode worker of 100,000 KV tokens with ``decodes`` running, ``kv`` tokens in all."""
    return worker(wid, load=kv, requests=decodes, budget=100_000, role="decode")


def test_dynamo_routes_a_decode_to_the_worker_that_holds_its_prompt_unless_its_active_blocks_cost_more() -> None:
    """Dynamo's decode routing: the lowest (prompt blocks not cached there + active blocks
    with this prompt's); a decode worker's ledger is KV, not prefill waiting."""
    t, policy = routed(same_prompt()), DynamoKv()  # 100 blocks
    a, b = decoder("a", kv=50_000, decodes=3), decoder("b")
    held = view({"b": (0, 0), "a": (100, 100)})  # a holds the whole prompt on its device
    assert policy.decode_logit(a, t, held) == 100.0  # nothing to pull, 0 active tracked + 100 new
    assert policy.decode_logit(b, t, held) == 200.0  # 100 to pull + 100 new
    assert policy.choose_decode(t, [a, b], held).worker_id == "a"  # the core's pick: b, the emptier
    a.assign(t.spec.request_id, 1_600)
    other = routed(same_prompt(seed=8))
    # a now has t's 100 blocks active: other's 100 new + 100 active + 100 to pull = 300 > b's 200.
    assert policy.choose_decode(other, [a, b], view()).worker_id == "b"
    # Only the device tier counts as cached (a host copy would be pulled like any miss).
    assert policy.decode_logit(b, other, view({"b": (0, 100)})) == 200.0


def test_sglang_routes_decodes_by_its_decode_workers_trees_and_in_flight_requests() -> None:
    t, policy = routed(same_prompt()), SglangCacheAware()
    a, b = decoder("a", kv=2_000, decodes=5), decoder("b")
    policy.trees.insert("prefill-0", t.spec.block_keys, 16)  # a prefill worker's tree is not a decode worker's
    policy.trees.insert("a", make_spec(prompt_len=16 * 3).block_keys, 16)  # 3 other blocks
    assert policy.choose_decode(t, [a, b], view()).worker_id == "b"  # a miss: the smaller tree
    # The prompt went into b's tree at routing time: the next decode of it follows, though
    # b's tree is now the larger.
    assert policy.choose_decode(routed(same_prompt()), [a, b], view()).worker_id == "b"
    # Out of balance by requests (70 decodes against 1): the fewest, tree or not.
    busy = decoder("b", kv=7_000, decodes=70)
    assert (
        policy.choose_decode(routed(same_prompt()), [decoder("a", kv=90_000, decodes=1), busy], view()).worker_id == "a"
    )


def test_llmd_routes_decodes_by_prefix_and_kv_usage_with_every_queue_empty() -> None:
    t = routed(same_prompt())
    a, b = decoder("a", kv=60_000, decodes=2), decoder("b", kv=10_000, decodes=9)
    # llm-d: prefix 3 x (1, 0) + queue 2 x (1, 1) + kv 2 x (0.4, 0.9): a 5.8, b 3.8.
    policy = Llmd()
    policy.index.insert("a", t.spec.block_keys, 16)
    assert policy.choose_decode(t, [a, b], view()).worker_id == "a"
    # Precise (2, 1, 1) from the decode workers' KV events: a holds 30 blocks, b none:
    # a 2 + 1 + 0.4 = 3.4, b 0 + 1 + 0.9 = 1.9; with b holding 100 and a 30: a 1.4, b 3.9.
    precise = LlmdPrecise()
    assert precise.choose_decode(t, [a, b], view({"a": (30, 30)})).worker_id == "a"
    assert precise.choose_decode(t, [a, b], view({"a": (30, 30), "b": (100, 100)})).worker_id == "b"
    # Nothing cached anywhere: the emptier KV wins (running decodes are no queue).
    assert precise.choose_decode(routed(same_prompt(seed=8)), [a, b], view()).worker_id == "b"
    fresh = Llmd()
    assert fresh.choose_decode(routed(same_prompt(seed=9)), [a, b], view()).worker_id == "b"
    assert fresh.prefix_scores(routed(same_prompt(seed=9)), [a, b], view()) == {"a": 0.0, "b": 1.0}  # recorded


@pytest.mark.parametrize("name", ["dynamo_kv", "llmd_precise"])
def test_a_peer_decodes_where_its_prompt_is_held_where_the_core_would_pick_the_emptier(name: str) -> None:
    """Through the core: a decode worker that holds the prompt (it decoded it before and
    reported the blocks) takes the next decode of it under Dynamo's and llm-d's routing,
    though another is emptier; ``least_tokens`` keeps the core's pick, the emptier."""
    picks = {}
    for policy in (name, "least_tokens"):
        core, now = SchedulerCore(SchedulerConfig(policy=policy)), 0.0
        core.on_event(load_report("p0", "prefill", budget=100_000, seq=1), now)
        core.on_event(load_report("d0", "decode", budget=100_000, seq=1), now)
        core.on_event(load_report("d1", "decode", budget=100_000, seq=1), now)
        prompt = same_prompt(1_600)
        spec = make_spec("first", prompt=prompt, max_tokens=10)
        core.submit(spec, now)
        d1 = core.workers["d1"]
        d1.assign("other", 20_000)  # d1 decodes something else: d0 is the emptier
        core.index.load_snapshot(KvSnapshot(worker_id="d1", seq=1, blocks={"device": spec.block_keys}))
        actions = core.on_event(prefill_done(spec, "p0"), now)
        decoded = [a.worker_id for a in actions if isinstance(a, Dispatch) and isinstance(a.task, DecodeTask)]
        picks[policy] = decoded
    assert picks == {name: ["d1"], "least_tokens": ["d0"]}


@pytest.mark.parametrize("colocated", [False, True], ids=["disaggregated", "colocated"])
@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_drives_the_core_until_every_request_is_done(name: str, colocated: bool) -> None:
    core, now = SchedulerCore(SchedulerConfig(policy=name)), 0.0
    both: list[Role] = ["both", "both", "both"]
    split: list[Role] = ["prefill", "prefill", "prefill", "decode"]
    roles = both if colocated else split
    for i, role in enumerate(roles):
        core.on_event(load_report(f"w{i}", role, budget=1_000, seq=1), now)
    actions: list[Action] = []
    for i in range(12):  # three prompts, four times each: more than the fleet holds at once
        actions += core.submit(make_spec(f"r{i}", prompt=same_prompt(320, seed=i % 3)), now)[1]
    while actions:
        action = actions.pop(0)
        if not isinstance(action, Dispatch):
            continue
        spec, wid = action.task.spec, action.worker_id
        if isinstance(action.task, DecodeTask):
            actions += core.on_event(request_finished(spec, wid), now)
            continue
        actions += core.on_event(prefill_done(spec, wid), now)
        if core.requests[spec.request_id].phase == "decode":  # decodes where it prefilled
            actions += core.on_event(request_finished(spec, wid), now)
        core.check_invariants()
    assert not core.requests
    assert all(w.load_tokens == 0 and w.kv_tokens == 0 for w in core.workers.values())


def test_on_a_colocated_fleet_a_queued_prompt_weighs_more_than_kv_decoding_beside_it() -> None:
    """The prompt's first token waits on the worker's queue: a worker with an empty queue
    wins over one whose decodes hold a little less KV but that has a prompt queued."""
    queued = worker("w1", load=500, requests=1, role="both")  # a 500-token prompt queued
    queued.hold("seq", 1_000)
    empty = worker("w2", role="both")
    empty.hold("seq", 2_000)  # 1,000 more KV tokens decoding, nothing queued
    request, safe = tracked(prompt_len=4_000), replace(view(prompt=4_000), ttft_budget_s=10.0)
    # 4,000 + 4 x 500 + 1,000 = 7,000 against 4,000 + 2,000 = 6,000 (with the queue at par,
    # 5,500: the queued worker would win)
    assert Switchyard().choose(request, [queued, empty], safe).worker_id == "w2"
    queued.release("w1-r0")
    assert Switchyard().choose(request, [queued, empty], safe).worker_id == "w1"  # its queue ran
