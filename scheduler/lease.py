"""Which scheduler replica is active: a lease in a JetStream key-value bucket.

Replicas race to create one key (``active``) in a bucket whose TTL is ``lease_ttl_s``;
the one whose create succeeds is active and renews the key every ``lease_renew_s``
with a compare-and-set on the revision it holds. A standby tries the create at the same
interval: it succeeds once the active one deleted the key (a clean exit) or the server
expired it (the active one died or lost NATS), so a standby takes over within about
``lease_ttl_s + lease_renew_s`` of the active one's last renewal.

Fencing: the holder counts its lease from when it *sent* its last accepted write; the
server counts from when it stored it, later. The holder's own view therefore expires
first, and it stops placing work (``held()`` is false) before any standby can create the
key: two replicas never both place work. A holder whose lease lapsed without anyone
taking it (NATS was away: its renewals went unanswered, or a restarted server lost the
bucket) is ``lapsed``: it places nothing and tries to create the key again, as a standby
would; if it gets it, it is active again with all it knew (nobody else held the lease:
its create would have been refused), and if the key is someone else's, the lease is
``lost`` for good (``LeaseLostError``): another replica took over.

Without JetStream on the server there is no lease: the scheduler runs alone, active
from the start (logged), as it runs without persisted sessions there.

``LeaseState`` is the decision, on a clock passed in (tested with a fake one);
``LeaseKeeper`` carries it out on the bus.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import anyio
import nats.errors
from nats.aio.client import Client
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import BadRequestError, KeyNotFoundError, KeyWrongLastSequenceError, ServiceUnavailableError
from nats.js.kv import KeyValue

from switchyard.schemas import SwitchyardError

log = logging.getLogger(__name__)

BUCKET = "switchyard_scheduler_lease"
KEY = "active"

LeasePhase = Literal["standby", "active", "lapsed", "lost"]


class LeaseLostError(SwitchyardError):
    """This scheduler was active and another holds the lease now: it must stop for good."""


@dataclass
class LeaseState:
    """The lease as this replica sees it: ``standby`` -> ``active`` <-> ``lapsed`` -> ``lost``."""

    ttl_s: float
    renew_s: float
    phase: LeasePhase = "standby"
    revision: int = 0
    valid_until: float = float("-inf")  # the holder's own, conservative, expiry
    next_at: float = float("-inf")  # when to try again (create, or renew)

    def __post_init__(self) -> None:
        if not 0 < self.renew_s < self.ttl_s:
            raise ValueError(f"the lease must be renewed ({self.renew_s} s) more often than it lasts ({self.ttl_s} s)")

    @property
    def creating(self) -> bool:
        """The next write is a create (the key is not ours to renew)."""
        return self.phase in ("standby", "lapsed")

    def due(self, now: float) -> bool:
        return self.phase != "lost" and now >= self.next_at

    def written(self, revision: int, sent_at: float) -> None:
        """The server stored our create or renewal, sent at ``sent_at``."""
        if self.phase == "lost":
            return
        self.phase, self.revision = "active", revision
        self.valid_until = sent_at + self.ttl_s
        self.next_at = sent_at + self.renew_s

    def refused(self, now: float) -> None:
        """The key is someone else's: a standby waits on, a holder (active or lapsed) lost it."""
        if self.phase != "standby":
            self.phase = "lost"
        self.next_at = now + self.renew_s

    def vanished(self, now: float) -> None:
        """Our key is gone (expired, or a restarted server lost the bucket): create it again now."""
        if self.phase == "active":
            self.phase = "lapsed"
        self.next_at = now

    def failed(self, now: float) -> None:
        """No answer (NATS away or slow): try again; the lease may lapse meanwhile."""
        self.next_at = now + self.renew_s
        self.expire(now)

    def expire(self, now: float) -> None:
        if self.phase == "active" and now >= self.valid_until:
            self.phase = "lapsed"

    def held(self, now: float) -> bool:
        self.expire(now)
        return self.phase == "active"

    def unleased(self) -> None:
        """No lease to be had (no JetStream): active for good, alone."""
        self.phase, self.valid_until, self.next_at = "active", float("inf"), float("inf")


class LeaseKeeper:
    """The lease on the bus: ``acquire`` waits until active, ``keep`` holds it until lost,
    ``wait_held`` waits out a lapse."""

    def __init__(self, nc: Client, holder: str, state: LeaseState, clock: Callable[[], float]) -> None:
        self._nc = nc
        self.holder = holder
        self.state = state
        self._clock = clock
        self._kv: KeyValue | None = None
        self._changed = anyio.Event()  # set whenever the lease is (re)written or lost
        # Memory storage: a lease means nothing after the server restarts.
        self._config = KeyValueConfig(bucket=BUCKET, ttl=state.ttl_s, history=1, storage=StorageType.MEMORY)

    def held(self) -> bool:
        return self.state.held(self._clock())

    async def wait_held(self) -> None:
        """Until the lease is ours (at once, mostly); ``LeaseLostError`` if it never will be."""
        while not self.held():
            if self.state.phase == "lost":
                raise LeaseLostError(f"scheduler {self.holder} lost its lease")
            self._changed = anyio.Event() if self._changed.is_set() else self._changed
            await self._changed.wait()

    async def open(self) -> None:
        """Find (or create) the bucket; without JetStream, run unleased."""
        try:
            await self._bucket()
        except (nats.errors.NoRespondersError, ServiceUnavailableError) as exc:
            log.warning("no JetStream (%r): scheduler %s runs alone, with no lease and no standby", exc, self.holder)
            self.state.unleased()
        except (nats.errors.Error, OSError) as exc:  # a slow or restarting server: try_once retries
            log.debug("lease bucket not opened: %r", exc)

    async def try_once(self) -> bool:
        """One create or renewal now; True while active."""
        state = self.state
        if state.next_at == float("inf"):
            return True  # unleased
        was = state.phase
        sent_at = self._clock()
        try:
            kv = await self._bucket()
            value = self.holder.encode()
            if state.creating:
                revision = await kv.create(KEY, value)
            else:
                revision = await kv.update(KEY, value, last=state.revision)
        except KeyWrongLastSequenceError:
            await self._refused(sent_at)
        except (nats.errors.Error, OSError) as exc:  # timeout, no JetStream, bucket gone: retry
            log.debug("lease write failed: %r", exc)
            self._kv = None  # opened again (created if missing) on the next try
            state.failed(self._clock())
        else:
            state.written(revision, sent_at)
        if state.phase != was:
            self._changed.set()
            if {was, state.phase} == {"active", "lapsed"}:
                log.warning("scheduler %s: lease %s", self.holder, "lapsed" if was == "active" else "regained")
        return state.held(self._clock())

    async def _refused(self, sent_at: float) -> None:
        """Whose is the key we could not write? Ours (a write whose answer we missed), nobody's,
        or someone else's."""
        assert self._kv is not None
        try:
            entry = await self._kv.get(KEY)
        except KeyNotFoundError:
            self.state.vanished(self._clock())
            return
        except (nats.errors.Error, OSError):
            self.state.failed(self._clock())
            return
        if self._ours(entry) and entry.revision is not None:
            self.state.written(entry.revision, sent_at)
        else:
            self.state.refused(self._clock())

    def _ours(self, entry: KeyValue.Entry) -> bool:
        """Whether the key read back names this replica."""
        return entry.value == self.holder.encode()

    async def acquire(self) -> None:
        """Until this replica holds the lease."""
        while not await self.try_once():
            await self._sleep_until_due()

    async def keep(self) -> None:
        """Renew, and after a lapse create again, until the lease is lost: ``LeaseLostError``."""
        while True:
            await self._sleep_until_due()  # for ever, unleased
            await self.try_once()
            if self.state.phase == "lost":
                raise LeaseLostError(f"scheduler {self.holder} lost its lease to another")

    async def release(self) -> None:
        """Delete the key if it is still ours, so a standby takes over at once."""
        if not self.held() or self._kv is None:
            return
        self.state.phase = "lost"
        self._changed.set()
        with anyio.move_on_after(1, shield=True):
            try:
                await self._delete_ours(self._kv)
            except (nats.errors.Error, OSError) as exc:  # it expires on its own
                log.debug("lease not released: %r", exc)

    async def _delete_ours(self, kv: KeyValue) -> None:
        """The delete, on the revision held. A stop that cut a renewal short (its write
        stored, its answer never read) holds an older revision than the key's, and that
        delete is refused: the key is read back and deleted if it is still ours, as
        ``_refused`` does for a renewal. Otherwise the standby waited out the TTL."""
        try:
            await kv.delete(KEY, last=self.state.revision)
        except BadRequestError:  # wrong last sequence (JetStream's 10071)
            try:
                entry = await kv.get(KEY)
            except KeyNotFoundError:
                return  # gone already
            if self._ours(entry) and entry.revision is not None:
                await kv.delete(KEY, last=entry.revision)

    async def _sleep_until_due(self) -> None:
        if self.state.next_at == float("inf"):
            await anyio.sleep_forever()
        await anyio.sleep(max(0.0, self.state.next_at - self._clock()))

    async def _bucket(self) -> KeyValue:
        if self._kv is None:
            js = self._nc.jetstream()
            try:
                self._kv = await js.create_key_value(self._config)
            except BadRequestError:  # it exists with another TTL (a replica configured otherwise)
                self._kv = await js.key_value(BUCKET)
        return self._kv
