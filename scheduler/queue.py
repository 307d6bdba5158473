"""The central prefill queue: priorities, then fairness between tenants, then arrival.

Order within the queue, first to last:
1. ``priority`` (0 interactive before 1 batch, and so on);
2. requests that lost their worker (re-queued) before new ones;
3. requests that can still meet the TTFT SLO before those predicted to miss it (``late``,
   set by the core's SLO-aware policies: ``demote``);
4. start-time fair queuing by prompt tokens across tenants: each request gets a
   virtual start ``max(now_virtual, tenant's last virtual finish)`` and advances its
   tenant's finish by its prompt tokens, so a tenant that floods the queue waits
   behind the others' next requests instead of starving them. With a ``size_weight``
   (the core's SLO-aware queueing, ``SchedulerCore``) the order is by the virtual start
   plus ``size_weight`` times the prompt tokens instead: shorter prompts first, a long one
   behind the shorter ones its tenants send until about that many times its length in
   tokens have come after it (aging in virtual time), and tenants still fair between each
   other;
5. arrival order.
The head is dispatched when some worker fits it; nobody jumps the head (no
starvation of large prompts by small ones), except the core's bounded backfill around a
head larger than any worker's budget (``behind_head``).
"""

from __future__ import annotations

import bisect

from switchyard.scheduler.state import Tracked

_Key = tuple[int, int, int, float, int, str]


class FairQueue:
    def __init__(self, size_weight: float = 0.0) -> None:
        self.size_weight = size_weight
        self._entries: list[_Key] = []
        self._virtual_now = 0.0
        self._tenant_finish: dict[str, float] = {}
        self.tokens = 0
        self.late_tokens = 0  # of those, the prompt tokens of requests demoted as late

    def __len__(self) -> int:
        return len(self._entries)

    def push(self, tracked: Tracked, front: bool = False) -> None:
        tracked.requeued = front
        if tracked.virtual_start is None:
            tenant = tracked.spec.tenant
            start = max(self._virtual_now, self._tenant_finish.get(tenant, 0.0))
            self._tenant_finish[tenant] = start + tracked.prompt_tokens
            tracked.virtual_start = start
        bisect.insort(self._entries, self._key(tracked))
        self.tokens += tracked.prompt_tokens

    def head(self) -> str | None:
        return self._entries[0][-1] if self._entries else None

    def pop_head(self, tracked: Tracked) -> None:
        assert self._entries and self._entries[0][-1] == tracked.spec.request_id
        self._entries.pop(0)
        self.tokens -= tracked.prompt_tokens
        self.late_tokens -= tracked.prompt_tokens if tracked.late else 0
        self._virtual_now = max(self._virtual_now, tracked.virtual_start or 0.0)
        self._forget_idle_tenants()

    def remove(self, tracked: Tracked) -> None:
        self._entries.remove(self._key(tracked))
        self.tokens -= tracked.prompt_tokens
        self.late_tokens -= tracked.prompt_tokens if tracked.late else 0

    def demote(self, tracked: Tracked) -> None:
        """It is predicted to miss its SLO: behind every request that is not."""
        self._entries.remove(self._key(tracked))
        tracked.late = True
        bisect.insort(self._entries, self._key(tracked))
        self.late_tokens += tracked.prompt_tokens

    def behind_head(self, limit: int) -> list[str]:
        """The ids of up to ``limit`` requests after the head, in order."""
        return [entry[-1] for entry in self._entries[1 : limit + 1]]

    def position(self, tracked: Tracked) -> int:
        """1 for the head."""
        return bisect.bisect_left(self._entries, self._key(tracked)) + 1

    def request_ids(self) -> list[str]:
        return [entry[-1] for entry in self._entries]

    def _key(self, tracked: Tracked) -> _Key:
        start = tracked.virtual_start or 0.0
        return (
            tracked.spec.priority,
            0 if tracked.requeued else 1,
            1 if tracked.late else 0,
            # late requests: shortest first (the most of them served in the capacity left over)
            float(tracked.prompt_tokens) if tracked.late else start + self.size_weight * tracked.prompt_tokens,
            tracked.order,
            tracked.spec.request_id,
        )

    def _forget_idle_tenants(self) -> None:
        # A tenant whose virtual finish is behind virtual now has no advantage left to
        # remember; dropping it keeps this map as small as the set of active tenants.
        if len(self._tenant_finish) > 1024:
            self._tenant_finish = {t: f for t, f in self._tenant_finish.items() if f > self._virtual_now}
