"""The stack a benchmark measures: started as ``switchyard up`` starts it (one process per
service, from the same plan), waited for until every worker is registered, stopped with
the benchmark's ``ExitStack``; and what the benchmarks read from a stream."""

from __future__ import annotations

import argparse
import re
import subprocess
import time
from contextlib import ExitStack
from dataclasses import dataclass

import httpx

from switchyard import procs, settings
from switchyard import up as up_

COMPLETION_TOKENS = re.compile(rb'"completion_tokens":\s*(\d+)')
CACHED_TOKENS = re.compile(rb'"cached_tokens":\s*(\d+)')


@dataclass
class Stack:
    port: int
    processes: dict[str, subprocess.Popen[bytes]]  # name -> process, nats-server included

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def up_plan(*up_flags: str) -> up_.Plan:
    """The plan ``switchyard up <up_flags>`` would start (the environment is not read)."""
    parser = argparse.ArgumentParser(prog="switchyard up")
    settings.add_command_flags(parser, "up")
    flags = settings.flags_given(parser.parse_args(list(up_flags)))
    return up_.plan(settings.Sources(flags=flags))


def start(
    stack: ExitStack,
    server: procs.NatsServer,
    *up_flags: str,
    prefill: int = 1,
    decode: int = 1,
    colocated: int = 0,
    timeout_s: float = 60,
) -> Stack:
    """Every service of ``switchyard up <up_flags>`` on ``server``, healthy when it returns."""
    port = procs.free_port()
    fleet = ("--prefill", str(prefill), "--decode", str(decode), "--colocated", str(colocated))
    plan = up_plan("--port", str(port), "--log-level", "warning", *fleet, *up_flags)
    processes = {}
    for child in plan.children:
        command, env = up_.child_spec(child, server.url)
        processes[child.name] = procs.spawn(command, env=env)
    stack.callback(procs.stop, list(reversed(processes.values())))
    started = Stack(port, processes | {"nats-server": server.process})
    _wait_healthy(started.url, prefill + colocated, decode + colocated, timeout_s)
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
