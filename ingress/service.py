"""The ingress process: the HTTP server, the stream router and the usage recorder in one task group."""

from __future__ import annotations

import contextlib
import logging
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import msgspec
import uvicorn
from anyio.abc import TaskStatus

from switchyard.ingress.app import Ingress
from switchyard.ingress.auth import Gate
from switchyard.ingress.batch_store import BatchStore
from switchyard.ingress.batches import BatchApi, BatchMaker, BatchMetrics
from switchyard.ingress.config import IngressConfig
from switchyard.ingress.edge import EdgeLimits, edge_protocol
from switchyard.ingress.errors import IngressError
from switchyard.ingress.federation import Federation
from switchyard.ingress.files import FileStore, FilesUnavailable, files_routes
from switchyard.ingress.streams import StreamRouter
from switchyard.ingress.tokenizer import ModelTokenizer
from switchyard.ingress.usage import UsageRecorder
from switchyard.observability import BusStats, ServingMetrics, connect, settle, subscribe
from switchyard.schemas import subjects

log = logging.getLogger(__name__)
_JETSTREAM_TIMEOUT_S = 10.0  # one JetStream API call or chunk ack of the Files API


class ServiceError(IngressError):
    """The ingress cannot start as configured (its message says why)."""


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: the process's run() owns shutdown."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class IngressService:
    def __init__(self, config: IngressConfig, metrics: ServingMetrics | None = None) -> None:
        if not config.ingress_id:
            # In a region, its id starts with the region's name: the streams of a region's
            # ingresses are what the other regions send it (subjects.region_streams).
            own = f"ingress-{uuid.uuid4().hex[:8]}"
            config = msgspec.structs.replace(config, ingress_id=f"{config.region}.{own}" if config.region else own)
        self.config = config
        self.tokenizer = ModelTokenizer.load(Path(config.model_dir))
        self.gate = Gate.for_config(config)  # here, so a bad keys file stops the start with a plain error
        self.metrics = metrics or ServingMetrics()
        self.router = StreamRouter()
        self.stats = BusStats()
        self.url = ""
        self.federation: Federation | None = None  # once running, with --region

    async def run(self, *, task_status: TaskStatus[str] = anyio.TASK_STATUS_IGNORED) -> None:
        cfg = self.config
        sock = _bind(cfg.host, cfg.port)
        async with connect(cfg.nats_url, cfg.ingress_id, self.stats, cfg.nats_client) as nc:
            self.usage = UsageRecorder(nc, cfg, self.metrics)
            self.files = await _file_store(nc, cfg)
            batches = batch_api(nc, self.files, cfg, self.tokenizer, self.metrics)
            federation = self.federation = self._federation(nc) if cfg.region else None
            scrape = [batches.metrics.refresh] + ([self._region_gauges(federation)] if federation else [])
            ingress = Ingress(
                cfg,
                self.tokenizer,
                nc,
                self.router,
                self.metrics,
                self.stats,
                self.gate,
                self.usage.on_finished,
                routes=[*files_routes(lambda: self.files), *batches.routes()],
                on_scrape=scrape,
                federation=federation,
            )
            server = _Server(
                uvicorn.Config(
                    ingress.app,
                    log_level="warning",
                    access_log=False,
                    http=edge_protocol(EdgeLimits.of(cfg), self.metrics),
                    ws="none",
                    timeout_graceful_shutdown=5,
                    lifespan="off",
                    timeout_keep_alive=cfg.keep_alive_timeout_s,  # type: ignore[arg-type]  # a float works
                )
            )
            try:
                async with anyio.create_task_group() as tg:
                    tokens = await subscribe(nc, subjects.streams_of(cfg.ingress_id))
                    tg.start_soon(self.router.serve, tokens)
                    tg.start_soon(self.router.watch_schedulers, await subscribe(nc, subjects.ROLL_CALL))
                    tg.start_soon(self.router.watch_idle, cfg.stream_idle_timeout_s, cfg.reconnect_stall_s, self.stats)
                    await tg.start(self.usage.run)
                    if federation is not None:
                        await tg.start(federation.run)
                    await settle(nc)
                    tg.start_soon(self._serve_http, server, sock, tg.cancel_scope)
                    while not server.started:  # noqa: ASYNC110 (uvicorn offers a flag, no event)
                        await anyio.sleep(0.01)
                    host, port = sock.getsockname()[:2]
                    self.url = f"http://{host}:{port}"
                    log.info("ingress %s serving %s at %s", cfg.ingress_id, ingress.model, self.url)
                    task_status.started(self.url)
            finally:
                # Cancelled: let uvicorn close its connections, shielded, before the bus goes.
                server.should_exit = True
                sock.close()

    def _federation(self, nc) -> Federation:
        cfg = self.config
        regions = cfg.regions
        federation = Federation(
            nc,
            cfg.region,
            policy=regions.policy,
            dark_after_s=regions.dark_after_s,
            spill_margin_s=regions.spill_margin_s,
            ping_interval_s=regions.ping_interval_s,
            session_ttl_s=regions.session_ttl_s,
        )

        def lost(request_id: str, region: str) -> None:
            if self.router.fail(request_id, "region_lost", f"region {region} went dark"):
                self.metrics.region_lost_streams.inc()

        def replaced(scheduler_id: str, request_ids: list[str]) -> None:
            queued = self.router.scheduler_changed(scheduler_id, request_ids)
            log.warning("a scheduler of another region took over; submitting %d queued streams again", queued)

        federation.on_lost(lost)
        federation.on_new_scheduler(replaced)
        return federation

    def _region_gauges(self, federation: Federation) -> Callable[[], Awaitable[None]]:
        async def refresh() -> None:
            now = time.monotonic()
            for region in federation.router.regions():
                self.metrics.region_alive.labels(region=region).set(float(federation.router.alive(region, now)))
                rtt = federation.router.rtt_s(region)
                if rtt is not None:
                    self.metrics.region_rtt.labels(region=region).set(rtt)

        return refresh

    @staticmethod
    async def _serve_http(server: uvicorn.Server, sock: socket.socket, scope: anyio.CancelScope) -> None:
        await server.serve(sockets=[sock])
        scope.cancel()  # the server stopped on its own: the ingress stops with it


async def _file_store(nc, cfg: IngressConfig) -> FileStore:
    """The Files API's store, its buckets opened (or created) now if JetStream is there; if not,
    its routes answer 503 and it tries again on each call."""
    store = FileStore(nc.jetstream(timeout=_JETSTREAM_TIMEOUT_S), max_bytes=cfg.files.max_bytes)
    try:
        await store.ensure()
    except FilesUnavailable as exc:
        log.warning("the Files API is unavailable until JetStream answers: %s", exc.message)
    return store


def batch_api(nc, files: FileStore, cfg: IngressConfig, tokenizer: ModelTokenizer, metrics: ServingMetrics) -> BatchApi:
    """The Batch API (``ingress.batches``) and its gauges; its JetStream storage is opened on first use."""
    store = BatchStore(nc, timeout_s=_JETSTREAM_TIMEOUT_S)
    maker = BatchMaker(store, cfg.served_model_name or tokenizer.info.name)
    return BatchApi(maker, files, metrics=BatchMetrics(store, metrics.registry), max_body_bytes=cfg.max_body_bytes)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto must say TCP: asyncio only sets TCP_NODELAY on accepted sockets whose proto
    # is IPPROTO_TCP, and without it Nagle plus delayed ACKs add 40 ms to every response.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ServiceError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock
