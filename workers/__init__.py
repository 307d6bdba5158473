"""Prefill and decode workers around an engine (``sim`` now; ``vllm`` next)."""

from workers.config import WorkerConfig
from workers.factory import build_worker

__all__ = ["WorkerConfig", "build_worker"]
