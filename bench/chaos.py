"""``switchyard bench chaos``: the same streamed requests through an undisturbed stack and
through one whose processes are killed under them, every output compared.

Each run is its own ``switchyard up`` (sim engine with a non-zero cost model, so streams
last seconds and a kill lands mid-decode; ``--prefill 2 --decode 2 --schedulers 2``),
supervised as an operator runs it: ``up`` restarts whatever dies. The reference run
records every request's streamed text; each chaos run sends the very same requests
(greedy: the sim engine's tokens are a pure function of the prompt and position) while
a background task SIGKILLs:

- a random worker child (prefill or decode) every ``--kill-every-s``;
- the active scheduler once, about a third into the run. Which replica is active is read
  from the lease (JetStream KV ``switchyard_scheduler_lease``): one replica is frozen
  (SIGSTOP) for half a second; if the key's holder renewed it meanwhile, the frozen one
  was the standby (it is thawed and the other is killed), else it is killed frozen;
- nats-server once, about two thirds in (``up`` restarts it on its port and store).

Kill times fall half-way between two worker kills, so no two kills coincide. Every
request ends as one of: completed identical to its reference, completed different, a
clean error (an HTTP error with an OpenAI error body, or an SSE ``error`` event), a hang
(no event for ``--idle-timeout-s`` or no end within ``--request-timeout-s``), or broken
(anything else: the connection cut, a stream ending with neither ``[DONE]`` nor an
error). Beside them: tokens recomputed and migrations (the ingress's counters, before
and after; the ingress itself is never killed), the budget stranded after the run (the
scheduler's ledger through ``StatusRequest`` on NATS, as admin, once every stream has
ended), and per kill how long until the child was restarted, until the next request sent
after it was served, and until ``/health`` showed the fleet whole again after a dip.

Everything is bounded: each request, each NATS call, each wait for the stack; the stack
is always stopped (``up`` given SIGTERM, then every process left of it SIGKILLed).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import anyio
import httpx
import msgspec
import nats
import nats.errors
import psutil

from switchyard import procs
from switchyard.bench import plots
from switchyard.bench.stats import percentile

MODEL = "switchyard-sim"
KINDS = ("workers", "scheduler", "nats")
LEASE_BUCKET, LEASE_KEY = "switchyard_scheduler_lease", "active"  # scheduler/lease.py's
OUTCOMES = ("identical", "different", "clean_error", "hang", "broken")
_READY = re.compile(r"Switchyard is ready: .*\(NATS ([^,\s]+), admin credentials ([^,\s)]+)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=1000, help="streamed greedy requests per run")
    p.add_argument("--concurrency", type=int, default=64, help="requests in flight at once")
    p.add_argument("--seed", type=int, default=0, help="seeds the prompts and the choice of victims")
    p.add_argument("--prompt-tokens", default="50,400", help="prompt length range, tokens (min,max)")
    p.add_argument("--max-tokens", default="64,256", help="max_tokens range (min,max)")
    p.add_argument(
        "--kill",
        action="append",
        default=None,
        help="one chaos run killing these kinds (comma-separated: workers, scheduler, nats); repeat for "
        "more runs (default: one run with all three, one with workers only)",
    )
    p.add_argument("--kill-every-s", type=float, default=10.0, help="seconds between worker kills")
    p.add_argument("--request-timeout-s", type=float, default=120.0, help="a request not ended by then hangs")
    p.add_argument("--idle-timeout-s", type=float, default=30.0, help="a stream silent this long hangs")
    p.add_argument("--settle-s", type=float, default=10.0, help="how long the ledger may take to drain after a run")
    p.add_argument("--prefill", type=int, default=2)
    p.add_argument("--decode", type=int, default=2)
    p.add_argument("--schedulers", type=int, default=2)
    p.add_argument("--prefill-base-s", type=float, default=0.01, help="sim cost: fixed seconds of one prefill")
    p.add_argument("--prefill-per-token-s", type=float, default=5e-5, help="sim cost: per uncached prompt token")
    p.add_argument("--decode-step-base-s", type=float, default=0.02, help="sim cost: fixed seconds of a decode step")
    p.add_argument("--decode-step-per-seq-s", type=float, default=5e-4, help="sim cost: per sequence in the batch")
    p.add_argument("--out", type=Path, default=Path("bench/results/chaos"))


# --- the requests ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    index: int
    prompt: list[int]
    max_tokens: int


def make_requests(n: int, seed: int, prompt_range: tuple[int, int], max_tokens_range: tuple[int, int]) -> list[Request]:
    """Seeded prompts of token ids the bundled sim-tiny vocabulary holds (as ``bench live``)."""
    rng = random.Random(seed)
    requests = []
    for i in range(n):
        length = rng.randint(*prompt_range)
        prompt = [rng.randrange(256, 4056) for _ in range(length)]
        requests.append(Request(i, prompt, rng.randint(*max_tokens_range)))
    return requests


def _range(text: str) -> tuple[int, int]:
    low, high = (int(x) for x in text.split(","))
    if not 0 < low <= high:
        raise SystemExit(f"bad range {text!r}: want MIN,MAX with 0 < MIN <= MAX")
    return low, high


def _kinds(text: str) -> tuple[str, ...]:
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    unknown = set(kinds) - set(KINDS)
    if unknown or not kinds:
        raise SystemExit(f"--kill {text!r}: kinds are {', '.join(KINDS)}")
    return kinds


# --- one request's stream --------------------------------------------------------------------------


class _Choice(msgspec.Struct):
    text: str = ""
    finish_reason: str | None = None


class _Usage(msgspec.Struct):
    completion_tokens: int = 0


class _Error(msgspec.Struct):
    message: str = ""
    code: str | None = None


class _Event(msgspec.Struct):
    """One SSE event of ``/v1/completions``, or an OpenAI error body."""

    choices: list[_Choice] = []
    usage: _Usage | None = None
    error: _Error | None = None


_EVENT = msgspec.json.Decoder(_Event)


@dataclass
class Outcome:
    """How one request ended; times in seconds from the run's start."""

    ended_as: str = "broken"  # completed, clean_error, hang, broken (compared later: identical/different)
    text: str = ""
    completion_tokens: int = 0
    finish_reason: str | None = None
    error: str = ""
    status: int = 0
    started_s: float = 0.0
    ended_s: float = 0.0
    events: int = 0  # SSE data lines received (a stalled stream: how far it got)
    last_event_s: float = 0.0


@dataclass(frozen=True)
class Bounds:
    request_s: float
    idle_s: float


async def _one(client: httpx.AsyncClient, request: Request, bounds: Bounds, t0: float) -> Outcome:
    out = Outcome(started_s=time.monotonic() - t0)
    with anyio.move_on_after(bounds.request_s) as scope:
        try:
            await _stream(client, request, out, t0)
        except httpx.TimeoutException:
            out.ended_as, out.error = "hang", f"no byte for {bounds.idle_s:.0f} s"
        except (httpx.HTTPError, msgspec.DecodeError) as exc:
            out.ended_as, out.error = "broken", f"{type(exc).__name__}: {exc}"
    if scope.cancelled_caught:
        out.ended_as, out.error = "hang", f"not ended within {bounds.request_s:.0f} s"
    out.ended_s = time.monotonic() - t0
    return out


async def _stream(client: httpx.AsyncClient, request: Request, out: Outcome, t0: float) -> None:
    body = {
        "model": MODEL,
        "prompt": request.prompt,
        "max_tokens": request.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
    }
    parts: list[str] = []
    try:
        await _read_events(client, body, out, t0, parts)
    finally:
        out.text = "".join(parts)  # whole, or as far as a failed stream got


async def _read_events(client: httpx.AsyncClient, body: dict, out: Outcome, t0: float, parts: list[str]) -> None:
    async with client.stream("POST", "/v1/completions", json=body) as response:
        out.status = response.status_code
        if response.status_code != 200:
            _http_error(await response.aread(), out)
            return
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            out.events, out.last_event_s = out.events + 1, time.monotonic() - t0
            if line == "data: [DONE]":
                out.ended_as = "completed" if out.finish_reason is not None else "broken"
                return
            event = _EVENT.decode(line[6:])
            if event.error is not None:
                out.ended_as, out.error = "clean_error", _describe(event.error)
                return
            for choice in event.choices:
                parts.append(choice.text)
                out.finish_reason = choice.finish_reason or out.finish_reason
            if event.usage is not None:
                out.completion_tokens = event.usage.completion_tokens
    out.error = "the stream ended with neither [DONE] nor an error event"


def _http_error(raw: bytes, out: Outcome) -> None:
    try:
        event = _EVENT.decode(raw)
    except msgspec.DecodeError:
        event = _Event()
    if event.error is None:
        out.ended_as, out.error = "broken", f"HTTP {out.status} without an OpenAI error body"
    else:
        out.ended_as, out.error = "clean_error", f"HTTP {out.status} {_describe(event.error)}"


def _describe(error: _Error) -> str:
    return f"{error.code}: {error.message[:200]}" if error.code else error.message[:200]


async def _drive(url: str, requests: list[Request], concurrency: int, bounds: Bounds, t0: float) -> list[Outcome]:
    """Every request, in order, ``concurrency`` at a time."""
    outcomes: list[Outcome | None] = [None] * len(requests)
    send, receive = anyio.create_memory_object_stream[Request](len(requests))
    for request in requests:
        send.send_nowait(request)
    send.close()
    timeout = httpx.Timeout(connect=5.0, read=bounds.idle_s, write=5.0, pool=bounds.request_s)
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:

        async def sender() -> None:
            async for request in receive:
                outcomes[request.index] = await _one(client, request, bounds, t0)

        async with anyio.create_task_group() as tg:
            for _ in range(concurrency):
                tg.start_soon(sender)
    assert all(o is not None for o in outcomes)
    return [o for o in outcomes if o is not None]


# --- the stack ---------------------------------------------------------------------------------------


@dataclass
class Up:
    """A running ``switchyard up``: its process, its HTTP URL, and its private NATS."""

    process: psutil.Process
    url: str
    nats_url: str
    admin_credentials: Path
    log: Path

    def children(self) -> dict[str, psutil.Process]:
        """Live children by name (``prefill-0``, ``scheduler-1``, ``nats-server``, ...)."""
        found = {}
        for child in self.process.children():
            try:
                cmdline = child.cmdline()
            except psutil.Error:
                continue
            if "--child" in cmdline:
                found[cmdline[cmdline.index("--child") + 1]] = child
            elif cmdline and Path(cmdline[0]).name == "nats-server":
                found["nats-server"] = child
        return found

    def restarts(self) -> int:
        return self.log.read_text(errors="replace").count("; restarting it in")


@contextmanager
def running_up(flags: list[str], log: Path, timeout_s: float = 90.0) -> Iterator[Up]:
    """``switchyard up`` with its JetStream in a data folder of its own beside ``log``: a
    benchmark's stack never takes the user's folder (nor waits for a ``make run`` holding it)."""
    port = procs.free_port()
    data = log.with_suffix(".data")
    command = procs.service_command(
        "up", "--port", str(port), "--log-level", "warning", "--data-dir", str(data), *flags
    )
    with log.open("w") as sink:
        popen = procs.spawn(command, env=procs.child_env(), stdout=sink)  # its own group, dies with us
    process = psutil.Process(popen.pid)
    try:
        yield _wait_ready(process, popen, f"http://127.0.0.1:{port}", log, timeout_s)
    finally:
        _stop(process, popen)
        shutil.rmtree(data, ignore_errors=True)


def _wait_ready(process: psutil.Process, popen: subprocess.Popen, url: str, log: Path, timeout_s: float) -> Up:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and popen.poll() is None:
        found = _READY.search(log.read_text(errors="replace"))
        if found:
            return Up(process, url, found.group(1), Path(found.group(2)), log)
        time.sleep(0.1)
    tail = log.read_text(errors="replace")[-3000:]
    raise procs.ProcessError(f"switchyard up was not ready within {timeout_s:.0f} s; its log ends:\n{tail}")


def _stop(process: psutil.Process, popen: subprocess.Popen) -> None:
    """SIGTERM ``up`` (it stops its children), then SIGKILL whatever of it is left."""
    try:
        family = [process, *process.children(recursive=True)]
    except psutil.Error:
        family = [process]
    for p in family:  # a frozen child would ignore its SIGTERM
        try:
            p.resume()
        except psutil.Error:
            pass
    popen.terminate()
    try:
        popen.wait(30)
    except subprocess.TimeoutExpired:
        pass
    for p in family:
        try:
            p.kill()
        except psutil.Error:
            pass
    try:
        os.killpg(popen.pid, signal.SIGKILL)  # and anything else left in its process group
    except (ProcessLookupError, PermissionError):
        pass
    try:
        popen.wait(5)
    except subprocess.TimeoutExpired:
        pass


# What may stop the bench from reading the bus or the ingress (NATS down, a takeover...).
_UNREADABLE = (TimeoutError, OSError, nats.errors.Error, httpx.HTTPError, ValueError, KeyError, msgspec.DecodeError)


class _Credentials(msgspec.Struct):
    """A credentials file as ``up`` writes it for its private server (JSON; other fields skipped)."""

    user: str
    password: str


async def _nats(up: Up):
    admin = msgspec.json.decode(up.admin_credentials.read_bytes(), type=_Credentials)
    return await nats.connect(
        up.nats_url,
        user=admin.user,
        password=admin.password,
        connect_timeout=2,
        allow_reconnect=False,
        max_reconnect_attempts=0,
    )


async def _lease(up: Up) -> tuple[int, bytes] | None:
    """The lease key's (revision, holder), or None when it cannot be read."""
    try:
        with anyio.fail_after(3):
            nc = await _nats(up)
            try:
                kv = await nc.jetstream().key_value(LEASE_BUCKET)
                entry = await kv.get(LEASE_KEY)
                return (entry.revision or 0), (entry.value or b"")
            finally:
                await nc.close()
    except _UNREADABLE:  # reads as "unknown"; the caller says so
        return None


@dataclass
class Ledger:
    """What the scheduler still counts once every stream has ended."""

    inflight_tokens: dict[str, int] = field(default_factory=dict)  # worker -> tokens
    running: int = 0
    queued_requests: int = 0
    ingress_in_flight: int = 0
    read: bool = False

    @property
    def stranded_tokens(self) -> int:
        return sum(self.inflight_tokens.values())

    @property
    def clear(self) -> bool:
        return self.read and not (
            self.stranded_tokens or self.running or self.queued_requests or self.ingress_in_flight
        )


async def _ledger(up: Up) -> Ledger:
    from switchyard.schemas import ClusterStatus, StatusRequest, codec, subjects

    ledger = Ledger()
    try:
        with anyio.fail_after(4):
            nc = await _nats(up)
            try:
                reply = await nc.request(subjects.SUBMIT, codec.SCHEDULER_REQUEST.encode(StatusRequest()), timeout=2)
            finally:
                await nc.close()
            async with httpx.AsyncClient(timeout=2) as client:
                ingress_in_flight = int((await client.get(up.url + "/health")).json()["in_flight_requests"])
    except _UNREADABLE:  # unread; the report says so
        return ledger
    status = codec.SCHEDULER_REPLY.decode(reply.data)
    if not isinstance(status, ClusterStatus):
        return ledger
    ledger.inflight_tokens = {w.worker_id: w.inflight_tokens for w in status.workers}
    ledger.running = sum(w.running for w in status.workers)
    ledger.queued_requests = status.queued_requests
    ledger.ingress_in_flight = ingress_in_flight
    ledger.read = True
    return ledger


async def _settled_ledger(up: Up, settle_s: float) -> tuple[Ledger, float]:
    """The ledger once clear, or as it stands after ``settle_s``; and how long it took."""
    started = time.monotonic()
    ledger = await _ledger(up)
    while not ledger.clear and time.monotonic() - started < settle_s:
        await anyio.sleep(0.5)
        ledger = await _ledger(up)
    return ledger, time.monotonic() - started


async def _counters(url: str) -> dict[str, float]:
    """The ingress's migration and recompute counters (GET /metrics)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        async with httpx.AsyncClient(timeout=3) as client:
            text = (await client.get(url + "/metrics")).text
    except httpx.HTTPError:
        return {}
    counters: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "switchyard_recomputed_tokens_total":
                counters["recomputed_tokens"] = counters.get("recomputed_tokens", 0) + sample.value
            elif sample.name == "switchyard_migrations_total":
                key = f"migrations_{sample.labels.get('outcome', '')}"
                counters[key] = counters.get(key, 0) + sample.value
    return counters


# --- chaos ---------------------------------------------------------------------------------------------


@dataclass
class Kill:
    kind: str  # worker, scheduler, nats
    at_s: float  # from the run's start (a scheduler's: when it was frozen)
    target: str = ""
    pid: int = 0
    note: str = ""
    restarted_s: float | None = None  # a new process of that child seen
    served_s: float | None = None  # the first probe sent after the kill that succeeded ended
    fleet_s: float | None = None  # /health whole again after it had dipped


def kill_plan(kinds: tuple[str, ...], every_s: float, reference_s: float, horizon_s: float) -> list[tuple[float, str]]:
    """(time, kind) of every kill, sorted: workers every ``every_s``; the scheduler and NATS
    once, half-way between two worker kills near a third and two thirds of the reference run."""
    plan = []
    if "workers" in kinds:
        plan += [(every_s * k, "worker") for k in range(1, int(horizon_s / every_s) + 1)]
    for kind, share in (("scheduler", 1 / 3), ("nats", 2 / 3)):
        if kind in kinds:
            slot = max(0, int(reference_s * share / every_s))
            plan.append(((slot + 0.5) * every_s, kind))
    return sorted(plan)


@dataclass
class Watch:
    """What the probe and the health loop saw, each sample stamped from the run's start."""

    probes: list[tuple[float, float, bool]] = field(default_factory=list)  # sent, ended, ok
    health: list[tuple[float, bool]] = field(default_factory=list)  # when, fleet whole


class Chaos:
    """Carries out a kill plan on ``up``'s children; ``stop()`` ends the killing, and
    ``run()`` returns once every kill's restart was seen (or 30 s passed)."""

    def __init__(self, up: Up, plan: list[tuple[float, str]], seed: int, t0: float) -> None:
        self.up, self.plan, self.t0 = up, plan, t0
        self.rng = random.Random(seed + 1)
        self.kills: list[Kill] = []
        self._killing = anyio.CancelScope()

    def now(self) -> float:
        return time.monotonic() - self.t0

    def stop(self) -> None:
        self._killing.cancel()

    async def run(self) -> None:
        async with anyio.create_task_group() as tg:
            with self._killing:
                for at_s, kind in self.plan:
                    await anyio.sleep(max(0.0, at_s - self.now()))
                    try:
                        kill = await self._kill(kind)
                    except psutil.Error:  # the victim went away as we froze it: no kill this time
                        kill = None
                    if kill is not None:
                        self.kills.append(kill)
                        tg.start_soon(self._await_restart, kill)

    async def _kill(self, kind: str) -> Kill | None:
        children = self.up.children()
        if kind == "worker":
            names = sorted(n for n in children if n.startswith(("prefill-", "decode-")))
            if not names:
                return None
            name = self.rng.choice(names)
            return _sigkill(children[name], Kill("worker", self.now(), name))
        if kind == "nats":
            if "nats-server" not in children:
                return None
            return _sigkill(children["nats-server"], Kill("nats", self.now(), "nats-server"))
        return await self._kill_scheduler(children)

    async def _kill_scheduler(self, children: dict[str, psutil.Process]) -> Kill | None:
        names = sorted(n for n in children if n.startswith("scheduler-"))
        if not names:
            return None
        if len(names) == 1:
            return _sigkill(children[names[0]], Kill("scheduler", self.now(), names[0], note="the only one"))
        first = children[names[0]]
        before = await _lease(self.up)
        kill = Kill("scheduler", self.now(), names[0])
        first.suspend()
        try:
            await anyio.sleep(0.5)  # the holder renews every 0.25 s; a frozen holder's key outlives this
            after = await _lease(self.up)
        except BaseException:
            first.resume()  # cancelled mid-probe: leave nobody frozen
            raise
        if before is not None and after is not None and after[1] == before[1] and after[0] > before[0]:
            first.resume()  # someone else renewed the lease: the frozen one stands by
            kill = Kill("scheduler", self.now(), names[1])
            return _sigkill(children[names[1]], kill)
        if before is None or after is None:
            kill.note = "lease unreadable: killed the first replica"
        return _sigkill(first, kill)

    async def _await_restart(self, kill: Kill) -> None:
        deadline = kill.at_s + 30
        while self.now() < deadline:
            child = self.up.children().get(kill.target)
            if child is not None and child.pid != kill.pid:
                kill.restarted_s = self.now() - kill.at_s
                return
            await anyio.sleep(0.1)


def _sigkill(process: psutil.Process, kill: Kill) -> Kill:
    kill.pid = process.pid
    try:
        process.send_signal(signal.SIGKILL)
    except psutil.Error as exc:
        kill.note = f"{kill.note} {type(exc).__name__}".strip()
    return kill


async def _probe(url: str, watch: Watch, t0: float) -> None:
    """A tiny request every 0.25 s: when does one sent after a kill get served?"""
    body = {"model": MODEL, "prompt": [300, 301, 302, 303], "max_tokens": 2, "temperature": 0}
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        while True:
            sent, ok = time.monotonic() - t0, False
            try:
                ok = (await client.post("/v1/completions", json=body)).status_code == 200
            except httpx.HTTPError:
                pass
            watch.probes.append((sent, time.monotonic() - t0, ok))
            await anyio.sleep(0.25)


async def _watch_health(url: str, fleet: tuple[int, int], watch: Watch, t0: float) -> None:
    async with httpx.AsyncClient(timeout=1) as client:
        while True:
            whole = False
            try:
                response = await client.get(url + "/health")
                body = response.json()
                whole = response.status_code == 200 and (body["prefill_workers"], body["decode_workers"]) == fleet
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            watch.health.append((time.monotonic() - t0, whole))
            await anyio.sleep(0.25)


def recovery(kill: Kill, watch: Watch, until_s: float | None = None) -> None:
    """Fill in ``served_s`` and ``fleet_s`` from what the probe and the health loop saw. A
    dip is this kill's only if it begins before ``until_s`` (the next kill; else 20 s on)."""
    served = [ended for sent, ended, ok in watch.probes if ok and sent >= kill.at_s]
    kill.served_s = min(served) - kill.at_s if served else None
    until_s = kill.at_s + 20.0 if until_s is None else until_s
    dip = next((t for t, whole in watch.health if kill.at_s <= t < until_s and not whole), None)
    if dip is None:
        kill.note = f"{kill.note} no health dip".strip()
        return
    restarted = kill.at_s + (kill.restarted_s or 0.0)  # whole before its replacement was up: not back
    back = next((t for t, whole in watch.health if whole and t > dip and t >= restarted), None)
    kill.fleet_s = None if back is None else back - kill.at_s


# --- one run ---------------------------------------------------------------------------------------------


@dataclass
class Run:
    name: str
    kinds: tuple[str, ...]
    duration_s: float
    outcomes: list[Outcome]
    kills: list[Kill]
    counters: dict[str, float]  # after minus before
    ledger: Ledger
    settle_s: float
    restarts: int
    watch: Watch


async def _load(
    up: Up,
    requests: list[Request],
    args: argparse.Namespace,
    name: str,
    kinds: tuple[str, ...],
    plan: list[tuple[float, str]],
) -> Run:
    t0 = time.monotonic()
    watch = Watch()
    chaos = Chaos(up, plan, args.seed, t0)
    bounds = Bounds(args.request_timeout_s, args.idle_timeout_s)
    before = await _counters(up.url)
    async with anyio.create_task_group() as watchers:
        watchers.start_soon(_probe, up.url, watch, t0)
        watchers.start_soon(_watch_health, up.url, (args.prefill, args.decode), watch, t0)
        async with anyio.create_task_group() as killers:
            killers.start_soon(chaos.run)
            outcomes = await _drive(up.url, requests, args.concurrency, bounds, t0)
            duration_s = time.monotonic() - t0
            chaos.stop()  # no more kills; the restarts being awaited still are (bounded)
        if chaos.kills:  # watch the last kill's recovery too
            await anyio.sleep(max(0.0, min(15.0, chaos.kills[-1].at_s + 12 - (time.monotonic() - t0))))
        watchers.cancel_scope.cancel()
    for i, kill in enumerate(chaos.kills):
        recovery(kill, watch, chaos.kills[i + 1].at_s if i + 1 < len(chaos.kills) else None)
    after = await _counters(up.url)
    ledger, settle_s = await _settled_ledger(up, args.settle_s)
    counters = {k: after.get(k, 0) - before.get(k, 0) for k in sorted(set(before) | set(after))}
    return Run(name, kinds, duration_s, outcomes, chaos.kills, counters, ledger, settle_s, up.restarts(), watch)


def _up_flags(args: argparse.Namespace) -> list[str]:
    return [
        "--engine",
        "sim",
        "--prefill",
        str(args.prefill),
        "--decode",
        str(args.decode),
        "--schedulers",
        str(args.schedulers),
        "--report-interval-s",
        "0.2",  # a dead worker is noticed fast
        "--max-restarts",
        "1000",  # this benchmark kills on purpose: never stop the stack for it
        "--sim-prefill-base-s",
        repr(args.prefill_base_s),
        "--sim-prefill-per-token-s",
        repr(args.prefill_per_token_s),
        "--sim-decode-step-base-s",
        repr(args.decode_step_base_s),
        "--sim-decode-step-per-seq-s",
        repr(args.decode_step_per_seq_s),
    ]


def _one_run(
    name: str, kinds: tuple[str, ...], requests: list[Request], args: argparse.Namespace, reference_s: float
) -> Run:
    plan = kill_plan(kinds, args.kill_every_s, reference_s, horizon_s=4 * reference_s + 120) if kinds else []
    print(f"{name}: {len(requests)} requests, {args.concurrency} at a time ...", flush=True)
    with running_up(_up_flags(args), args.out / f"up-{name}.log") as up:
        result = anyio.run(_load, up, requests, args, name, kinds, plan)
    print(f"{name}: {result.duration_s:.1f} s, {len(result.kills)} kills", flush=True)
    return result


# --- comparison and report -------------------------------------------------------------------------------


def classify(reference: Outcome, got: Outcome) -> str:
    """One of ``OUTCOMES``: a completed request is compared with its reference."""
    if got.ended_as != "completed":
        return got.ended_as
    same = (got.text, got.completion_tokens, got.finish_reason) == (
        reference.text,
        reference.completion_tokens,
        reference.finish_reason,
    )
    return "identical" if same else "different"


def summarize(run: Run, reference: Run) -> dict:
    """One run's figures; only requests the reference completed are compared."""
    judged = [
        (run.outcomes[i], classify(ref, run.outcomes[i]), ref)
        for i, ref in enumerate(reference.outcomes)
        if ref.ended_as == "completed"
    ]
    counts = Counter(kind for _, kind, _ in judged)
    failed = [got for got, kind, _ in judged if kind in ("clean_error", "hang", "broken")]
    differences = [
        {"reference": _excerpt(ref), "got": _excerpt(got)} for got, kind, ref in judged if kind == "different"
    ]
    summary = {
        "run": run.name,
        "killed": list(run.kinds),
        "requests": len(run.outcomes),
        "compared": len(judged),
        **{k: counts[k] for k in OUTCOMES},
        "completed_share": (counts["identical"] + counts["different"]) / max(1, len(judged)),
        "duration_s": round(run.duration_s, 2),
        "recomputed_tokens": int(run.counters.get("recomputed_tokens", 0)),
        "migrations": {k.removeprefix("migrations_"): int(v) for k, v in run.counters.items() if k.startswith("migr")},
        "stranded_tokens": run.ledger.stranded_tokens if run.ledger.read else None,
        "stranded": {
            "read": run.ledger.read,
            "inflight_tokens": run.ledger.inflight_tokens,
            "running": run.ledger.running,
            "queued_requests": run.ledger.queued_requests,
            "ingress_in_flight": run.ledger.ingress_in_flight,
            "settle_s": round(run.settle_s, 2),
        },
        "restarts": run.restarts,
        "kills": [asdict(k) for k in run.kills],
        "errors": dict(Counter(o.error for o in failed).most_common(10)),
        # how far each hung stream got: SSE events it received before it stalled -> requests
        "hang_events": dict(sorted(Counter(got.events for got, kind, _ in judged if kind == "hang").items())),
        "differences": differences[:5],
    }
    summary["goals"] = _goals(summary)
    return summary


def _excerpt(o: Outcome) -> dict:
    return {"tokens": o.completion_tokens, "finish_reason": o.finish_reason, "text": o.text[:120]}


def _goals(s: dict) -> dict:
    goals = {
        "complete_or_clean_error": s["hang"] == 0 and s["broken"] == 0,
        "no_differences": s["different"] == 0,
        "no_hangs": s["hang"] == 0,
        "nothing_stranded": s["stranded"]["read"]
        and s["stranded_tokens"] == 0
        and s["stranded"]["running"] == 0
        and s["stranded"]["queued_requests"] == 0,
    }
    if tuple(s["killed"]) == ("workers",):
        goals["workers_only_99pct_complete"] = s["completed_share"] >= 0.99
    return goals


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def table(summaries: list[dict]) -> str:
    lines = [
        "| run | requests | identical | different | clean errors | hangs | broken | tokens recomputed "
        "| migrations (resumed/refused/exhausted) | stranded tokens | kills | restarts | goals met |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---|",
    ]
    for s in summaries:
        m = s["migrations"]
        stranded = "unread" if s["stranded_tokens"] is None else str(s["stranded_tokens"])
        missed = [k for k, ok in s["goals"].items() if not ok]
        lines.append(
            f"| {s['run']} | {s['compared']} | {s['identical']} | {s['different']} | {s['clean_error']} "
            f"| {s['hang']} | {s['broken']} | {s['recomputed_tokens']} "
            f"| {m.get('resumed', 0)}/{m.get('refused', 0)}/{m.get('exhausted', 0)} | {stranded} "
            f"| {len(s['kills'])} | {s['restarts']} | {'all' if not missed else 'missed: ' + ', '.join(missed)} |"
        )
    lines += [
        "",
        "| run | at (s) | killed | restarted after (s) | next request served after (s) | fleet whole after (s) |",
    ]
    lines.append("|---|---:|---|---:|---:|---:|")
    for s in summaries:
        for k in s["kills"]:
            note = f" ({k['note']})" if k["note"] else ""
            lines.append(
                f"| {s['run']} | {k['at_s']:.1f} | {k['kind']} {k['target']}{note} | {_s(k['restarted_s'])} "
                f"| {_s(k['served_s'])} | {_s(k['fleet_s'])} |"
            )
    return "\n".join(lines)


def recovery_table(recovery: dict) -> str:
    lines = ["| killed | kills | next request served after, p50 (s) | max (s) |", "|---|---:|---:|---:|"]
    for kind, r in sorted(recovery.items()):
        lines.append(f"| {kind} | {r['n']} | {_s(r['p50'])} | {_s(r['max'])} |")
    return "\n".join(lines)


def _recovery_by_kind(summaries: list[dict]) -> dict:
    by_kind: dict[str, list[float]] = {}
    for s in summaries:
        for k in s["kills"]:
            if k["served_s"] is not None:
                by_kind.setdefault(k["kind"], []).append(k["served_s"])
    return {kind: {"p50": percentile(v, 50), "max": max(v), "n": len(v)} for kind, v in by_kind.items()}


_COLORS = {
    "identical": "tab:green",
    "different": "tab:orange",
    "clean_error": "tab:blue",
    "hang": "tab:red",
    "broken": "black",
}
_KILL_COLORS = {"worker": "tab:gray", "scheduler": "tab:purple", "nats": "tab:brown"}


def plot_outcomes(summaries: list[dict], out: Path) -> None:
    fig, ax = plots.figure()
    names = [s["run"] for s in summaries]
    left = [0.0] * len(summaries)
    for kind in OUTCOMES:
        widths = [s[kind] for s in summaries]
        ax.barh(names, widths, left=left, color=_COLORS[kind], label=kind.replace("_", " "))
        left = [a + b for a, b in zip(left, widths, strict=True)]
    ax.invert_yaxis()
    plots.save(fig, ax, out / "outcomes.png", title="How every request ended", xlabel="requests", ylabel="run")


def plot_timeline(run: Run, reference: list[Outcome], out: Path) -> Path:
    """Requests ended per second, by outcome, with every kill marked."""
    fig, ax = plots.figure()
    end = max([o.ended_s for o in run.outcomes] + [1.0])
    bins = [float(b) for b in range(int(end) + 2)]
    kinds = [
        classify(r, o) if r.ended_as == "completed" else "broken" for r, o in zip(reference, run.outcomes, strict=True)
    ]
    for kind in OUTCOMES:  # a hang is drawn where it stalled: its last event
        ends = [
            o.last_event_s if kind == "hang" else o.ended_s
            for o, k in zip(run.outcomes, kinds, strict=True)
            if k == kind
        ]
        label = "hang (at its last event)" if kind == "hang" else kind.replace("_", " ")
        if ends:
            ax.hist(ends, bins=bins, histtype="step", color=_COLORS[kind], label=label)
    seen: set[str] = set()
    for kill in run.kills:
        first = kill.kind not in seen
        seen.add(kill.kind)
        ax.axvline(
            kill.at_s,
            color=_KILL_COLORS[kill.kind],
            linestyle="--",
            linewidth=1,
            label=f"{kill.kind} killed" if first else None,
        )
    path = out / f"timeline-{run.name}.png"
    plots.save(
        fig, ax, path, title=f"Chaos run {run.name}", xlabel="seconds from the run's start", ylabel="requests ended / s"
    )
    return path


# --- the command -------------------------------------------------------------------------------------------


def _terminate(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through every ``running_up``: the stack is stopped


def run(args: argparse.Namespace) -> int:
    scenarios = [_kinds(k) for k in (args.kill or ["workers,scheduler,nats", "workers"])]
    requests = make_requests(args.requests, args.seed, _range(args.prompt_tokens), _range(args.max_tokens))
    args.out.mkdir(parents=True, exist_ok=True)
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        reference = _one_run("reference", (), requests, args, 0.0)
        runs = [_one_run("+".join(kinds), kinds, requests, args, reference.duration_s) for kinds in scenarios]
    finally:
        signal.signal(signal.SIGTERM, previous)
    summaries = [summarize(r, reference) for r in [reference, *runs]]
    recovered = _recovery_by_kind(summaries[1:])
    results = {
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "func"}
        | {"up_flags": _up_flags(args), "cpus": psutil.cpu_count()},
        "runs": summaries,
        "recovery_s": recovered,
        "outcomes": {
            r.name: {
                "columns": ["ended_as", "started_s", "ended_s", "events", "last_event_s", "error"],
                "rows": [
                    [
                        o.ended_as,
                        round(o.started_s, 3),
                        round(o.ended_s, 3),
                        o.events,
                        round(o.last_event_s, 3),
                        o.error,
                    ]
                    for o in r.outcomes
                ],
            }
            for r in [reference, *runs]
        },
        "watch": {
            r.name: {
                "probes_sent_ended_ok": [[round(a, 3), round(b, 3), ok] for a, b, ok in r.watch.probes],
                "health_at_whole": [[round(a, 3), whole] for a, whole in r.watch.health],
            }
            for r in [reference, *runs]
        },
    }
    (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    print("\n" + table(summaries) + "\n\n" + recovery_table(recovered), flush=True)
    plot_outcomes(summaries, args.out)
    figures = [plot_timeline(r, reference.outcomes, args.out) for r in runs]
    print(f"\nwrote {args.out / 'results.json'}, {args.out / 'outcomes.png'}, " + ", ".join(map(str, figures)))
    return 0
