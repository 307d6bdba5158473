"""Session affinity: ``x-session-affinity`` binds a session to the prefill worker that
served it, for ``ttl_s``. Keys are (tenant, session): one tenant's session name never
routes another tenant's requests. The binding is advisory: the core follows it only
while that worker has room (bounded load), else the request spills to the policy.

The table is pure state; the scheduler service persists changes (``Binding``s the core
emits as ``BindSession`` actions) in a JetStream KV bucket and restores them on start,
so bindings survive a scheduler restart.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Binding:
    tenant: str
    session: str
    worker_id: str
    expires_at: float  # on the scheduler's clock


class SessionTable:
    def __init__(self, ttl_s: float, max_sessions: int = 1_000_000) -> None:
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self._bindings: dict[tuple[str, str], Binding] = {}

    def __len__(self) -> int:
        return len(self._bindings)

    def lookup(self, tenant: str, session: str, now: float) -> str | None:
        binding = self._bindings.get((tenant, session))
        return binding.worker_id if binding is not None and binding.expires_at > now else None

    def bind(self, tenant: str, session: str, worker_id: str, now: float) -> Binding:
        binding = Binding(tenant, session, worker_id, now + self.ttl_s)
        self._bindings.pop((tenant, session), None)  # re-insert: dict order is recency order
        self._bindings[(tenant, session)] = binding
        if len(self._bindings) > self.max_sessions:
            del self._bindings[next(iter(self._bindings))]
        return binding

    def live(self, now: float) -> list[Binding]:
        return [b for b in self._bindings.values() if b.expires_at > now]

    def restore(self, binding: Binding, now: float) -> None:
        if binding.expires_at > now:
            self._bindings[(binding.tenant, binding.session)] = binding

    def expire(self, now: float) -> None:
        self._bindings = {k: b for k, b in self._bindings.items() if b.expires_at > now}

    def forget_worker(self, worker_id: str) -> int:
        """Drop the bindings to a worker that is gone; how many."""
        return self.keep_only(lambda w: w != worker_id)

    def keep_only(self, alive: Callable[[str], bool]) -> int:
        """Drop the bindings to workers not ``alive`` (restored ones naming a worker that
        never came back); how many."""
        before = len(self._bindings)
        self._bindings = {k: b for k, b in self._bindings.items() if alive(b.worker_id)}
        return before - len(self._bindings)
