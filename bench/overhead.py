"""``switchyard bench overhead``: what the fabric itself costs, beside bare nats-py.

With a zero-cost ``sim`` engine every millisecond measured is Switchyard's own:
  (a) time to first token through ingress -> scheduler -> prefill -> decode -> SSE,
      p50 and p99, beside a zero-cost engine serving HTTP alone (``bench.direct_engine``)
      and a bare nats-py request/reply round trip;
  (b) streamed tokens/s through the HTTP API at each concurrency, beside the engine
      alone and bare nats-py publish/subscribe (one message per token, and one per 256);
  (c) resident memory of every process, idle and at the highest concurrency.
The stack runs as separate processes, exactly as ``switchyard up`` starts it; the
load generator shares the machine's cores with it, so the figures are a floor.
Prints a table, writes ``results.json`` and PNG plots into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path

import anyio
import anyio.lowlevel
import httpx
import nats
import nats.errors
import psutil

from switchyard import procs
from switchyard.bench import plots
from switchyard.bench import stack as bench_stack
from switchyard.bench.stats import percentile
from switchyard.observability import settle

_DRAIN_S = 10.0  # bare pub/sub: how long the subscriber may lag the publisher's last message

MODEL = "switchyard-sim"
PROMPT = [{"role": "user", "content": "Measure the yard: how long does a token take to get through?"}]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, default=Path("bench/results/overhead"), help="results folder")
    p.add_argument("--ttft-requests", type=int, default=300, help="sequential requests for TTFT")
    p.add_argument("--concurrency", default="1,64,256", help="comma-separated stream counts")
    p.add_argument("--stream-tokens", type=int, default=256, help="max_tokens of each streamed request")
    p.add_argument("--seconds", type=float, default=6.0, help="length of each throughput run")
    p.add_argument(
        "--min-publish-interval-s",
        type=float,
        default=0.001,
        help="decode workers' message floor (0: one bus message per engine step)",
    )
    p.add_argument("--quick", action="store_true", help="a smoke run: few requests, short runs")


@dataclass
class Results:
    ttft_ms: dict = field(default_factory=dict)  # p50/p99: the fabric, the engine alone, bare NATS
    throughput: list = field(default_factory=list)  # one row per concurrency: fabric and engine alone
    bare_pubsub_tokens_per_s: dict = field(default_factory=dict)
    rss_mib: dict = field(default_factory=dict)  # process -> {idle, loaded}
    settings: dict = field(default_factory=dict)


def run(args: argparse.Namespace) -> int:
    if args.quick:
        args.ttft_requests, args.seconds, args.stream_tokens = 40, 1.5, 64
    levels = [int(c) for c in args.concurrency.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    results = Results(
        settings={
            "ttft_requests": args.ttft_requests,
            "concurrency": levels,
            "min_publish_interval_s": args.min_publish_interval_s,
            "stream_tokens": args.stream_tokens,
            "seconds": args.seconds,
            "cpus": psutil.cpu_count(),
        }
    )
    with ExitStack() as stack:
        server = stack.enter_context(procs.nats_server())
        direct = _start_direct_engine(stack)
        children = bench_stack.start(stack, server, "--min-publish-interval-s", str(args.min_publish_interval_s))
        url = children.url
        procs.wait_for_port("127.0.0.1", direct.port, 30)
        print(f"stack up at {url}, engine alone at {direct.url}; measuring (engine cost zero)", flush=True)
        anyio.run(_measure, url, direct.url, server.url, levels, args, results, children)
    _report(results, args.out)
    return 0


@dataclass
class _Direct:
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def _start_direct_engine(stack: ExitStack) -> _Direct:
    import sys

    port = procs.free_port()
    proc = procs.spawn(
        [sys.executable, "-m", "switchyard.bench.direct_engine", "--port", str(port)], env=procs.child_env()
    )
    stack.callback(procs.stop, [proc])
    return _Direct(port)


async def _measure(
    url: str, direct_url: str, nats_url: str, levels: list[int], args, results: Results, children: bench_stack.Stack
) -> None:
    results.rss_mib = {name: {"idle": _rss(p.pid)} for name, p in children.processes.items()}
    limits = httpx.Limits(max_connections=max(levels) + 8, max_keepalive_connections=max(levels) + 8)
    async with (
        httpx.AsyncClient(base_url=url + "/v1", timeout=60, limits=limits) as fabric,
        httpx.AsyncClient(base_url=direct_url + "/v1", timeout=60, limits=limits) as direct,
    ):
        await _ttft(fabric, direct, nats_url, args.ttft_requests, results)
        for level in levels:
            sampler = _RssSampler(children.processes) if level == max(levels) else None
            row = await _throughput(fabric, level, args.stream_tokens, args.seconds, sampler)
            alone = await _throughput(direct, level, args.stream_tokens, args.seconds, None)
            row["engine_alone_tokens_per_s"] = alone["tokens_per_s"]
            row["kept_of_engine_alone"] = row["tokens_per_s"] / alone["tokens_per_s"]
            results.throughput.append(row)
            if sampler is not None:
                for name, peak in sampler.peaks.items():
                    results.rss_mib[name]["loaded"] = peak
            print(
                f"  {level:>4} streams: {row['tokens_per_s']:>9.0f} tokens/s "
                f"(engine alone {alone['tokens_per_s']:.0f})",
                flush=True,
            )
    results.bare_pubsub_tokens_per_s = {
        "one_message_per_token": await _bare_pubsub(nats_url, tokens_per_message=1, seconds=args.seconds / 2),
        "one_message_per_256_tokens": await _bare_pubsub(nats_url, tokens_per_message=256, seconds=args.seconds / 2),
    }


# --- (a) time to first token ---------------------------------------------------------------------


async def _ttft(fabric: httpx.AsyncClient, direct: httpx.AsyncClient, nats_url: str, n: int, results: Results) -> None:
    for _ in range(10):  # warm the connections and code paths
        await _first_token_s(fabric)
        await _first_token_s(direct)
    through, alone = [], []
    for _ in range(n):  # interleaved, so both see the same machine
        through.append(await _first_token_s(fabric))
        alone.append(await _first_token_s(direct))
    bare = await _bare_request_reply(nats_url, n)
    t = results.ttft_ms = ttft_figures({"fabric": through, "engine_alone": alone, "nats_rr": bare})
    print(
        f"  TTFT p50 {t['fabric_p50']:.2f} ms (engine alone {t['engine_alone_p50']:.2f} ms, "
        f"bare NATS request/reply {t['nats_rr_p50']:.2f} ms)",
        flush=True,
    )


async def _first_token_s(client: httpx.AsyncClient) -> float:
    body = {"model": MODEL, "messages": PROMPT, "max_tokens": 2, "stream": True}
    started = time.perf_counter()
    first = None
    async with client.stream("POST", "/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if first is None and line.startswith("data: ") and '"content":"' in line and '"content":""' not in line:
                first = time.perf_counter() - started
    if first is None:
        raise RuntimeError("stream ended without a token")
    return first


async def _bare_request_reply(nats_url: str, n: int) -> list[float]:
    payload = b"x" * 200
    responder = await nats.connect(nats_url)
    requester = await nats.connect(nats_url)
    try:

        async def echo(msg):
            await msg.respond(msg.data)

        await responder.subscribe("bench.echo", cb=echo)
        await settle(responder)
        # The flush says the responder's server has the subscription; the requester's may
        # hear of it a moment later (a cluster propagates interest): wait for it, untimed.
        deadline = time.monotonic() + 10.0
        while True:
            try:
                await requester.request("bench.echo", payload, timeout=5)
                break
            except nats.errors.NoRespondersError:
                if time.monotonic() > deadline:
                    raise
                await anyio.sleep(0.05)
        samples = []
        for i in range(n + 10):
            started = time.perf_counter()
            await requester.request("bench.echo", payload, timeout=5)
            if i >= 10:
                samples.append(time.perf_counter() - started)
        return samples
    finally:
        await requester.close()
        await responder.close()


# --- (b) streamed tokens per second --------------------------------------------------------------


async def _throughput(
    client: httpx.AsyncClient, streams: int, max_tokens: int, seconds: float, sampler: _RssSampler | None
) -> dict:
    tokens = 0
    requests = 0
    deadline = time.perf_counter() + seconds

    async def one_stream() -> None:
        nonlocal tokens, requests
        while time.perf_counter() < deadline:
            got = await _stream_tokens(client, max_tokens)  # not `tokens += await ...`: that
            tokens += got  # reads `tokens` before the await and loses other streams' counts
            requests += 1

    if sampler is not None:
        sampler.start()
    started = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for _ in range(streams):
            tg.start_soon(one_stream)
    elapsed = time.perf_counter() - started
    if sampler is not None:
        sampler.stop()
    return {
        "streams": streams,
        "tokens": tokens,
        "requests": requests,
        "seconds": elapsed,
        "tokens_per_s": tokens / elapsed,
    }


async def _stream_tokens(client: httpx.AsyncClient, max_tokens: int) -> int:
    """Completion tokens of one streamed request, from its usage chunk. The stream is
    read as raw bytes (no line splitting): the client shares the cores with what it
    measures, so it does as little per token as it can."""
    body = {
        "model": MODEL,
        "messages": PROMPT,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    tail = b""
    async with client.stream("POST", "/chat/completions", json=body) as response:
        response.raise_for_status()
        async for raw in response.aiter_raw():
            tail = (tail + raw)[-4096:]
    found = bench_stack.COMPLETION_TOKENS.findall(tail)
    if not found:
        raise RuntimeError("stream ended without usage")
    return int(found[-1])


async def _bare_pubsub(nats_url: str, tokens_per_message: int, seconds: float) -> float:
    """Tokens/s that bare nats-py moves publisher -> subscriber in one process."""
    from switchyard.schemas import StreamBatch, StreamChunk, codec

    chunks = [StreamChunk(request_id=f"r{i}", seq=i, token_ids=[1000 + i]) for i in range(tokens_per_message)]
    payload = codec.STREAM_BATCH.encode(StreamBatch(sender="bench", chunks=chunks))
    pub = await nats.connect(nats_url)
    sub_nc = await nats.connect(nats_url, pending_size=64 * 1024 * 1024)
    try:
        sub = await sub_nc.subscribe(
            "bench.tokens", pending_msgs_limit=1_000_000, pending_bytes_limit=1024 * 1024 * 1024
        )
        await settle(sub_nc)
        received = 0
        sent = 0
        done, drained = anyio.Event(), anyio.Event()

        async def consume():
            nonlocal received
            async for msg in sub.messages:
                codec.STREAM_BATCH.decode(msg.data)
                received += 1
                if done.is_set() and received >= sent:
                    drained.set()
                    return

        started = time.perf_counter()
        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            while time.perf_counter() - started < seconds:
                for _ in range(100):
                    await pub.publish("bench.tokens", payload)
                sent += 100
                await anyio.lowlevel.checkpoint()
            await settle(pub)
            done.set()
            await pub.publish("bench.tokens", payload)
            sent += 1
            await settle(pub)
            # A subscriber the server finds too slow loses messages, and then the count never
            # comes up to ``sent``: wait for the rest a while, not forever.
            with anyio.move_on_after(_DRAIN_S):
                await drained.wait()
            tg.cancel_scope.cancel()
        elapsed = time.perf_counter() - started
        if received < sent:
            print(
                f"bare pub/sub: {sent - received} of {sent} messages never arrived (a slow consumer)", file=sys.stderr
            )
        return received * tokens_per_message / elapsed
    finally:
        await pub.close()
        await sub_nc.close()


# --- (c) memory -------------------------------------------------------------------------------


def _rss(pid: int) -> float:
    try:
        return psutil.Process(pid).memory_info().rss / 2**20
    except psutil.Error:
        return float("nan")


class _RssSampler:
    def __init__(self, processes: dict) -> None:
        self.processes = processes
        self.peaks = {name: 0.0 for name in processes}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(0.2):
            for name, proc in self.processes.items():
                self.peaks[name] = max(self.peaks[name], _rss(proc.pid))


# --- report ---------------------------------------------------------------------------------------


def ttft_figures(samples_s: dict[str, list[float]]) -> dict:
    """p50 and p99 in ms of each named sample set (``bench.stats``' definition), the samples in
    ms, and what the fabric adds at p50 over the engine alone."""
    t: dict = {}
    for name, samples in samples_s.items():
        for q in (50, 99):
            value = percentile(samples, q)
            assert value is not None, f"no {name} samples"
            t[f"{name}_p{q}"] = value * 1e3
        t[f"{name}_samples_ms"] = [x * 1e3 for x in samples]
    t["added_p50"] = t["fabric_p50"] - t["engine_alone_p50"]
    return t


def _report(results: Results, out: Path) -> None:
    t = results.ttft_ms
    per_token = results.bare_pubsub_tokens_per_s["one_message_per_token"]
    batched = results.bare_pubsub_tokens_per_s["one_message_per_256_tokens"]
    lines = [
        "",
        "== time to first token, zero-cost engine (ms) ==",
        f"{'':<36}{'p50':>9}{'p99':>9}",
        f"{'switchyard HTTP->NATS->P->D->SSE':<36}{t['fabric_p50']:>9.2f}{t['fabric_p99']:>9.2f}",
        f"{'engine alone, HTTP/SSE':<36}{t['engine_alone_p50']:>9.2f}{t['engine_alone_p99']:>9.2f}",
        f"{'bare nats-py request/reply':<36}{t['nats_rr_p50']:>9.2f}{t['nats_rr_p99']:>9.2f}",
        f"{'added by switchyard (vs alone)':<36}{t['added_p50']:>9.2f}{t['fabric_p99'] - t['engine_alone_p99']:>9.2f}",
        f"{'ratio switchyard / bare NATS r/r':<36}{t['fabric_p50'] / t['nats_rr_p50']:>9.1f}"
        f"{t['fabric_p99'] / t['nats_rr_p99']:>9.1f}",
        "",
        "== streamed tokens/s through the HTTP API ==",
        f"{'streams':>8}{'switchyard':>12}{'alone':>10}{'kept':>8}{'vs pub/sub 1/token':>20}{'vs pub/sub 256/msg':>20}",
    ]
    for row in results.throughput:
        lines.append(
            f"{row['streams']:>8}{row['tokens_per_s']:>12.0f}{row['engine_alone_tokens_per_s']:>10.0f}"
            f"{row['kept_of_engine_alone']:>8.0%}{row['tokens_per_s'] / per_token:>20.2f}"
            f"{row['tokens_per_s'] / batched:>20.3f}"
        )
    lines += [
        f"bare nats-py pub/sub, one message per token:   {per_token:>10.0f} tokens/s",
        f"bare nats-py pub/sub, one message per 256:     {batched:>10.0f} tokens/s",
        "",
        "== resident memory (MiB) ==",
        f"{'process':<14}{'idle':>8}{'loaded':>8}",
    ]
    for name, rss in results.rss_mib.items():
        lines.append(f"{name:<14}{rss['idle']:>8.1f}{rss.get('loaded', float('nan')):>8.1f}")
    print("\n".join(lines), flush=True)
    (out / "results.json").write_text(json.dumps(asdict(results), indent=2))
    _plots(results, out)
    print(f"\nwrote {out / 'results.json'}, {out / 'ttft.png'}, {out / 'throughput.png'}, {out / 'memory.png'}")


def _plots(results: Results, out: Path) -> None:
    fig, ax = plots.figure()
    for key, label in (
        ("fabric_samples_ms", "switchyard TTFT (zero-cost engine)"),
        ("engine_alone_samples_ms", "engine alone, HTTP/SSE"),
        ("nats_rr_samples_ms", "bare nats-py request/reply"),
    ):
        plots.cdf(ax, results.ttft_ms[key], label)
    plots.save(
        fig,
        ax,
        out / "ttft.png",
        title="Time to first token added by the fabric",
        xlabel="milliseconds",
        ylabel="fraction of requests",
        log_x=True,
    )

    fig, ax = plots.figure()
    xs = list(range(len(results.throughput)))
    ax.bar([x - 0.2 for x in xs], [r["tokens_per_s"] for r in results.throughput], 0.4, label="switchyard HTTP/SSE")
    ax.bar(
        [x + 0.2 for x in xs],
        [r["engine_alone_tokens_per_s"] for r in results.throughput],
        0.4,
        label="engine alone, HTTP/SSE",
    )
    ax.set_xticks(xs, [str(r["streams"]) for r in results.throughput])
    for key, style in (("one_message_per_token", "--"), ("one_message_per_256_tokens", ":")):
        ax.axhline(
            results.bare_pubsub_tokens_per_s[key],
            linestyle=style,
            color="k",
            label=f"bare nats-py, {key.replace('_', ' ')}",
        )
    plots.save(
        fig,
        ax,
        out / "throughput.png",
        title="Streamed tokens per second",
        xlabel="concurrent streams",
        ylabel="tokens/s",
        log_y=True,
    )

    fig, ax = plots.figure()
    names = list(results.rss_mib)
    width = 0.4
    xs = list(range(len(names)))
    ax.bar([x - width / 2 for x in xs], [results.rss_mib[n]["idle"] for n in names], width, label="idle")
    ax.bar([x + width / 2 for x in xs], [results.rss_mib[n].get("loaded", 0) for n in names], width, label="under load")
    ax.set_xticks(list(xs), names, rotation=20)
    plots.save(fig, ax, out / "memory.png", title="Memory per process", xlabel="process", ylabel="MiB resident")


__all__ = ["add_arguments", "run", "ttft_figures"]
