"""``BatchClient``: batch jobs from Python over NATS, no HTTP: the bus-native face of the
Batch API (``schemas.batch.JobSubmit``, answered by a batch runner).

    async with connect(url, "producer") as nc:
        jobs = BatchClient(nc)
        batch = await jobs.submit("/v1/completions", {"j1": {"model": m, "prompt": "hi"}})
        batch = await jobs.wait(batch.id)
        results = await jobs.results(batch.id)    # custom_id -> LineResult
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import anyio
from nats.aio.client import Client
from nats.errors import NoRespondersError

from switchyard.ingress.batch_store import BatchStore
from switchyard.ingress.errors import IngressError
from switchyard.schemas import batch as schema
from switchyard.schemas import subjects

_RETRY_S = 0.05


class BatchRejected(IngressError):
    """The jobs were refused before any ran: each error names its job (``line``: its index + 1)."""

    def __init__(self, errors: list[schema.BatchError]) -> None:
        super().__init__("; ".join(f"job {e.line}: {e.message}" if e.line else e.message for e in errors))
        self.errors = errors


class NoBatchRunner(IngressError):
    """No batch runner answered the submit within the client's timeout."""


class BatchClient:
    def __init__(self, nc: Client, *, timeout_s: float = 30.0) -> None:
        self._nc = nc
        self._timeout_s = timeout_s
        self._store = BatchStore(nc)

    async def submit(
        self,
        endpoint: str,
        jobs: Mapping[str, dict[str, Any]],
        *,
        tenant: str = "default",
        metadata: dict[str, str] | None = None,
    ) -> schema.Batch:
        """Run ``jobs`` (custom_id -> request body) as one batch: the batch, in progress."""
        submit = schema.JobSubmit(
            endpoint=endpoint,
            jobs=[schema.Job(custom_id=k, body=v) for k, v in jobs.items()],
            tenant=tenant,
            metadata=metadata,
        )
        match schema.JOB_REPLY.decode(await self._request(schema.encode(submit))):
            case schema.JobAccepted(batch=batch):
                return batch
            case schema.JobRejected(errors=errors):
                raise BatchRejected(errors)
        raise AssertionError("unreachable: JobReply has two variants")

    async def _request(self, data: bytes) -> bytes:
        """The runners' answer. "No responders" means nobody received the submit, so it is sent
        again until ``timeout_s``: a runner may be (re)starting, and nats-server can answer so
        for a moment after a queue subscription is made."""
        deadline = anyio.current_time() + self._timeout_s
        while True:
            try:
                reply = await self._nc.request(subjects.BATCH_SUBMIT, data, timeout=self._timeout_s)
            except NoRespondersError:
                if anyio.current_time() >= deadline:
                    raise NoBatchRunner(f"no batch runner answers on {subjects.BATCH_SUBMIT}") from None
                await anyio.sleep(_RETRY_S)
                continue
            return reply.data

    async def status(self, batch_id: str) -> schema.Batch | None:
        await self._store.ensure()
        return await self._store.get(batch_id)

    async def wait(self, batch_id: str, *, poll_s: float = 0.2) -> schema.Batch:
        """The batch once it has ended (completed, failed, cancelled or expired)."""
        while True:  # the record changes in other processes: read again until it has ended
            batch = await self.status(batch_id)
            if batch is not None and batch.terminal:
                return batch
            await anyio.sleep(poll_s)

    async def results(self, batch_id: str) -> dict[str, schema.LineResult]:
        """Every result so far, by custom_id (one per job, never two)."""
        await self._store.ensure()
        return {r.custom_id: r for r in await self._store.results_of(batch_id)}
