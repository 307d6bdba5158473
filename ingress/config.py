"""The ingress's configuration: one frozen tree, built at the edge (``switchyard.settings``)."""

from __future__ import annotations

from typing import Annotated, Literal

from switchyard.observability import DEFAULT_NATS_URL, NatsClient, NatsClientConfig, NatsUrl
from switchyard.schemas import ConfigStruct, setting


class UsageConfig(ConfigStruct, frozen=True, kw_only=True):
    """The usage records (``ingress.usage``): one per finished generation, on JetStream."""

    records: Annotated[bool, setting("publish a usage record per finished request to JetStream, for billing")] = True
    # The stream's limits, set when an ingress creates it; a stream that exists keeps its own
    # (the ingress may create it, not change it: schemas.permissions).
    max_age_s: Annotated[float, setting("usage stream: records older than this are removed", gt=0)] = 90 * 86400.0
    max_bytes: Annotated[int, setting("usage stream: the oldest records are removed above this size", gt=0)] = 1024**3
    # A record retried within the window is stored once (Nats-Msg-Id = request id); one
    # retried later is stored again, and readers deduplicate by request id.
    duplicate_window_s: Annotated[float, setting("usage stream: how long a request id is remembered", gt=0)] = 600.0
    buffer: Annotated[
        int, setting("usage records held while JetStream is unreachable; more are dropped and counted", gt=0)
    ] = 10_000


class FilesConfig(ConfigStruct, frozen=True, kw_only=True):
    """The OpenAI Files API (``ingress.files``): files kept in JetStream, per tenant."""

    # OpenAI's limit for a batch input file. An upload is its own route with this limit,
    # not --max-body-bytes; its form is spooled to a temporary file past 1 MiB, never
    # held whole in memory.
    max_bytes: Annotated[int, setting("largest file an upload may hold (413 above)", gt=0)] = 200 * 1024 * 1024


class RegionsConfig(ConfigStruct, frozen=True, kw_only=True):
    """Federation (``ingress.federation``): how a request picks its region, when ``--region``
    names this ingress's and the NATS server is one region of a supercluster."""

    policy: Annotated[
        Literal["geo", "local", "blind"],
        setting(
            "geo: a session to the region holding its prefix when that beats recomputing at home, spill when "
            "home is saturated; local: always home; blind: the least queued region"
        ),
    ] = "geo"
    dark_after_s: Annotated[
        float, setting("a region silent this long is dropped from routing and its streams here fail over", gt=0)
    ] = 3.0
    ping_interval_s: Annotated[float, setting("how often the round trip to each other region is measured", gt=0)] = 1.0
    spill_margin_s: Annotated[
        float,
        setting(
            "geo: a request with no session leaves a home that is not saturated when another region would give "
            "it its first token this much sooner, round trip included",
            ge=0,
        ),
    ] = 0.5
    session_ttl_s: Annotated[float, setting("a session stays in the directory this long after its last use", gt=0)] = (
        600.0
    )


class IngressConfig(ConfigStruct, frozen=True, kw_only=True):
    nats_url: NatsUrl = DEFAULT_NATS_URL
    nats_client: NatsClient = NatsClientConfig()
    model_dir: Annotated[str, setting("model directory (tokenizer.json and chat template)", flag="model")] = ""
    served_model_name: Annotated[str, setting("the model's name in the API (default: its directory's)")] = ""
    host: Annotated[str, setting("interface the HTTP API listens on")] = "127.0.0.1"
    port: Annotated[int, setting("HTTP port (0 picks a free one)", ge=0, le=65535)] = 8000
    ingress_id: Annotated[str, setting("this ingress's id on the bus (default: generated)", hidden=True)] = ""
    block_size: Annotated[int, setting("the engine's KV block size; default: 16 (sim), 32 (vllm)", gt=0)] = 16
    # The scheduler's index must name blocks as the engine does: "blake2b" for the sim
    # engine, "vllm-sha256-cbor" (with the engines' hash seed) for vLLM workers.
    key_scheme: Annotated[
        Literal["blake2b", "vllm-sha256-cbor"], setting("block-key hashing: the sim engine's, or a vLLM engine's")
    ] = "blake2b"
    hash_seed: Annotated[str, setting("vllm: the root of the engines' block hashes (an integer, or the default)")] = (
        "vllm-none-hash"
    )
    max_body_bytes: Annotated[int, setting("largest request body (413 above)", gt=0)] = 8 * 1024 * 1024
    # The edge (ingress.edge, ingress.app): what one client may cost. The decoder recurses per
    # level of nesting, so the depth stays far below Python's recursion limit.
    max_json_depth: Annotated[
        int, setting("deepest nesting of arrays and objects in a body (400 above)", gt=0, le=256)
    ] = 64
    tokenize_threads: Annotated[
        int, setting("threads that render chat templates and tokenize, off the event loop", gt=0)
    ] = 4
    max_streams: Annotated[int, setting("generation requests in flight on this ingress (429 above)", gt=0)] = 1024
    max_connections: Annotated[
        int, setting("open HTTP connections (a request on one more gets 503); keep under the file limit", gt=0)
    ] = 4096
    max_header_bytes: Annotated[int, setting("largest request head, request line and headers (431 above)", ge=1024)] = (
        32 * 1024
    )
    max_headers: Annotated[int, setting("most header fields in a request (431 above)", gt=0)] = 100
    # Above a load balancer's usual 60 s idle timeout, so that the balancer closes first.
    keep_alive_timeout_s: Annotated[
        float, setting("an idle connection (kept alive, or never used) is closed after this long", gt=0)
    ] = 65.0
    header_timeout_s: Annotated[
        float, setting("a request head must arrive within this long of its first byte (408)", gt=0)
    ] = 10.0
    body_timeout_s: Annotated[float, setting("a request body must arrive within this long of its head (408)", gt=0)] = (
        60.0
    )
    send_timeout_s: Annotated[
        float, setting("a client that takes no response bytes for this long is dropped, its request cancelled", gt=0)
    ] = 30.0
    default_max_tokens: Annotated[int, setting("max_tokens of a request that names none", gt=0)] = 1024
    submit_timeout_s: Annotated[float, setting("how long the scheduler may take to admit a request", gt=0)] = 5.0
    stream_idle_timeout_s: Annotated[
        float, setting("a request whose stream stays silent this long fails instead of hanging", gt=0)
    ] = 60.0
    max_migrations: Annotated[
        int, setting("times a stream whose worker is lost continues on another (0: it fails at once)", ge=0)
    ] = 2
    reconnect_stall_s: Annotated[
        float,
        setting(
            "after the NATS connection came back, a stream that makes no progress this long continues elsewhere",
            gt=0,
        ),
    ] = 3.0
    migration_wait_s: Annotated[
        float,
        setting("how long a stream whose worker is lost waits for a worker of that role to be there again", ge=0),
    ] = 5.0
    trace_exporter: Annotated[Literal["none", "console", "otlp"], setting("where spans go")] = "none"
    # How the model writes a tool call (ingress.tool_parsers); without one, `tool_choice: auto`
    # is refused (a named or required call needs none: the output is constrained to it).
    tool_call_parser: Annotated[
        Literal["", "hermes", "llama3_json", "kimi_k2"],
        setting("the model's tool-call format: hermes (Hermes, Qwen), llama3_json, kimi_k2; empty: none"),
    ] = ""
    # How the model marks its thinking (ingress.reasoning): with one, chat answers carry it as
    # `reasoning`, apart from `content`, as vLLM's --reasoning-parser does.
    reasoning_parser: Annotated[
        Literal["", "think"],
        setting(
            "the model's thinking format: think (<think>...</think>: Qwen3, DeepSeek-R1 and the like); "
            "empty: none, the thinking stays in the content"
        ),
    ] = ""
    cors_allow_origins: Annotated[
        str, setting('origins browsers may call the API from, comma-separated ("*": any; empty: no CORS)')
    ] = ""
    # Who may call, and as which tenant (ingress.auth). "none" keeps the embedded stack usable
    # without a key, and says so loudly at start; x-switchyard-tenant is refused there.
    auth: Annotated[
        Literal["none", "keys", "proxy"],
        setting(
            "none: no keys, every client is tenant 'default'; keys: API keys from --keys-file; "
            "proxy: no keys, x-switchyard-tenant trusted from anyone (only behind a proxy that sets it)"
        ),
    ] = "none"
    keys_file: Annotated[str, setting("--auth keys: the API keys file that `switchyard keys create` writes")] = ""
    usage: Annotated[UsageConfig, setting("per-tenant usage records", prefix="usage-")] = UsageConfig()
    region: Annotated[
        str,
        setting(
            "this ingress's region: its requests are routed among the supercluster's regions (--region-policy), "
            "and its usage records name it (empty: none)"
        ),
    ] = ""
    regions: Annotated[RegionsConfig, setting("federation", prefix="region-")] = RegionsConfig()
    files: Annotated[FilesConfig, setting("the Files API", prefix="files-")] = FilesConfig()

    def __post_init__(self) -> None:
        super().__post_init__()
        from switchyard.kvbus import KeyScheme

        KeyScheme(self.key_scheme, self.hash_seed)  # raises on a hash seed the scheme cannot take
        if self.auth == "keys" and not self.keys_file:
            raise ValueError("auth: keys needs a keys file (--keys-file FILE, made by `switchyard keys create`)")
