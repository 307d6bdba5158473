"""``switchyard bench batch``: does batch work fill the troughs without taking from interactive traffic?

Two live runs on the sim engine with the calibrated cost model (``bench live``'s scaling: a
trace's tokens and time scaled down, and reported scaled back), each a fresh stack as
``switchyard up`` starts it, batch runner included:

1. **alone**: the interactive trace replayed over HTTP/SSE;
2. **with a batch**: the same replay, with a batch of ``--batch-lines`` chat lines (sharing a
   system prompt, as evaluation and synthetic-data batches do) submitted through the Batch API
   at the start; the run goes on after the replay until the batch completes.

Reported: interactive TTFT and TPOT (p50, p90) in both runs and their ratio (the goal: p90 TTFT
at most 10% worse with the batch running), the batch's lines per minute (during the replay, and
over its whole run) and completion time, its prefix-cache hit ratio, and fleet utilisation: the
share of half-second samples in which a worker had work in flight (prefill) or the mean
sequences it was decoding (decode), from the scheduler's own ``ClusterStatus``.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import httpx
import nats

from switchyard import procs
from switchyard.bench import plots
from switchyard.bench import stack as bench_stack
from switchyard.bench.costmodel import CostModel
from switchyard.bench.live import Scaling, live_cost, replay_http, summarize_live, worker_flags
from switchyard.bench.traces import TRACE_BLOCK_SIZE, read_trace
from switchyard.schemas import ClusterStatus, StatusRequest, codec, subjects

MODEL = "switchyard-sim"
_DONE = {"completed", "failed", "expired", "cancelled"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", type=Path, required=True, help="Mooncake JSONL or Azure CSV trace (interactive)")
    p.add_argument("--format", choices=["mooncake", "azure"], default=None)
    p.add_argument("--limit", type=int, default=600, help="the first N requests of the trace")
    p.add_argument("--prefill", type=int, default=4, help="prefill workers (as bench live)")
    p.add_argument("--decode", type=int, default=2, help="decode workers")
    p.add_argument("--time-scale", type=float, default=0.1, help="live seconds per trace second")
    p.add_argument("--token-scale", type=int, default=16, choices=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--cache-blocks", type=int, default=CostModel().kv_capacity_tokens // TRACE_BLOCK_SIZE)
    p.add_argument("--batch-lines", type=int, default=10_000, help="lines of the batch")
    p.add_argument("--batch-max-tokens", type=int, default=16, help="max_tokens of each batch line")
    p.add_argument("--batch-timeout-s", type=float, default=1800, help="give up on the batch after this long")
    p.add_argument("--ttft-slo-s", type=float, default=2.0)
    p.add_argument("--tpot-slo-s", type=float, default=0.05)
    p.add_argument("--out", type=Path, default=Path("bench/results/batch"))


def run(args: argparse.Namespace) -> int:
    scaling = Scaling(args.time_scale, args.token_scale)
    trace = read_trace(args.trace, args.format, args.limit)
    requests = [r for r in trace if scaling.fits(r)]
    cost = live_cost(CostModel())
    print(
        f"{args.trace.name}: {len(requests)} interactive requests over about "
        f"{requests[-1].arrival_s * scaling.time:.0f} s live; batch of {args.batch_lines} lines",
        flush=True,
    )
    rows = []
    for with_batch in (False, True):
        row = _run(args, requests, scaling, cost, with_batch)
        rows.append(row)
        name = row["run"]
        print(
            f"  {name}: TTFT p90 {_ms(row['interactive']['ttft_p90_s'])}, "
            f"TPOT p90 {_ms(row['interactive']['tpot_p90_s'])}",
            flush=True,
        )
    report = _report(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    public = [{k: v for k, v in row.items() if k not in ("ttft_samples_s", "timeline")} for row in rows]
    (args.out / "results.json").write_text(json.dumps({"runs": public, "summary": report}, indent=2) + "\n")
    print(_table(rows, report), flush=True)
    _plot(rows, args.out)
    print(f"\nwrote {args.out / 'results.json'}, {args.out / 'ttft.png'}, {args.out / 'batch_progress.png'}")
    return 0


# --- one run ---------------------------------------------------------------------------------------


@dataclass
class _Watch:
    """Half-second samples of the fleet (ClusterStatus) and of the batch's progress."""

    nats_url: str
    fleet: list[tuple[float, list]] = field(default_factory=list)  # (t, [(role, inflight, running)])
    batch: list[tuple[float, int]] = field(default_factory=list)  # (t, lines completed)
    stop: threading.Event = field(default_factory=threading.Event)


def _run(args, requests, scaling: Scaling, cost: CostModel, with_batch: bool) -> dict:
    with ExitStack() as stack:
        server = stack.enter_context(procs.nats_server())
        live = bench_stack.start(
            stack,
            server,
            *worker_flags(cost, scaling, args.cache_blocks),
            prefill=args.prefill,
            decode=args.decode,
        )
        watch = _Watch(server.url)
        started = time.monotonic()
        batch_id = _submit_batch(live.url, args) if with_batch else None
        sampler = threading.Thread(target=anyio.run, args=(_sample, watch, live.url, batch_id, started), daemon=True)
        sampler.start()
        samples = anyio.run(replay_http, live.url, requests, scaling)
        replay_s = time.monotonic() - started
        batch = _finish_batch(live.url, batch_id, args, started) if batch_id else None
        watch.stop.set()
        sampler.join(timeout=5)
    interactive = summarize_live("switchyard", requests, samples, scaling, args)
    row = {
        "run": "with batch" if with_batch else "alone",
        "replay_s": replay_s,
        "interactive": {k: v for k, v in interactive.items() if k != "ttft_samples_s"},
        "ttft_samples_s": interactive["ttft_samples_s"],
        "utilisation_during_replay": _utilisation(watch, 0.0, replay_s),
        "timeline": watch.batch,
    }
    if batch is not None:
        during = max((done for t, done in watch.batch if t <= replay_s), default=0)
        row["batch"] = batch | {
            "lines_during_replay": during,
            "lines_per_minute_during_replay": during / replay_s * 60 if replay_s else 0.0,
        }
        row["utilisation_whole_run"] = _utilisation(watch, 0.0, batch["completion_s"])
    return row


def _batch_lines(args) -> bytes:
    system = "You are the yard master of a busy freight terminal; answer in one short sentence. " * 8
    out = []
    for i in range(args.batch_lines):
        body = {
            "model": MODEL,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": f"Where is wagon {i}?"}],
            "max_tokens": args.batch_max_tokens,
        }
        line = {"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
        out.append(json.dumps(line))
    return ("\n".join(out) + "\n").encode()


def _submit_batch(url: str, args) -> str:
    with httpx.Client(base_url=url + "/v1", timeout=120) as client:
        upload = client.post("/files", files={"file": ("batch.jsonl", _batch_lines(args))}, data={"purpose": "batch"})
        upload.raise_for_status()
        created = client.post(
            "/batches",
            json={"input_file_id": upload.json()["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"},
        )
        created.raise_for_status()
        return created.json()["id"]


def _finish_batch(url: str, batch_id: str, args, started: float) -> dict:
    deadline = time.monotonic() + args.batch_timeout_s
    with httpx.Client(base_url=url + "/v1", timeout=60) as client:
        while True:
            batch = client.get(f"/batches/{batch_id}").json()
            if batch["status"] in _DONE or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        completion_s = time.monotonic() - started
        prompt = cached = 0
        if batch.get("output_file_id"):
            content = client.get(f"/files/{batch['output_file_id']}/content").text
            for raw in content.splitlines():
                usage = json.loads(raw)["response"]["body"]["usage"]
                prompt += usage["prompt_tokens"]
                cached += usage["prompt_tokens_details"]["cached_tokens"]
    counts = batch["request_counts"]
    return {
        "status": batch["status"],
        "lines": counts["total"],
        "completed": counts["completed"],
        "failed": counts["failed"],
        "completion_s": completion_s,
        "lines_per_minute": counts["completed"] / completion_s * 60 if completion_s else 0.0,
        "cache_hit_ratio": cached / prompt if prompt else 0.0,
    }


async def _sample(watch: _Watch, url: str, batch_id: str | None, started: float) -> None:
    nc = await nats.connect(watch.nats_url)
    request = codec.SCHEDULER_REQUEST.encode(StatusRequest())
    try:
        async with httpx.AsyncClient(base_url=url + "/v1", timeout=5) as client:
            while not watch.stop.is_set():
                now = time.monotonic() - started
                try:
                    reply = codec.SCHEDULER_REPLY.decode((await nc.request(subjects.SUBMIT, request, timeout=1)).data)
                    if isinstance(reply, ClusterStatus):
                        watch.fleet.append((now, [(w.role, w.inflight_tokens, w.running) for w in reply.workers]))
                    if batch_id is not None:
                        batch = (await client.get(f"/batches/{batch_id}")).json()
                        watch.batch.append((now, batch["request_counts"]["completed"]))
                except Exception:  # a slow answer under load: skip this sample
                    pass
                await anyio.sleep(0.5)
    finally:
        await nc.close()


def _utilisation(watch: _Watch, start: float, end: float) -> dict:
    window = [workers for t, workers in watch.fleet if start <= t <= end]
    prefill = [inflight > 0 for workers in window for role, inflight, _ in workers if role == "prefill"]
    decode = [running for workers in window for role, _, running in workers if role == "decode"]
    return {
        "samples": len(window),
        "prefill_busy_share": sum(prefill) / len(prefill) if prefill else 0.0,
        "decode_mean_sequences": sum(decode) / len(decode) if decode else 0.0,
    }


# --- report --------------------------------------------------------------------------------------


def _report(rows: list[dict]) -> dict:
    alone, mixed = rows[0]["interactive"], rows[1]["interactive"]

    def ratio(key: str) -> float | None:
        a, b = alone.get(key), mixed.get(key)
        return b / a if a and b is not None else None

    return {
        "ttft_p50_ratio": ratio("ttft_p50_s"),
        "ttft_p90_ratio": ratio("ttft_p90_s"),
        "tpot_p50_ratio": ratio("tpot_p50_s"),
        "tpot_p90_ratio": ratio("tpot_p90_s"),
        "ttft_p90_within_10_percent": (ratio("ttft_p90_s") or 99) <= 1.10,
    }


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.0f} ms"


def _table(rows: list[dict], report: dict) -> str:
    lines = [
        "",
        f"{'run':<12}{'done':>6}{'TTFT p50':>11}{'TTFT p90':>11}{'TPOT p50':>11}{'TPOT p90':>11}"
        f"{'prefill busy':>14}{'decode seqs':>13}",
    ]
    for row in rows:
        r, u = row["interactive"], row["utilisation_during_replay"]
        lines.append(
            f"{row['run']:<12}{r['completed']:>6}{_ms(r['ttft_p50_s']):>11}{_ms(r['ttft_p90_s']):>11}"
            f"{_ms(r['tpot_p50_s']):>11}{_ms(r['tpot_p90_s']):>11}{u['prefill_busy_share']:>14.2f}"
            f"{u['decode_mean_sequences']:>13.1f}"
        )
    fmt = {k: "-" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v)) for k, v in report.items()}
    lines.append(
        f"\nwith the batch / alone: TTFT p50 x{fmt['ttft_p50_ratio']}, p90 x{fmt['ttft_p90_ratio']} "
        f"(within 10%: {fmt['ttft_p90_within_10_percent']}); TPOT p50 x{fmt['tpot_p50_ratio']}, "
        f"p90 x{fmt['tpot_p90_ratio']}"
    )
    batch = rows[1].get("batch")
    if batch:
        whole = rows[1].get("utilisation_whole_run", {})
        lines.append(
            f"batch: {batch['status']}, {batch['completed']}/{batch['lines']} lines ({batch['failed']} failed) in "
            f"{batch['completion_s']:.0f} s: {batch['lines_per_minute']:.0f} lines/min over its run, "
            f"{batch['lines_per_minute_during_replay']:.0f} lines/min during the replay "
            f"({batch['lines_during_replay']} lines); prefix-cache hit ratio {batch['cache_hit_ratio']:.3f}; "
            f"whole run: prefill busy {whole.get('prefill_busy_share', 0):.2f}, "
            f"decode {whole.get('decode_mean_sequences', 0):.1f} sequences"
        )
    return "\n".join(lines)


def _plot(rows: list[dict], out: Path) -> None:
    fig, ax = plots.figure()
    for row in rows:
        plots.cdf(ax, row["ttft_samples_s"], f"interactive, {row['run']}")
    plots.save(
        fig,
        ax,
        out / "ttft.png",
        title="Interactive time to first token, alone and beside a batch",
        xlabel="time to first token, trace seconds",
        ylabel="fraction of requests",
        log_x=True,
    )
    fig, ax = plots.figure()
    mixed = rows[1]
    timeline = mixed.get("timeline") or []
    if timeline:
        ax.plot([t for t, _ in timeline], [done for _, done in timeline], label="batch lines completed")
    ax.axvspan(0, mixed["replay_s"], alpha=0.15, label="interactive replay")
    plots.save(fig, ax, out / "batch_progress.png", title="Batch progress", xlabel="seconds", ylabel="lines")


__all__ = ["add_arguments", "run"]
