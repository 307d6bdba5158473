"""The stack a benchmark measures: started as ``switchyard up`` starts it (one process per
service, from the same ``child_commands``), waited for until every worker is registered,
stopped with the benchmark's ``ExitStack``; and what the benchmarks read from a stream."""

from __future__ import annotations

import re
import subprocess
import time
from contextlib import ExitStack
from dataclasses import dataclass

import httpx

from switchyard import procs

COMPLETION_TOKENS = re.compile(rb'"completion_tokens":\s*(\d+)')
CACHED_TOKENS = re.compile(rb'"cached_tokens":\s*(\d+)')


@dataclass
class Stack:
    port: int
    processes: dict[str, subprocess.Popen]  # name -> process, nats-server included

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def start(
    stack: ExitStack, server: procs.NatsServer, *up_flags: str, prefill: int = 1, decode: int = 1, timeout_s: float = 60
) -> Stack:
    """Every service of ``switchyard up <up_flags>`` on ``server``, healthy when it returns."""
    from switchyard.cli import build_parser
    from switchyard.up import child_commands

    port = procs.free_port()
    up = build_parser().parse_args(
        [
            "up",
            "--port",
            str(port),
            "--log-level",
            "warning",
            "--prefill",
            str(prefill),
            "--decode",
            str(decode),
            *up_flags,
        ]
    )
    processes = {name: procs.spawn(command, env=procs.child_env()) for name, command in child_commands(up, server.url)}
    stack.callback(procs.stop, list(reversed(processes.values())))
    started = Stack(port, processes | {"nats-server": server.process})
    _wait_healthy(started.url, prefill, decode, timeout_s)
    return started


def _wait_healthy(url: str, prefill: int, decode: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            body = httpx.get(url + "/health", timeout=1).json()
            if body.get("prefill_workers") == prefill and body.get("decode_workers") == decode:
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.1)
    raise procs.ProcessError(f"the stack at {url} did not become healthy within {timeout_s:.0f} s")
