"""The ingress's configuration: one frozen tree, built at the edge."""

from __future__ import annotations

import msgspec


class IngressConfig(msgspec.Struct, frozen=True, kw_only=True):
    nats_url: str
    model_dir: str
    served_model_name: str = ""  # default: the model directory's own name
    host: str = "127.0.0.1"
    port: int = 8000  # 0 picks a free port
    ingress_id: str = ""  # default: generated
    block_size: int = 16  # must equal the engine's KV block size
    # How block keys are hashed: "blake2b" for the sim engine, "vllm-sha256-cbor" for vLLM
    # workers (with their hash seed), so the scheduler's index names blocks as the engine does.
    key_scheme: str = "blake2b"
    hash_seed: str = "vllm-none-hash"
    max_body_bytes: int = 8 * 1024 * 1024
    default_max_tokens: int = 1024
    submit_timeout_s: float = 5.0
    # A request whose stream stays silent this long fails instead of hanging.
    stream_idle_timeout_s: float = 60.0
    trace_exporter: str = "none"

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.max_body_bytes <= 0 or self.default_max_tokens <= 0:
            raise ValueError("block_size, max_body_bytes and default_max_tokens must be positive")
        from switchyard.kvbus.keys import KeyScheme

        KeyScheme(self.key_scheme, self.hash_seed)  # raises on an unknown scheme
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port {self.port} is out of range")
