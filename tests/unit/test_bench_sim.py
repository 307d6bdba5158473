"""``switchyard bench sim``: the simulated fleet, the replay through the real core, the CLI.

Traces here are tiny and synthetic (written to tmp_path); the real ones are for runs.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from switchyard import procs
from switchyard.bench import simdoc
from switchyard.bench.calibration import PUBLISHED, closed_loop
from switchyard.bench.costmodel import CostModel
from switchyard.bench.fleet import EventLoop, FleetShape, PrefixCache, SimWorker, TierCounts
from switchyard.bench.replay import TENANT, Replay, ReplaySettings, replay
from switchyard.bench.sim import parse_policies, summarize
from switchyard.bench.traces import TraceRequest, block_keys, tenant_salt
from switchyard.cli import build_parser
from switchyard.scheduler.index import PrefixIndex
from switchyard.schemas import (
    BlocksRemoved,
    BlocksStored,
    DecodeTask,
    LoadReport,
    LocalTask,
    PrefillDone,
    PrefillTask,
    PromptUsage,
    RequestFinished,
    RequestSpec,
    SamplingParams,
    SimKvHandle,
)

REQUIRED = (
    "policy",
    "requests",
    "cache_hit_ratio",
    "hit_ratio_bound",
    "ttft_p50_s",
    "ttft_p90_s",
    "ttft_p99_s",
    "tpot_p50_s",
    "tpot_p90_s",
    "tpot_p99_s",
    "goodput_rps",
    "rejected",
    "index_bytes_per_block",
)
COST = CostModel()


def conversations(sessions: int = 4, turns: int = 4, gap_s: float = 3.0) -> list[dict]:
    """Multi-turn chats: each turn resends the conversation so far and adds two blocks."""
    rows = []
    for turn in range(turns):
        for s in range(sessions):
            ids = [s * 1000 + j for j in range(2 * turn + 2)]
            rows.append(
                {
                    "timestamp": int(1000 * (turn * gap_s + 0.4 * s)),
                    "input_length": 512 * len(ids) - 100,
                    "output_length": 20 + 5 * s,
                    "hash_ids": ids,
                }
            )
    return sorted(rows, key=lambda r: r["timestamp"])


def write_trace(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def settings(
    policy: str = "switchyard", prefill: int = 1, decode: int = 1, colocated: bool = False, **kw
) -> ReplaySettings:
    return ReplaySettings(policy=policy, shape=FleetShape(prefill, decode, colocated), **kw)


# --- the cost model, wired -------------------------------------------------------------------------


def test_one_request_takes_exactly_the_modelled_time():
    result = replay([TraceRequest(0.0, 1000, 3, (1, 2))], settings("round_robin"))
    out = result.outcomes
    prefill = COST.iteration_s(COST.chunk_work(0, 1000), 0, 0)
    assert out.first_token[0] == pytest.approx(prefill)
    steps = sum(COST.iteration_s(0, 1, kv) for kv in (1001, 1002))
    assert out.last_token[0] == pytest.approx(prefill + COST.transfer_s(1000) + steps)
    assert out.status == ["done"]


def test_a_shared_prefix_is_served_from_the_prefill_workers_cache():
    requests = [TraceRequest(0.0, 1000, 2, (1, 2)), TraceRequest(10.0, 1100, 2, (1, 2, 3))]
    out = replay(requests, settings("sglang_cache_aware")).outcomes
    assert out.cached == [0, 1024]
    assert out.first_token[1] - 10.0 == pytest.approx(COST.iteration_s(COST.chunk_work(1024, 1100), 0, 0))


def sim_spec(rid: str, tokens: int, keys: list[int] | None = None, max_tokens: int = 2) -> RequestSpec:
    """A request for a ``SimWorker`` fed by hand: ``tokens`` prompt tokens in 512-token blocks."""
    return RequestSpec(
        request_id=rid,
        ingress_id="t",
        model="m",
        prompt_tokens=[0] * tokens,
        block_size=512,
        block_keys=keys or [],
        sampling=SamplingParams(max_tokens=max_tokens),
    )


class Recorder:
    def __init__(self) -> None:
        self.first: dict[str, float] = {}
        self.last: dict[str, float] = {}

    def worker_event(self, event, now):
        match event:
            case PrefillDone(request_id=rid):
                self.first[rid] = now
            case RequestFinished(request_id=rid):
                self.last[rid] = now

    def kv_events(self, batch, now):
        pass


class Cached(Recorder):
    """Each prompt's cached tokens, and when KV event batches were sent with what they stored."""

    def __init__(self) -> None:
        super().__init__()
        self.cached: dict[str, int] = {}
        self.stored: list[tuple[float, int]] = []  # (when, blocks stored)

    def worker_event(self, event, now):
        super().worker_event(event, now)
        if isinstance(event, PrefillDone):
            self.cached[event.request_id] = event.usage.cached_tokens

    def kv_events(self, batch, now):
        self.stored += [(now, len(e.keys)) for e in batch.events if isinstance(e, BlocksStored) and e.tier == "device"]


def test_a_prompt_scheduled_after_another_reuses_the_blocks_that_one_computes_as_vllm_does():
    """vLLM caches a chunk's blocks when it schedules it (``allocate_slots``): a prompt behind
    another with the same prefix, in the same iteration or a later one, reuses them. Before,
    the simulated worker cached a prompt's blocks only once its last chunk had run, so the
    second of two prompts of one document, batched in one iteration, computed it again."""
    loop, sink = EventLoop(), Cached()
    worker = SimWorker("w", "prefill", COST, 100, loop, sink)

    def send(rid: str, keys: list[int], tokens: int) -> None:
        spec = sim_spec(rid, tokens, keys)
        worker.accept(PrefillTask(spec=spec, queued_s=0.0), 0.0)

    send("doc", [1, 2, 3], 1536)
    send("question", [1, 2, 3, 4], 1700)  # the same document, then a question: in the same iteration
    send("long", list(range(10, 30)), 10_240)  # 20 blocks: 12 whole ones in its first chunk (6,492 tokens)
    loop.at(0.01, lambda now: send("later", [*range(10, 30), 99], 10_300))  # its second chunk's turn
    loop.run()
    assert sink.cached["doc"] == 0 and sink.cached["question"] == 1536
    assert sink.cached["later"] == 20 * 512  # 12 from its first chunk, 8 from its second, scheduled ahead
    # announced when scheduled, as vLLM's KV events are: doc's 3, question's 4th, long's first 12
    assert sum(n for when, n in sink.stored if when == 0.0) == 3 + 1 + 12


def tpot_of_a_decode(with_long_prompt_arriving: bool) -> float:
    loop, sink = EventLoop(), Recorder()
    worker = SimWorker("w", "both", COST, 100, loop, sink)

    def send(rid: str, tokens: int, out: int, at: float) -> None:
        spec = sim_spec(rid, tokens, max_tokens=out)
        # A LocalTask: a colocated worker decodes it where it prefilled (a PrefillTask hands it over).
        loop.at(at, lambda now: worker.accept(LocalTask(spec=spec, queued_s=0.0), now))

    send("a", 1000, 50, 0.0)
    if with_long_prompt_arriving:
        send("b", 20_000, 2, 0.2)
    loop.run()
    return (sink.last["a"] - sink.first["a"]) / 49


def test_colocated_prefill_chunks_slow_the_decodes_sharing_their_iterations():
    alone, disturbed = tpot_of_a_decode(False), tpot_of_a_decode(True)
    assert alone == pytest.approx(COST.iteration_s(0, 1, 1025), rel=0.01)
    assert disturbed > 2 * alone  # 20,000 prompt tokens ride in a's iterations


def decode_span(keys_b: list[int]) -> float:
    """Seconds from b's handoff to its last token, on a decode worker that got a's first."""
    loop, sink = EventLoop(), Recorder()
    worker = SimWorker("d", "decode", COST, 100, loop, sink)

    def hand(rid: str, keys: list[int], at: float) -> None:
        spec = sim_spec(rid, 512 * len(keys), keys)
        handle = SimKvHandle(worker_id="p", block_keys=keys, num_tokens=len(spec.prompt_tokens))
        usage = PromptUsage(prompt_tokens=len(spec.prompt_tokens), cached_tokens=0)
        task = DecodeTask(spec=spec, handle=handle, first_token=0, usage=usage)
        loop.at(at, lambda now: worker.accept(task, now))

    hand("a", list(range(1, 41)), 0.0)
    hand("b", keys_b, 1.0)  # a has arrived and finished by then: its blocks are cached there
    loop.run()
    return sink.last["b"] - 1.0


def test_a_decode_worker_is_handed_only_the_blocks_its_device_lacks():
    shared, fresh = decode_span([*range(1, 41), 99]), decode_span(list(range(100, 141)))
    step = COST.iteration_s(0, 1, 41 * 512 + 1)
    assert fresh == pytest.approx(COST.transfer_s(41 * 512) + step, rel=0.01)
    assert shared == pytest.approx(COST.transfer_s(512) + step, rel=0.01)  # one block crosses the link


def test_decode_workers_keep_and_report_the_blocks_handed_to_them_like_workers_decode():
    requests = [TraceRequest(0.0, 1000, 3, (1, 2))]
    run = replay(requests, settings("round_robin"))
    for wid in ("decode-0", "prefill-0"):
        assert run.workers[wid].snapshot().blocks == {"device": run.workers[wid].cache.keys()}
    assert run.index_entries == 4  # both workers' two blocks


def test_the_model_reproduces_the_published_inter_token_latencies():
    for row in PUBLISHED:
        model = closed_loop(COST, row)
        assert model.itl_ms == pytest.approx(row.itl_ms, rel=0.03), row
        if row.concurrency == 1:
            assert model.ttft_ms == pytest.approx(row.ttft_ms, rel=0.01), row


# --- whole runs -----------------------------------------------------------------------------------


def sim_args(trace, out, *extra: str):
    return build_parser().parse_args(["bench", "sim", "--trace", str(trace), "--out", str(out), *extra])


def run_sim_args(trace, out, *extra: str) -> None:
    from switchyard.bench.sim import run

    assert run(sim_args(trace, out, *extra)) == 0


def run_sim(trace, out, *extra: str) -> list[dict]:
    run_sim_args(trace, out, *extra)
    return json.loads((out / "results.json").read_text())


def test_same_trace_and_seed_give_an_identical_results_json(tmp_path):
    trace = write_trace(tmp_path / "chat.jsonl", conversations())
    flags = ("--policies", "round_robin,sglang_cache_aware,dynamo_kv,llmd,switchyard", "--prefill", "2", "--seed", "7")
    flags += ("--cache-blocks", "6", "--host-cache-blocks", "4", "--disk-cache-blocks", "4")  # delays: defaults
    run_sim(trace, tmp_path / "a", *flags)
    run_sim(trace, tmp_path / "b", *flags)
    assert (tmp_path / "a" / "results.json").read_bytes() == (tmp_path / "b" / "results.json").read_bytes()


@pytest.mark.parametrize("colocated", [False, True])
def test_disaggregated_and_colocated_runs_complete_with_every_field(tmp_path, colocated):
    trace = write_trace(tmp_path / "chat.jsonl", conversations())
    flags = ["--policies", "least_tokens,switchyard", "--prefill", "2", "--decode", "1"]
    results = run_sim(trace, tmp_path / "out", *flags, *(["--colocated"] if colocated else []))
    assert [r["policy"] for r in results] == ["least_tokens", "switchyard"]
    for r in results:
        assert all(key in r for key in REQUIRED), set(REQUIRED) - set(r)
        assert r["mode"] == ("colocated" if colocated else "disaggregated")
        assert r["completed"] == r["requests"] == 16 and r["rejected"] == r["failed"] == r["unfinished"] == 0
        assert 0 < r["cache_hit_ratio"] <= r["hit_ratio_bound"] + 1e-9
        assert 0 < r["ttft_p50_s"] <= r["ttft_p90_s"] <= r["ttft_p99_s"]
        assert r["fleet"]["roles"] == ({"both": 3} if colocated else {"decode": 1, "prefill": 2})
        assert r["dispatches"]["decode"] == (0 if colocated else 16)


def test_an_unknown_policy_is_refused_before_anything_runs():
    with pytest.raises(ValueError, match=r"unknown policy 'fastest'; choose from .*round_robin"):
        parse_policies("round_robin,fastest")


def test_cli_writes_results_timing_and_plots(tmp_path):
    trace = write_trace(tmp_path / "chat.jsonl", conversations())
    out = tmp_path / "sim"
    run = subprocess.run(
        procs.service_command(
            "bench",
            "sim",
            "--trace",
            str(trace),
            "--policies",
            "round_robin,switchyard",
            "--prefill",
            "1",
            "--decode",
            "1",
            "--out",
            str(out),
        ),
        capture_output=True,
        text=True,
        timeout=60,
        env=procs.child_env(),
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "100% of the trace arrived" in run.stdout and "TTFT p50" in run.stdout
    assert [r["policy"] for r in json.loads((out / "results.json").read_text())] == ["round_robin", "switchyard"]
    assert all(t["decisions_per_s"] > 0 for t in json.loads((out / "timing.json").read_text()))
    assert (out / "tables.md").read_text() == simdoc.tables(simdoc.read_run(out))  # docs/bench-sim.md's tables
    for name in ("ttft_cdf.png", "tpot_cdf.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_names_an_unknown_policy(tmp_path):
    trace = write_trace(tmp_path / "chat.jsonl", conversations())
    run = subprocess.run(
        procs.service_command(
            "bench", "sim", "--trace", str(trace), "--policies", "fastest", "--out", str(tmp_path / "out")
        ),
        capture_output=True,
        text=True,
        timeout=60,
        env=procs.child_env(),
    )
    assert run.returncode == 2 and "unknown policy 'fastest'" in run.stderr
    assert not (tmp_path / "out").exists()


# --- tiered caches: device, host, disk ------------------------------------------------------------


def tier_keys(cache: PrefixCache) -> dict[str, list[int]]:
    return {tier.tier: tier.keys() for tier in cache.tiers}


def test_device_evictions_move_to_host_then_to_disk_then_out():
    cache = PrefixCache(2, 2, 2)
    for keys in ([1, 2], [3, 4], [5, 6], [7]):
        cache.insert(keys)
    assert tier_keys(cache) == {"device": [6, 7], "host": [4, 5], "disk": [2, 3]}  # 1 fell off the disk


def test_a_lookup_counts_leading_blocks_on_any_tier_and_brings_them_to_the_device():
    cache = PrefixCache(2, 2, 2)
    for keys in ([1, 2], [3, 4], [5, 6]):  # device 5 6, host 3 4, disk 1 2
        cache.insert(keys)
    assert cache.lookup([1, 3, 5, 9, 6]) == TierCounts(device=1, host=1, disk=1)  # stops at 9
    assert tier_keys(cache) == {"device": [3, 5], "host": [6, 1], "disk": [2, 4]}


def test_a_batch_reports_each_tier_net_of_what_came_and_went_since_the_last():
    cache = PrefixCache(1, 1)
    cache.insert([1])
    cache.take_events()
    cache.insert([2])  # 1 to the host
    cache.insert([1])  # 1 back up, 2 to the host
    # 1's trip down and back cancels out on both tiers; 2 came and went on the device unreported
    assert cache.take_events() == [BlocksStored(keys=[2], tier="host")]
    cache.insert([3])  # 1 to the host, 2 down to nowhere (no disk)
    assert cache.take_events() == [
        BlocksStored(keys=[3], tier="device"),
        BlocksRemoved(keys=[1], tier="device"),
        BlocksStored(keys=[1], tier="host"),
        BlocksRemoved(keys=[2], tier="host"),
    ]


def three_turns(third_at: float = 20.0) -> list[TraceRequest]:
    """A's two blocks, then B's (pushing A's to the host tier of a 2-block device), then A's again."""
    return [
        TraceRequest(0.0, 1000, 2, (1, 2)),
        TraceRequest(10.0, 1000, 2, (3, 4)),
        TraceRequest(third_at, 1100, 2, (1, 2, 5)),
    ]


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_a_prefix_below_the_device_is_a_hit_that_costs_its_load_time(tier):
    host, disk = (10, 0) if tier == "host" else (0, 10)
    shape = FleetShape(1, 1, cache_blocks=2, host_cache_blocks=host, disk_cache_blocks=disk)
    out = replay(three_turns(), ReplaySettings(policy="round_robin", shape=shape)).outcomes
    assert out.cached == [0, 0, 1024]
    assert out.served[2] == TierCounts(**{tier: 1024})
    load = COST.fetch_s(1024, 0) if tier == "host" else COST.fetch_s(0, 1024)
    assert out.first_token[2] - 20.0 == pytest.approx(load + COST.iteration_s(COST.chunk_work(1024, 1100), 0, 0))


def test_a_device_only_cache_forgets_what_it_evicts():
    shape = FleetShape(1, 1, cache_blocks=2)
    out = replay(three_turns(), ReplaySettings(policy="round_robin", shape=shape)).outcomes
    assert out.cached == [0, 0, 0]


def test_the_cores_index_learns_from_kv_events_which_blocks_are_off_the_device():
    shape = FleetShape(1, 1, cache_blocks=2, host_cache_blocks=10)
    run = Replay(three_turns()[:2], ReplaySettings(policy="round_robin", shape=shape))
    run.run()
    a, b = (block_keys(ids, tenant_salt(TENANT)) for ids in ((1, 2), (3, 4)))
    match = run.core.index.match(a)["prefill-0"]
    assert (match.blocks, match.device_blocks) == (2, 0)  # A's blocks: on the host
    match = run.core.index.match(b)["prefill-0"]
    assert (match.blocks, match.device_blocks) == (2, 2)
    # A snapshot says the same, every tier.
    snapshot = run.workers["prefill-0"].snapshot()
    assert snapshot.blocks == {"device": b, "host": a}  # no disk tier here
    fresh = PrefixIndex()
    fresh.load_snapshot(snapshot)
    assert fresh.match(a)["prefill-0"].device_blocks == 0 and fresh.match(a)["prefill-0"].blocks == 2


# --- stale state: what the workers report reaches the core late --------------------------------------


def trace_requests(rows: list[dict]) -> list[TraceRequest]:
    return [
        TraceRequest(r["timestamp"] / 1e3, r["input_length"], r["output_length"], tuple(r["hash_ids"])) for r in rows
    ]


def test_the_decode_dispatch_waits_for_the_prefill_report_and_the_first_token_does_not():
    delayed = settings("round_robin", report_delay_s=0.25, kv_event_delay_s=0.5)
    out = replay([TraceRequest(0.0, 1000, 3, (1, 2))], delayed).outcomes
    prefill = COST.iteration_s(COST.chunk_work(0, 1000), 0, 0)
    assert out.first_token[0] == pytest.approx(prefill)  # the worker's time, not the core's
    steps = sum(COST.iteration_s(0, 1, kv) for kv in (1001, 1002))
    assert out.last_token[0] == pytest.approx(prefill + 0.25 + COST.transfer_s(1000) + steps)


def test_every_worker_message_reaches_the_core_its_delay_late_and_in_order():
    delays = {"kv": 0.05, "report": 0.01}
    run = Replay(
        trace_requests(conversations()),
        settings("switchyard", prefill=2, kv_event_delay_s=delays["kv"], report_delay_s=delays["report"]),
    )
    sent: list[tuple[str, str, object, float]] = []
    heard: list[tuple[str, str, object, float]] = []
    for name, stream in (("worker_event", "report"), ("kv_events", "kv")):
        method = getattr(run, name)

        def sending(message, now, method=method, stream=stream):
            sent.append((message.worker_id, stream, message, now))
            method(message, now)

        setattr(run, name, sending)
    for name, stream in (("on_event", "report"), ("on_kv_events", "kv")):
        method = getattr(run.core, name)

        def hearing(message, now, method=method, stream=stream):
            if not isinstance(message, LoadReport):
                heard.append((message.worker_id, stream, message, now))
            return method(message, now)

        hearing.__name__ = name
        setattr(run.core, name, hearing)
    run.run()
    assert len(heard) == len(sent) > 50
    for worker in run.workers:
        for stream, delay in delays.items():
            out = [(m, t) for w, s, m, t in sent if (w, s) == (worker, stream)]
            back = [(m, t) for w, s, m, t in heard if (w, s) == (worker, stream)]
            assert [m for m, _ in back] == [m for m, _ in out]  # in order
            assert all(t_in >= t_out + delay - 1e-12 for (_, t_out), (_, t_in) in zip(out, back, strict=True))


# --- goodput counts every request of the trace ----------------------------------------------------------


def test_goodput_fraction_counts_rejected_requests_as_missed():
    # A burst on one prefill worker that holds one prompt at a time: the core's queue fills.
    requests = [TraceRequest(0.05 * i, 4000, 20, (10 * i, 10 * i + 1)) for i in range(12)]
    shape = FleetShape(1, 1, prefill_token_budget=4096)
    result = replay(requests, ReplaySettings(policy="least_tokens", shape=shape, max_queued_tokens=12_000))
    summary = summarize(result, 0.0, "disaggregated", 2.0, 0.05)
    out = result.outcomes
    assert summary["rejected"] > 0
    good = sum(
        1
        for i, r in enumerate(requests)
        if out.status[i] == "done"
        and out.first_token[i] - r.arrival_s <= 2.0
        and (out.last_token[i] - out.first_token[i]) / (r.output_tokens - 1) <= 0.05
    )
    assert 0 < good == summary["completed"] < len(requests)  # all that ran met the SLOs
    assert summary["goodput_fraction"] == good / len(requests)


def test_slow_handoffs_do_not_close_decode_workers_that_step_quickly():
    """A long prompt with a short answer every 2 s, whose time per token is mostly its KV
    handoff (over the TPOT SLO), between short prompts with long answers: the decode workers
    step quickly, so they take more decodes each and no request is refused."""
    requests = []
    for i in range(20):
        requests.append(TraceRequest(2.0 * i, 20_000, 3, tuple(range(100 * i, 100 * i + 40))))
        requests.append(TraceRequest(2.0 * i + 1, 1_000, 400, (100 * i + 80, 100 * i + 81)))
    result = replay(requests, settings(prefill=2, decode=2, ttft_slo_s=2.0, tpot_slo_s=0.05))
    out = result.outcomes
    assert out.status == ["done"] * len(requests)
    handoffs = [(out.last_token[i] - out.first_token[i]) / 2 for i in range(0, len(requests), 2)]
    assert min(handoffs) > 0.05  # the handoff alone misses the SLO


@pytest.mark.parametrize("policy", ["switchyard", "llmd"])
def test_a_lendable_fleet_lends_its_prefill_workers_to_decoding_under_switchyard_only(policy):
    # One decode worker and three prefill workers of role "both" (``--lendable``), 200 prompts
    # of 2,000 tokens with 300-token answers 50 ms apart: decode-bound. Only ``switchyard``
    # lends; it loses no request where the plain 3 + 1 fleet refuses some.
    requests = [TraceRequest(0.05 * i, 2_000, 300, [10_000 + 4 * i + j for j in range(4)]) for i in range(200)]
    decoded_on: dict[str, int] = {}

    def run(lendable: bool) -> Replay:
        shape = FleetShape(3, 1, lendable=lendable)
        assert list(shape.roles.values()) == (["both"] * 3 if lendable else ["prefill"] * 3) + ["decode"]
        run = Replay(requests, ReplaySettings(policy=policy, shape=shape, ttft_slo_s=2.0, tpot_slo_s=0.03))
        for worker in run.workers.values():
            accept = worker.accept

            def counted(task, now, accept=accept, worker_id=worker.worker_id):
                if isinstance(task, DecodeTask):
                    decoded_on[worker_id] = decoded_on.get(worker_id, 0) + 1
                return accept(task, now)

            worker.accept = counted  # type: ignore[method-assign]
        run.run()
        return run

    lendable = run(True)
    lent = lendable.core._lending.lent_total
    if policy == "llmd":
        assert lent == 0 and set(decoded_on) == {"decode-0"}  # a peer hands every decode to the decode worker
        return
    assert lent >= 1 and lendable.outcomes.status.count("done") == 200
    assert {w for w in decoded_on if w.startswith("prefill-")}, decoded_on  # a lent one decoded some
    decoded_on.clear()
    plain = run(False)
    assert plain.core._lending.lent_total == 0 and set(decoded_on) == {"decode-0"}
    assert plain.outcomes.status.count("done") < 200
