"""`switchyard bench federation --live-only` on a tiny trace of our own: three live regions per
policy, eu killed halfway. It asserts no speed: only that the results are whole, that every
request eu's clients sent after the kill went to a live ingress and was answered (none hung,
none lost), and that ``local`` routed every request of the steady phase at home."""

from __future__ import annotations

import json
import subprocess

from switchyard import procs
from switchyard.bench.federation_sim import split_by_region
from switchyard.bench.traces import TraceRequest, read_trace

SEED = 4  # this trace's split gives eu's clients 8 of the 20 requests after the kill (checked below)


def _trace(path) -> None:
    """10 conversations of 4 turns, interleaved, one request every half second; each turn
    resends its conversation's history (blocks 0, 100 + s, then its own)."""
    rows = []
    for i in range(40):
        s, turn = i % 10, i // 10
        blocks = [0, 100 + s, *(1000 + 10 * s + j for j in range(turn + 2))]
        rows.append({"timestamp": i * 500, "input_length": 512 * len(blocks), "output_length": 32, "hash_ids": blocks})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _eu_clients_after_the_kill(trace: list[TraceRequest]) -> int:
    split = split_by_region(trace, ["us", "eu", "ap"], [0.6, 0.25, 0.15], 0.2, SEED)
    return sum(1 for fr in split[20:] if fr.ingress == "eu")


def test_bench_federation_live_half_fails_a_killed_regions_clients_over(tmp_path) -> None:
    trace = tmp_path / "conversations.jsonl"
    _trace(trace)
    assert _eu_clients_after_the_kill(read_trace(trace, "mooncake")) >= 4
    out = tmp_path / "federation"
    command = procs.service_command(
        "bench",
        "federation",
        "--live-only",
        "--no-baseline",
        "--trace",
        str(trace),
        "--out",
        str(out),
        "--policies",
        "local,geo",
        "--kill",
        "eu",
        "--seed",
        str(SEED),
        "--prefill",
        "1",
        "--decode",
        "1",
    )
    run = subprocess.run(command, capture_output=True, text=True, timeout=240, env=procs.child_env())
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = json.loads((out / "live" / "results.json").read_text())
    assert [r["policy"] for r in results["runs"]] == ["local", "geo"]
    for name in ("ttft_cdf.png", "goodput_hit.png", "timeline_good.png", "timeline_ttft.png"):
        assert (out / "live" / name).stat().st_size > 0
    assert "| failover | geo |" in (out / "tables.md").read_text()
    for r in results["runs"]:
        assert r["hung"] == 0, r["statuses"]
        steady, failover = r["steady"], r["failover"]
        assert steady["requests"] + failover["requests"] + failover["lost_in_flight"] == 40
        later = [s for s in r["samples"] if s["after_kill"]]
        assert not [s for s in later if s["entry"] == "eu"], "a request was sent to the dead ingress"
        assert failover["entering_at_killed"] >= 4
        assert all(s["status"] == 200 for s in later), [s["status"] for s in later]
    local = results["runs"][0]["steady"]["routes"]
    assert local and all(key.startswith(f"{ingress}/") for ingress, keys in local.items() for key in keys), local
