"""A federated ingress: which region serves each request, and what happens when one goes dark.

A region is its own NATS account in a supercluster (``docs/federation.md``). This ingress
hears every region's ``RegionSummary`` (its own region's scheduler publishes one too),
measures its round trip to each other region (``subjects.to_region(r, "ping")``), and
keeps the **session directory**: which region holds each session's prefix. Each request
is routed by ``scheduler.regions.RegionRouter`` (policy ``--region-policy``), submitted to
that region's scheduler (``SUBMIT`` at home, ``to_region(r, "submit")`` across a gateway),
and its cancels go the same way; its token stream comes back across the gateway on the
ingress's own stream subject (``<region>.<id>``).

The directory: each ingress publishes where it placed a session
(``fed_session(region, key)``, a ``SessionPlacement``); every region's account captures all
regions' placements in its own JetStream stream (``DIRECTORY_STREAM``, the last per
subject kept), so every region reads the whole directory locally and it survives the loss
of any one region. An ingress reads it through an ordered consumer that first delivers
the last entry of every subject, then each new one; while JetStream does not answer it
hears new entries on the bus, and tries JetStream again every second.

A region silent for ``dark_after_s`` is dropped from routing; the streams this ingress has
in flight there fail with ``region_lost``, which a generation continues elsewhere
(``ingress.generation``: a migration, from the tokens the client has), so nothing hangs.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import anyio
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import DeliverPolicy, StorageType, StreamConfig
from nats.js.errors import BadRequestError, NotFoundError

from switchyard.ingress.errors import InvalidRequest, Unavailable
from switchyard.observability import decoded, subscribe
from switchyard.scheduler import RegionPolicy, RegionRouter, Route, session_key
from switchyard.schemas import RegionSummary, RequestSpec, SessionPlacement, codec, subjects

log = logging.getLogger(__name__)

DIRECTORY_STREAM = subjects.SESSION_DIRECTORY_STREAM
REGION_HEADER = "x-switchyard-region"  # run the request in this region (a batch runner's lines)
_PING_TIMEOUT_S = 2.0
_DIRECTORY_RETRY_S = 1.0


def directory_key(tenant: str, session: str) -> str:
    """A session's key in the directory: the scheduler's (BLAKE2b-128 of tenant and session)."""
    return session_key(tenant, session)


@dataclass
class SessionDirectory:
    """Session key -> the newest placement heard, from any region."""

    max_entries: int = 1_000_000
    _entries: dict[str, SessionPlacement] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self._entries)

    def learn(self, key: str, placement: SessionPlacement) -> None:
        held = self._entries.get(key)
        if held is not None and held.at > placement.at:
            return  # an older write, heard late (from another region's stream)
        self._entries.pop(key, None)
        self._entries[key] = placement
        if len(self._entries) > self.max_entries:
            del self._entries[next(iter(self._entries))]

    def lookup(self, key: str, wall: float) -> SessionPlacement | None:
        placement = self._entries.get(key)
        return placement if placement is not None and placement.expires_at > wall else None


class Federation:
    """The regions as this ingress sees them; ``route`` / ``placed`` per request."""

    def __init__(
        self,
        nc,
        region: str,
        *,
        policy: RegionPolicy = "geo",
        dark_after_s: float = 3.0,
        spill_margin_s: float = 0.5,
        ping_interval_s: float = 1.0,
        session_ttl_s: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.nc = nc
        self.region = region
        self.router = RegionRouter(region, policy=policy, dark_after_s=dark_after_s, spill_margin_s=spill_margin_s)
        self.directory = SessionDirectory()
        self.ping_interval_s = ping_interval_s
        self.session_ttl_s = session_ttl_s
        self._clock = clock
        self._placed: dict[str, str] = {}  # request id -> the region that has it
        self._pins: dict[str, str] = {}  # request id -> the region its client named
        self._on_lost: Callable[[str, str], None] | None = None
        self._on_new_scheduler: Callable[[str, list[str]], None] | None = None
        self.routed: dict[tuple[str, str], int] = {}  # (region, reason) -> requests
        self.lost = 0  # streams failed because their region went dark

    # --- per request -------------------------------------------------------------------

    def pin(self, request_id: str, region: str) -> None:
        """The client named the region (``x-switchyard-region``): every run of the request goes
        there, or fails (no other region is tried)."""
        if region != self.region and region not in self.router.regions():
            known = ", ".join(self.router.regions())
            raise InvalidRequest(f"Unknown region {region[:64]!r}; the regions are {known}.", param=REGION_HEADER)
        self._pins[request_id] = region

    def route(self, spec: RequestSpec, exclude: frozenset[str] = frozenset()) -> Route:
        placement = None
        if spec.session is not None:
            placement = self.directory.lookup(directory_key(spec.tenant, spec.session), time.time())
        pinned = self._pins.get(spec.request_id)
        if pinned is not None:
            if pinned in exclude:  # it refused: no other region may serve it
                return Route(pinned, "pinned", 0.0)
            if pinned != self.region and not self.router.alive(pinned, self._clock()):
                raise Unavailable(
                    f"Region {pinned} is unreachable (dark).", code="region_unavailable", retry_after_s=1.0
                )
            route = self.router.pin(pinned, len(spec.prompt_tokens), placement)
        else:
            route = self.router.route(len(spec.prompt_tokens), placement, self._clock(), exclude)
        self.routed[(route.region, route.reason)] = self.routed.get((route.region, route.reason), 0) + 1
        return route

    def submit_subject(self, region: str) -> str:
        return subjects.SUBMIT if region == self.region else subjects.to_region(region, "submit")

    def cancel_subject(self, request_id: str) -> str:
        region = self._placed.get(request_id, self.region)
        return subjects.CANCEL if region == self.region else subjects.to_region(region, "cancel")

    async def placed(self, spec: RequestSpec, region: str) -> None:
        """``region`` admitted the request: its cancels go there, and so does its session."""
        self._placed[spec.request_id] = region
        if spec.session is None:
            return
        key = directory_key(spec.tenant, spec.session)
        wall = time.time()
        held = self.directory.lookup(key, wall)
        prompt = len(spec.prompt_tokens)
        if held is not None and held.region == region and held.prompt_tokens >= prompt:
            if wall - held.at < self.session_ttl_s / 4:
                return  # said recently enough: the entry outlives its use
        placement = SessionPlacement(region=region, prompt_tokens=prompt, at=wall, expires_at=wall + self.session_ttl_s)
        self.directory.learn(key, placement)
        await self.nc.publish(subjects.fed_session(self.region, key), codec.SESSION_PLACEMENT.encode(placement))

    def finished(self, request_id: str) -> None:
        self._placed.pop(request_id, None)
        self._pins.pop(request_id, None)

    def on_lost(self, callback: Callable[[str, str], None]) -> None:
        """``callback(request_id, region)`` for each stream in flight in a region gone dark."""
        self._on_lost = callback

    def on_new_scheduler(self, callback: Callable[[str, list[str]], None]) -> None:
        """``callback(scheduler_id, request_ids)`` when another region's scheduler was replaced
        (a standby took over there), with the requests this ingress has in flight there: the
        new one may not know those it had queued. Home's is told by its roll call."""
        self._on_new_scheduler = callback

    # --- what it hears ---------------------------------------------------------------------

    async def run(self, *, task_status=anyio.TASK_STATUS_IGNORED) -> None:
        async with anyio.create_task_group() as tg:
            summaries = await subscribe(self.nc, subjects.every_fed_summary())
            tg.start_soon(self._serve_summaries, summaries)
            await tg.start(self._serve_directory)
            tg.start_soon(self._ping)
            tg.start_soon(self._watch_dark)
            task_status.started()

    async def _serve_summaries(self, sub) -> None:
        async for _, summary in decoded(sub, codec.REGION_SUMMARY, "region summary"):
            self.heard(summary)

    def heard(self, summary: RegionSummary) -> None:
        before = self.router.summary(summary.region)
        self.router.observe(summary, self._clock())
        replaced = before is not None and before.scheduler_id != summary.scheduler_id
        if replaced and summary.region != self.region and self._on_new_scheduler is not None:
            there = [rid for rid, region in self._placed.items() if region == summary.region]
            log.warning("region %s has a new scheduler, %s", summary.region, summary.scheduler_id)
            self._on_new_scheduler(summary.scheduler_id, there)

    async def _serve_directory(self, *, task_status=anyio.TASK_STATUS_IGNORED) -> None:
        """The directory through JetStream (every placement made, then each new one). While
        JetStream does not answer (a region lost may take its meta leader with it for a few
        seconds), new placements are heard on the bus, and JetStream is tried again each
        ``_DIRECTORY_RETRY_S``: the backlog is learned once it answers."""
        js = self.nc.jetstream(timeout=2.0)
        async with anyio.create_task_group() as tg:
            bus = None
            while True:
                try:
                    await self._ensure_stream(js)
                    sub = await js.subscribe(
                        subjects.every_fed_session(),
                        ordered_consumer=True,
                        deliver_policy=DeliverPolicy.LAST_PER_SUBJECT,
                    )
                    break
                except Exception as exc:
                    if bus is None:
                        log.warning("session directory: JetStream does not answer (%r); hearing new placements", exc)
                        bus = await subscribe(self.nc, subjects.every_fed_session())
                        tg.start_soon(self._learn_from, bus)
                        task_status.started()
                    await anyio.sleep(_DIRECTORY_RETRY_S)
            if bus is None:
                task_status.started()
            else:
                await bus.unsubscribe()
                log.info("session directory: JetStream answers again; reading every placement")
            await self._learn_from(sub)

    async def _learn_from(self, sub) -> None:
        async for msg in sub.messages:
            try:
                placement = codec.SESSION_PLACEMENT.decode(msg.data)
            except Exception:
                log.warning("undecodable session placement on %s", msg.subject)
                continue
            self.directory.learn(msg.subject.rpartition(".")[2], placement)

    async def _ensure_stream(self, js) -> None:
        try:
            await js.stream_info(DIRECTORY_STREAM)
        except NotFoundError:
            with contextlib.suppress(BadRequestError):  # another ingress of the region made it first
                await js.add_stream(
                    StreamConfig(
                        name=DIRECTORY_STREAM,
                        subjects=[subjects.every_fed_session()],
                        max_msgs_per_subject=1,
                        max_age=self.session_ttl_s,
                        storage=StorageType.FILE,
                    )
                )

    async def _ping(self) -> None:
        while True:
            for region in self.router.regions():
                if region != self.region:
                    await self._ping_one(region)
            await anyio.sleep(self.ping_interval_s)

    async def _ping_one(self, region: str) -> None:
        started = time.perf_counter()
        try:
            await self.nc.request(subjects.to_region(region, "ping"), b"", timeout=_PING_TIMEOUT_S)
        except (NoRespondersError, NatsTimeout):
            return  # its summaries stopping is what makes it dark
        self.router.measured(region, time.perf_counter() - started)

    async def _watch_dark(self) -> None:
        dark: set[str] = set()
        while True:
            await anyio.sleep(min(0.5, self.router.dark_after_s / 4))
            now_dark = set(self.router.dark(self._clock()))
            for region in sorted(now_dark - dark):
                log.warning("region %s went dark: no summary for %.1f s", region, self.router.dark_after_s)
                self._fail_in(region)
            for region in sorted(dark - now_dark):
                log.info("region %s is back", region)
            dark = now_dark

    def _fail_in(self, region: str) -> None:
        lost = [rid for rid, r in self._placed.items() if r == region]
        for rid in lost:
            del self._placed[rid]
            self.lost += 1
            if self._on_lost is not None:
                self._on_lost(rid, region)
