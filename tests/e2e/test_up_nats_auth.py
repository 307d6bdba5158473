"""``switchyard up`` with NATS permissions on, as it always runs its private server: the
stack serves as before, each service as its own NATS user; no password is on a command
line, in a child's environment or in the log; and the users' rights hold against a
process holding a worker's credentials, or none."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import anyio
import nats
import openai
import psutil
import pytest

from switchyard import procs
from switchyard.observability import BusStats, NatsClientConfig, connect, settle
from switchyard.schemas import subjects
from tests.support.up_nats import auth_dir


@dataclass
class Up:
    port: int
    process: psutil.Popen
    log: Path

    def children(self) -> list[psutil.Process]:
        return self.process.children(recursive=True)

    def nats_cmdline(self) -> list[str]:
        return next(p.cmdline() for p in self.children() if "nats-server" in p.cmdline()[0])

    def nats_url(self) -> str:
        cmdline = self.nats_cmdline()
        return f"nats://127.0.0.1:{cmdline[cmdline.index('-p') + 1]}"


@pytest.fixture(scope="module")
def up(tmp_path_factory) -> Iterator[Up]:
    port = procs.free_port()
    log = tmp_path_factory.mktemp("up") / "up.log"
    command = procs.service_command("up", "--port", str(port), "--log-level", "info", "--report-interval-s", "0.2")
    with log.open("w") as out:
        process = psutil.Popen(command, env=procs.child_env(), stdout=out, stderr=out, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while "is ready" not in log.read_text():
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        yield Up(port, process, log)
    finally:
        process.terminate()
        process.wait(30)


def _passwords(up: Up) -> list[str]:
    found = [f.read_text() for f in auth_dir(up.nats_cmdline()).glob("*.json")]
    assert len(found) >= 5  # scheduler, ingress, admin, a prefill and a decode worker
    return [text.split('"password": "')[1].split('"')[0] for text in found]


def test_the_stack_serves_with_every_service_as_its_own_user(up: Up):
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{up.port}/v1", api_key="unused", max_retries=0, timeout=10)
    stream = client.chat.completions.create(
        model="switchyard-sim", max_tokens=5, stream=True, messages=[{"role": "user", "content": "hi"}]
    )
    assert sum(1 for chunk in stream if chunk.choices and chunk.choices[0].delta.content) >= 1
    log = up.log.read_text()
    assert "NATS refused" not in log and "permissions violation" not in log.lower(), log


def test_no_password_on_a_command_line_in_an_environment_or_in_the_log(up: Up):
    passwords = _passwords(up)
    for proc in [up.process, *up.children()]:
        seen = " ".join(proc.cmdline()) + " ".join(proc.environ().values())
        assert not [p for p in passwords if p in seen], proc.cmdline()
    assert "admin credentials" in up.log.read_text()  # the ready line says where, not what
    assert not [p for p in passwords if p in up.log.read_text()]


def test_a_workers_credentials_cannot_publish_a_task_nor_an_outsider_connect(up: Up):
    worker = sorted(auth_dir(up.nats_cmdline()).glob("worker-prefill-*.json"))[0]

    async def forge() -> int:
        stats = BusStats()
        async with connect(up.nats_url(), "forger", stats, NatsClientConfig(credentials_file=str(worker))) as nc:
            await nc.publish(subjects.worker_tasks("decode-0"), b"forged")
            await nc.publish(subjects.CANCEL, b"forged")
            with anyio.fail_after(5):
                while stats.denied < 2:
                    await settle(nc)
                    await anyio.sleep(0.01)
        return stats.denied

    assert anyio.run(forge) == 2

    async def outsider() -> None:
        await nats.connect(up.nats_url(), allow_reconnect=False, connect_timeout=2)

    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        anyio.run(outsider)
