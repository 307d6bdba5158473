"""The vllm engine under test: the tiny model, a reference engine alone, and the whole
stack started the way ``make run`` starts it (``switchyard up --engine vllm``), with
its own Mooncake master and segment, against the test's nats-server.

Engines boot in 30-90 s on this machine, so a test module starts one stack and all its
tests share it; the reference outputs are computed once per session.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil

from switchyard import procs
from switchyard.observability import settle
from switchyard.tiny_model import build_tiny_model

ROOT = Path(__file__).resolve().parents[2]
TINY_MODEL = Path(os.environ.get("SWITCHYARD_TINY_MODEL", ROOT / ".cache" / "tiny-llama"))
BLOCK = 32
ENGINE_FLAGS = [
    "--dtype",
    "float32",
    "--enforce-eager",
    "--kv-cache-bytes",
    str(64 << 20),
    "--max-model-len",
    "4096",
    "--block-size",
    str(BLOCK),
]
MAX_TOKENS = 16


def tiny_model() -> Path:
    return build_tiny_model(TINY_MODEL)


def seeded_prompts(n: int = 6, seed: int = 7) -> list[list[int]]:
    """Prompts of ordinary token ids, 40 to 300 long, some repeating a phrase (so n-gram
    speculation has something to propose)."""
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        if i % 2:
            phrase = [rng.randrange(256, 4000) for _ in range(rng.randrange(5, 12))]
            prompts.append((phrase * 40)[: rng.randrange(60, 300)])
        else:
            prompts.append([rng.randrange(256, 4000) for _ in range(rng.randrange(40, 300))])
    return prompts


def reference_outputs(model: Path, prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[dict]:
    """Greedy tokens of one engine alone (``tests/support/vllm_reference.py``)."""
    with tempfile.TemporaryDirectory() as tmp:
        source, target = Path(tmp) / "in.json", Path(tmp) / "out.json"
        source.write_text(json.dumps({"prompts": prompts, "max_tokens": max_tokens}))
        env = {**os.environ, "VLLM_CACHE_ROOT": str(Path(tmp) / "vllm-cache")}
        result = subprocess.run(
            [sys.executable, str(Path(__file__).with_name("vllm_reference.py")), str(model), str(source), str(target)],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        if result.returncode != 0:
            raise RuntimeError(f"reference engine failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
        return json.loads(target.read_text())


@dataclass
class UpStack:
    url: str
    nats_url: str
    process: subprocess.Popen
    log: Path

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def children(self, name: str) -> list[psutil.Process]:
        found = []
        for child in psutil.Process(self.process.pid).children(recursive=True):
            try:
                if child.name() == name or name in " ".join(child.cmdline()):
                    found.append(child)
            except psutil.NoSuchProcess:
                continue
        return found

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


@contextmanager
def vllm_stack(
    nats_url: str, log: Path, *, kv_transfer: str, extra: list[str] = (), timeout_s: float = 600.0
) -> Iterator[UpStack]:
    """``switchyard up --engine vllm`` on the test's NATS, ready (both roles registered)."""
    port = procs.free_port()
    command = [
        sys.executable,
        "-m",
        "switchyard",
        "up",
        "--engine",
        "vllm",
        "--model",
        str(tiny_model()),
        "--nats",
        nats_url,
        "--port",
        str(port),
        "--kv-transfer",
        kv_transfer,
        *ENGINE_FLAGS,
        "--report-interval-s",
        "0.2",
        "--ready-timeout-s",
        str(timeout_s),
        # The tests give requests tenants of their own with x-switchyard-tenant (a cold cache).
        "--auth",
        "proxy",
        *extra,
    ]
    out = log.open("w")
    process = procs.spawn(command, env=procs.child_env(), stdout=out)
    stack = UpStack(url=f"http://127.0.0.1:{port}", nats_url=nats_url, process=process, log=log)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"switchyard up exited with {process.returncode}:\n{stack.log_tail()}")
            try:
                if httpx.get(stack.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the vllm stack was not ready in {timeout_s} s:\n{stack.log_tail()}")
            time.sleep(1)
        yield stack
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(90)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        out.close()


class BusWatch:
    """The test's own NATS connection: every ``WorkerEvent`` heard, and the scheduler's
    ``ClusterStatus`` on demand (the workers' engine counters as last reported)."""

    def __init__(self, nats_url: str) -> None:
        self.nats_url = nats_url
        self.events: list = []

    def __enter__(self) -> BusWatch:
        from anyio.from_thread import start_blocking_portal

        self._portal_cm = start_blocking_portal(backend="asyncio")
        self.portal = self._portal_cm.__enter__()
        self.portal.call(self._connect)
        return self

    def __exit__(self, *exc) -> None:
        self.portal.call(self._nc.close)
        self._portal_cm.__exit__(*exc)

    async def _connect(self) -> None:
        import nats

        from switchyard.schemas import codec, subjects

        self._nc = await nats.connect(self.nats_url)

        async def on_event(msg) -> None:
            self.events.append(codec.WORKER_EVENT.decode(msg.data))

        await self._nc.subscribe(subjects.WORKER_EVENTS, cb=on_event)
        await settle(self._nc)

    def status(self):
        from switchyard.schemas import ClusterStatus, StatusRequest, codec, subjects

        async def ask():
            reply = await self._nc.request(subjects.SUBMIT, codec.SCHEDULER_REQUEST.encode(StatusRequest()), timeout=2)
            return codec.SCHEDULER_REPLY.decode(reply.data)

        status = self.portal.call(ask)
        assert isinstance(status, ClusterStatus)
        return status

    def stats(self, role: str):
        """Summed engine counters of the workers of ``role``."""
        from switchyard.schemas import EngineStats

        total: dict[str, int] = {}
        for worker in self.status().workers:
            if worker.role == role and worker.stats is not None:
                for name in EngineStats.__struct_fields__:
                    total[name] = total.get(name, 0) + getattr(worker.stats, name)
        return EngineStats(**total)

    def finished(self, worker_prefix: str = "") -> dict:
        from switchyard.schemas import RequestFinished

        return {
            e.request_id: e
            for e in self.events
            if isinstance(e, RequestFinished) and e.worker_id.startswith(worker_prefix)
        }


def settled_stats(bus: BusWatch, role: str, more_than: int = -1):
    """The role's engine counters once heartbeats have carried the last request's figures."""
    stats = bus.stats(role)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        time.sleep(0.5)  # more than two report intervals
        newer = bus.stats(role)
        if newer == stats and newer.prompt_tokens > more_than:
            return newer
        stats = newer
    raise AssertionError(f"{role} counters did not settle: {stats}")


def greedy_decodes(client, bus: BusWatch, tokenizer, references: dict) -> Iterator[tuple[list[int], Any]]:
    """Every reference prompt through the stack, checked to give the same greedy text and
    finish as one engine alone; of those that decoded past token 0, the prompt and its
    ``RequestFinished``."""
    from tests.support.stack import wait_until

    for prompt, expected in zip(references["prompts"], references["outputs"], strict=True):
        response = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        choice = response.choices[0]
        assert choice.text == tokenizer.decode(expected["tokens"]), f"prompt of {len(prompt)} tokens"
        assert choice.finish_reason == expected["finish_reason"]
        if len(expected["tokens"]) < 2:
            continue  # ended at token 0: nothing was handed to decode
        assert wait_until(lambda r=response: r.id in bus.finished(), 5), "no RequestFinished"
        yield prompt, bus.finished()[response.id]


def assert_loaded(prompt: list[int], finished: Any) -> None:
    """The decode engine loaded every whole block of the prompt it was handed."""
    assert finished.kv_expected_tokens == len(prompt) // BLOCK * BLOCK  # of prompt + token 0
    assert finished.kv_loaded_tokens == finished.kv_expected_tokens, "the decode engine recomputed"


def assert_greedy_matches_reference(client, bus: BusWatch, tokenizer, references: dict) -> None:
    """Every reference prompt through the stack: the same greedy text and finish as one
    engine alone, and the decode engine loaded every whole block it was handed."""
    for prompt, finished in greedy_decodes(client, bus, tokenizer, references):
        assert_loaded(prompt, finished)
