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
from switchyard.bench.fleet import EventLoop, FleetShape, SimWorker
from switchyard.bench.replay import ReplaySettings, replay
from switchyard.bench.sim import parse_policies
from switchyard.bench.traces import TraceRequest
from switchyard.cli import build_parser
from switchyard.schemas import PrefillDone, PrefillTask, RequestFinished, RequestSpec, SamplingParams

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


def tpot_of_a_decode(with_long_prompt_arriving: bool) -> float:
    loop, sink = EventLoop(), Recorder()
    worker = SimWorker("w", "both", COST, 100, loop, sink)

    def send(rid: str, tokens: int, out: int, at: float) -> None:
        spec = RequestSpec(
            request_id=rid,
            ingress_id="t",
            model="m",
            prompt_tokens=[0] * tokens,
            block_size=512,
            block_keys=[],
            sampling=SamplingParams(max_tokens=out),
        )
        loop.at(at, lambda now: worker.accept(PrefillTask(spec=spec, queued_s=0.0), now))

    send("a", 1000, 50, 0.0)
    if with_long_prompt_arriving:
        send("b", 20_000, 2, 0.2)
    loop.run()
    return (sink.last["a"] - sink.first["a"]) / 49


def test_colocated_prefill_chunks_slow_the_decodes_sharing_their_iterations():
    alone, disturbed = tpot_of_a_decode(False), tpot_of_a_decode(True)
    assert alone == pytest.approx(COST.iteration_s(0, 1, 1025), rel=0.01)
    assert disturbed > 2 * alone  # 20,000 prompt tokens ride in a's iterations


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


def run_sim(trace, out, *extra: str) -> list[dict]:
    from switchyard.bench.sim import run

    assert run(sim_args(trace, out, *extra)) == 0
    return json.loads((out / "results.json").read_text())


def test_same_trace_and_seed_give_an_identical_results_json(tmp_path):
    trace = write_trace(tmp_path / "chat.jsonl", conversations())
    flags = ("--policies", "round_robin,sglang_cache_aware,dynamo_kv,llmd,switchyard", "--prefill", "2", "--seed", "7")
    flags += ("--cache-blocks", "6")
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
