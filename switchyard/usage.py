"""``switchyard usage``: the usage stream summarised by tenant, cached share included.

    switchyard usage [--nats-url URL] [--nats-credentials-file F] [--since DURATION] [--json] [--timeout-s X]

It reads the JetStream stream the ingresses publish their usage records to
(``schemas.usage``) as a billing system would: an ordered, ephemeral consumer from the
start (or from ``--since`` ago, by the time JetStream stored each record) up to the last
record there when it began, each record counted once by request id (a record retried after
the stream's duplicate window is stored twice). Against ``switchyard up``'s private server,
pass the admin credentials file that ``up`` names when it is ready.
"""

from __future__ import annotations

import argparse
import datetime as dt
import logging
import re
import sys
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import anyio
import msgspec
import nats.errors
from nats.js.api import ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from switchyard.observability import DEFAULT_NATS_URL, NatsClientConfig, connect, redacted
from switchyard.schemas import SwitchyardError, UsageRecord, subjects, usage

_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhd])")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nats-url", "--nats", default=DEFAULT_NATS_URL, metavar="URL", help="NATS server URL")
    parser.add_argument(
        "--nats-credentials-file", default="", metavar="FILE", help="NATS user allowed to read the stream (admin)"
    )
    parser.add_argument("--nats-tls-ca", default="", metavar="FILE", help="CA certificate of the server's TLS")
    parser.add_argument(
        "--since", type=duration, default=None, metavar="DURATION", help="only the last DURATION: 90s, 15m, 24h, 7d"
    )
    parser.add_argument(
        "--timeout-s", type=float, default=30.0, metavar="X", help="give up after this long (default: 30)"
    )
    parser.add_argument("--json", action="store_true", help="as JSON")


def duration(text: str) -> float:
    """Seconds in ``90s``, ``15m``, ``1h30m``, ``7d``."""
    parts = _DURATION.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise argparse.ArgumentTypeError(f"{text!r}: a duration such as 90s, 15m, 24h or 7d")
    return sum(float(n) * _UNIT_S[u] for n, u in parts)


class UsageReadError(SwitchyardError):
    """The usage stream could not be read (no server there, no JetStream, no right to)."""


@dataclass
class TenantUsage:
    tenant: str
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0

    @property
    def cached_share(self) -> float:
        """Of the prompt tokens, the share served from a KV cache (0 without prompt tokens)."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def add(self, record: UsageRecord) -> None:
        self.requests += 1
        self.prompt_tokens += record.prompt_tokens
        self.cached_tokens += record.cached_tokens
        self.completion_tokens += record.completion_tokens


@dataclass
class Summary:
    tenants: list[TenantUsage]  # by name
    total: TenantUsage
    duplicates: int  # records skipped: their request id was counted already

    def as_dict(self) -> dict:
        def row(u: TenantUsage) -> dict:
            return asdict(u) | {"cached_share": round(u.cached_share, 4)}

        return {
            "tenants": [row(u) for u in self.tenants],
            "total": row(self.total),
            "duplicates": self.duplicates,
        }


def summarise(records: Iterable[UsageRecord]) -> Summary:
    """Per tenant, each request once (the first record of its id)."""
    seen: set[str] = set()
    by_tenant: dict[str, TenantUsage] = {}
    total = TenantUsage("(total)")
    duplicates = 0
    for record in records:
        if record.request_id in seen:
            duplicates += 1
            continue
        seen.add(record.request_id)
        by_tenant.setdefault(record.tenant, TenantUsage(record.tenant)).add(record)
        total.add(record)
    return Summary([by_tenant[t] for t in sorted(by_tenant)], total, duplicates)


def table(summary: Summary) -> str:
    head = ("tenant", "requests", "prompt tokens", "cached tokens", "cached share", "completion tokens")
    rows = [head] + [_cells(u) for u in (*summary.tenants, summary.total)]
    width = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = [
        "  ".join([r[0].ljust(width[0]), *(c.rjust(w) for c, w in zip(r[1:], width[1:], strict=True))]) for r in rows
    ]
    lines.insert(len(lines) - 1, "-" * len(lines[0]))
    if summary.duplicates:
        lines.append(f"({summary.duplicates} duplicate records skipped)")
    return "\n".join(lines) + "\n"


def _cells(u: TenantUsage) -> tuple[str, ...]:
    numbers = (u.requests, u.prompt_tokens, u.cached_tokens)
    return (u.tenant, *(f"{n:,}" for n in numbers), f"{100 * u.cached_share:.1f}%", f"{u.completion_tokens:,}")


async def read_records(
    url: str, client: NatsClientConfig, since_s: float | None = None, timeout_s: float = 30.0
) -> list[UsageRecord]:
    """Every record in the stream (stored in the last ``since_s``), up to the last one there now."""
    try:
        with anyio.fail_after(timeout_s):
            return await _read(url, client, since_s)
    except TimeoutError:
        raise UsageReadError(f"{redacted(url)}: no answer within {timeout_s:g} s (is NATS there?)") from None
    except nats.errors.Error as exc:
        raise UsageReadError(f"{redacted(url)}: cannot read the usage stream {usage.STREAM}: {exc!r}") from None


async def _read(url: str, client: NatsClientConfig, since_s: float | None) -> list[UsageRecord]:
    async with connect(url, "switchyard-usage", client=client) as nc:
        js = nc.jetstream()
        try:
            state = (await js.stream_info(usage.STREAM)).state
        except NotFoundError:
            return []  # no ingress has published a record yet
        if state.messages == 0:
            return []
        config = ConsumerConfig()
        if since_s is not None:
            start = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=since_s)
            config = ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_TIME, opt_start_time=start)
        sub = await js.subscribe(subjects.every_usage(), stream=usage.STREAM, ordered_consumer=True, config=config)
        try:
            info = await sub.consumer_info()
            if info.num_pending == 0 and not (info.delivered and info.delivered.consumer_seq):
                return []  # nothing stored since then
            return [r async for msg in _up_to(sub, state.last_seq) if (r := _decoded(msg.data)) is not None]
        finally:
            await sub.unsubscribe()


async def _up_to(sub, last_seq: int):
    async for msg in sub.messages:
        yield msg
        meta = msg.metadata
        if meta.sequence.stream >= last_seq or meta.num_pending == 0:
            return


def _decoded(data: bytes) -> UsageRecord | None:
    try:
        return usage.decode(data)
    except msgspec.DecodeError as exc:  # not one of ours (the stream's subjects are open to admin)
        print(f"switchyard usage: skipped a record: {exc}", file=sys.stderr)
        return None


def run(args: argparse.Namespace) -> int:
    client = NatsClientConfig(credentials_file=args.nats_credentials_file, tls_ca=args.nats_tls_ca)
    # The connection retries a server that is not there, saying so at each try: the
    # command says it once, when it gives up.
    bus_log = logging.getLogger("switchyard.observability.bus")
    level = bus_log.level
    bus_log.setLevel(logging.ERROR)
    try:
        records = anyio.run(read_records, args.nats_url, client, args.since, args.timeout_s)
    finally:
        bus_log.setLevel(level)
    summary = summarise(records)
    if args.json:
        sys.stdout.write(msgspec.json.format(msgspec.json.encode(summary.as_dict())).decode() + "\n")
    else:
        sys.stdout.write(table(summary))
    return 0
