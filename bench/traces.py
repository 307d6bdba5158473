"""Request traces for ``switchyard bench sim``: reading them, and what they promise.

Two public formats (see ``shared/data/README.md``):

- **Mooncake** JSONL (kvcache-ai/Mooncake, FAST'25): one object a line with
  ``timestamp`` (ms since the first request), ``input_length``, ``output_length`` and
  ``hash_ids``, one id per 512-token block of the prompt, the last one possibly
  partial. The ids are prefix-chained: equal leading ids mean a shared prefix.
- **Azure** CSV (Azure/AzurePublicDataset, Splitwise): ``TIMESTAMP`` (a wall-clock
  datetime), ``ContextTokens``, ``GeneratedTokens``. No prefix information, so each
  request gets block ids of its own and nothing is ever shared.

A malformed row is a ``TraceError`` naming the file and line; nothing is skipped
silently. ``hit_ratio_bound`` is the infinite-cache ceiling of the prefix hit ratio:
no router and no cache size can beat it on that trace.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Literal

from switchyard.schemas import SwitchyardError

TRACE_BLOCK_SIZE = 512  # tokens per hash id, in both formats
TraceFormat = Literal["mooncake", "azure"]
_MASK = (1 << 64) - 1
_EPOCH = datetime(1970, 1, 1)


class TraceError(SwitchyardError, ValueError):
    """A trace that cannot be read; the message names the file and line."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival_s: float  # seconds since the first request of the trace
    input_tokens: int
    output_tokens: int
    block_ids: tuple[int, ...]  # one per TRACE_BLOCK_SIZE tokens of the prompt, prefix-chained


def read_trace(path: Path, fmt: TraceFormat | None = None, limit: int | None = None) -> list[TraceRequest]:
    """The first ``limit`` requests of the trace (all when None), in arrival order. A file
    that cannot be opened or read is a ``TraceError`` naming it, as a malformed one is."""
    requests: list[TraceRequest] = []
    try:
        fmt = fmt or detect_format(path)
        rows = _read_mooncake(path) if fmt == "mooncake" else _read_azure(path)
        for request in rows:
            if limit is not None and len(requests) >= limit:
                break
            requests.append(request)
    except OSError as exc:
        raise TraceError(f"{path}: cannot read it: {exc.strerror or exc}") from exc
    if not requests:
        raise TraceError(f"{path}: no requests")
    first = min(r.arrival_s for r in requests)
    # Stable: requests with equal timestamps keep the file's order.
    ordered = sorted(requests, key=lambda r: r.arrival_s)
    return [TraceRequest(r.arrival_s - first, r.input_tokens, r.output_tokens, r.block_ids) for r in ordered]


def detect_format(path: Path) -> TraceFormat:
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        return "mooncake"
    if suffix == ".csv":
        return "azure"
    with path.open() as f:
        head = f.readline().lstrip()
    if head.startswith("{"):
        return "mooncake"
    if head.startswith("TIMESTAMP"):
        return "azure"
    raise TraceError(f"{path}: cannot tell the trace format (want Mooncake JSONL or Azure CSV); pass --format")


def blocks_for(tokens: int) -> int:
    return math.ceil(tokens / TRACE_BLOCK_SIZE)


def _read_mooncake(path: Path) -> Iterator[TraceRequest]:
    with path.open() as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceError(f"{where}: not JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise TraceError(f"{where}: expected a JSON object")
            timestamp = _number(row, "timestamp", where)
            inp = _positive(row.get("input_length"), "input_length", where)
            out = _positive(row.get("output_length"), "output_length", where)
            ids = row.get("hash_ids")
            if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
                raise TraceError(f"{where}: hash_ids must be a list of integers")
            if len(ids) != blocks_for(inp):
                raise TraceError(
                    f"{where}: {len(ids)} hash_ids for {inp} input tokens "
                    f"(want one per {TRACE_BLOCK_SIZE}-token block: {blocks_for(inp)})"
                )
            yield TraceRequest(timestamp / 1000.0, inp, out, tuple(ids))


def _read_azure(path: Path) -> Iterator[TraceRequest]:
    fresh = 0  # Azure has no prefix information: every block id is new
    with path.open(newline="") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        want = ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]
        if header is None or [h.strip() for h in header[:3]] != want:
            raise TraceError(f"{path}:1: expected the header {','.join(want)}, got {header!r}")
        for row in reader:
            where = f"{path}:{reader.line_num}"
            if not row:
                continue
            if len(row) < 3:
                raise TraceError(f"{where}: expected 3 fields, got {len(row)}")
            try:  # naive, so no time zone or DST shift enters the differences
                stamp = (datetime.fromisoformat(row[0].strip()) - _EPOCH).total_seconds()
            except ValueError:
                raise TraceError(f"{where}: TIMESTAMP {row[0]!r} is not a date and time") from None
            inp = _positive(_int(row[1], "ContextTokens", where), "ContextTokens", where)
            out = _positive(_int(row[2], "GeneratedTokens", where), "GeneratedTokens", where)
            n = blocks_for(inp)
            yield TraceRequest(stamp, inp, out, tuple(range(fresh, fresh + n)))
            fresh += n


def _number(row: dict, name: str, where: str) -> float:
    value = row.get(name)
    if not isinstance(value, int | float) or isinstance(value, bool) or value < 0:
        raise TraceError(f"{where}: {name} must be a non-negative number, got {value!r}")
    return float(value)


def _int(text: str, name: str, where: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise TraceError(f"{where}: {name} {text!r} is not an integer") from None


def _positive(value: object, name: str, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise TraceError(f"{where}: {name} must be a positive integer, got {value!r}")
    return value


def hit_ratio_bound(requests: list[TraceRequest]) -> float:
    """Prompt tokens an infinite cache would serve / prompt tokens.

    A request's hit is its leading blocks already seen earlier in the trace, up to its
    first miss, in tokens (capped at its length: the last block may be partial).
    ``shared/data/README.md`` quotes the same count in blocks (0.366 on the Mooncake
    conversation trace, 0.374 in tokens).
    """
    return lru_hit_ratio(requests, None)


def lru_hit_ratio(requests: list[TraceRequest], capacity_blocks: int | None) -> float:
    """The same count with one LRU cache of ``capacity_blocks`` (None: unbounded) shared by
    the whole fleet: what a fleet whose caches add up to that many blocks could at best
    serve, if placement were perfect and no block were held twice. ``shared/data/README.md``
    quotes it in blocks for 10k / 50k / 100k (0.211 / 0.355 / 0.364)."""
    from collections import OrderedDict

    cache: OrderedDict[int, None] = OrderedDict()
    hit = total = 0
    for request in requests:
        blocks = 0
        for block in request.block_ids:
            if block not in cache:
                break
            blocks += 1
        hit += min(blocks * TRACE_BLOCK_SIZE, request.input_tokens)
        total += request.input_tokens
        for block in request.block_ids:
            cache[block] = None
            cache.move_to_end(block)
        while capacity_blocks is not None and len(cache) > capacity_blocks:
            cache.popitem(last=False)
    return hit / total if total else 0.0


def block_keys(block_ids: tuple[int, ...], salt: int) -> list[int]:
    """The trace's block ids as 64-bit chained block keys of one tenant.

    The trace ids are already prefix-chained; mixing each with the tenant's ``salt``
    (splitmix64's finaliser, a bijection on 64 bits) keeps equal ids equal and makes
    keys of different tenants (or traces) distinct, as ``kvbus.keys`` salts them.
    """
    return [_mix((salt + block) & _MASK) for block in block_ids]


def tenant_salt(tenant: str) -> int:
    key = 0
    for byte in tenant.encode():
        key = _mix(key ^ byte)
    return key


def _mix(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


__all__ = [
    "TRACE_BLOCK_SIZE",
    "TraceError",
    "TraceFormat",
    "TraceRequest",
    "block_keys",
    "blocks_for",
    "detect_format",
    "hit_ratio_bound",
    "lru_hit_ratio",
    "read_trace",
    "tenant_salt",
]
