"""The batch runner's configuration (``ingress.batch_runner``): one frozen tree, built at the edge."""

from __future__ import annotations

from typing import Annotated

from switchyard.observability import DEFAULT_NATS_URL, NatsClient, NatsClientConfig, NatsUrl
from switchyard.schemas import ConfigStruct, setting


class BatchRunnerConfig(ConfigStruct, frozen=True, kw_only=True):
    nats_url: NatsUrl = DEFAULT_NATS_URL
    nats_client: NatsClient = NatsClientConfig()
    runner_id: Annotated[str, setting("this runner's name in logs (default: generated)", hidden=True)] = ""
    ingress_url: Annotated[str, setting("the ingress the runner sends each line to (its HTTP API)")] = (
        "http://127.0.0.1:8000"
    )
    # With --auth keys on the ingress: a key with the trusted-proxy right, so that each line runs
    # as its batch's tenant (x-switchyard-tenant). Empty: no key (--auth none: tenant default).
    # A file, so that the secret is on no command line, in no environment and in no `config show`.
    api_key_file: Annotated[
        str, setting("file holding an API key with the trusted-proxy right, for an ingress with --auth keys")
    ] = ""
    # Headroom: the runner pulls a line only while the scheduler's central queue holds at most
    # this much, so interactive requests never wait behind batch work (0, 0: an empty queue).
    headroom_queued_requests: Annotated[
        int, setting("pull batch lines only while the scheduler queues at most this many requests", ge=0)
    ] = 0
    headroom_queued_tokens: Annotated[
        int, setting("pull batch lines only while the scheduler queues at most this many prompt tokens", ge=0)
    ] = 0
    # And only while every role keeps this share of its workers' token budgets free, so an
    # interactive request arriving finds room at once instead of waiting for batch lines to end.
    headroom_free_budget: Annotated[
        float,
        setting("pull batch lines only while each role's workers have this share of their budgets free", ge=0, lt=1),
    ] = 0.1
    # Federation: while its own region has no headroom, lines run in another region that has
    # (its ingress pins them there with x-switchyard-region; a batch has no TTFT to lose to a WAN).
    region: Annotated[
        str, setting("the runner's region: lines run in another region that has headroom while this one has none")
    ] = ""
    remote_status_interval_s: Annotated[
        float, setting("federation: how often other regions' queues are read while this region has no headroom", gt=0)
    ] = 0.5
    status_interval_s: Annotated[float, setting("how often the scheduler's queue is read while pulling", gt=0)] = 0.02
    pulls_per_status: Annotated[int, setting("lines pulled on one reading of the scheduler's queue", gt=0)] = 4
    max_in_flight: Annotated[int, setting("lines this runner runs at once, all batches together", gt=0)] = 64
    batch_concurrency: Annotated[int, setting("lines of one batch this runner runs at once", gt=0)] = 16
    ack_wait_s: Annotated[
        float, setting("a line not acked this long after its delivery (its runner died) is delivered again", gt=0)
    ] = 30.0
    max_deliver: Annotated[int, setting("deliveries of one line before it becomes an error line", gt=0)] = 3
    retry_delay_s: Annotated[float, setting("first wait before a line that failed (429, 5xx) runs again", ge=0)] = 1.0
    request_timeout_s: Annotated[float, setting("how long one line's request may take", gt=0)] = 600.0
    scan_interval_s: Annotated[
        float, setting("how often the batch records are read (new, cancelled, expired)", gt=0)
    ] = 0.5
    max_output_bytes: Annotated[int, setting("largest output or error file a batch may write", gt=0)] = 1 << 30
