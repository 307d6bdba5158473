"""N regions on this machine, joined as a NATS supercluster through emulated WAN relays.

Usage (a test gets each region's client URL, and may kill and restart a region)::

    from tests.support.regions import local_supercluster

    with local_supercluster(["us", "eu", "ap"], tmp_path, rtt="us-eu=30,us-ap=70,eu-ap=140") as sc:
        us = await nats.connect(sc.url("us"))      # lands in region us's account
        ...
        sc.kill("ap")                                # SIGKILL ap's nats-server and relay
        sc.wait_ready(["us", "eu"])                  # the survivors' gateways and JetStream leader
        sc.start("ap")                               # same ports, same JetStream store
        sc.wait_ready()

Each region is two child processes, its nats-server and its ``switchyard wan-relay`` (the
address the other regions dial), laid out by ``switchyard.wan.local_regions``: the configs
are ``folder/<region>.conf``, each JetStream store ``folder/<region>/``, each server's output
``folder/<region>.log``. Entering waits until every region's gateways are connected both ways
to every other, and JetStream has a meta leader. Exiting stops everything.

``sc.regions[name]`` is the ``LocalRegion`` (its spec holds every port, e.g. the leafnode
port for a leaf node's ``--hub``).
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path

from switchyard import procs
from switchyard.wan import LocalRegion, RttTable, local_regions, not_ready

READY_TIMEOUT_S = 30.0


class Supercluster:
    """The running regions: each one's URL, and kill/start by region."""

    def __init__(self, regions: Sequence[LocalRegion], folder: Path) -> None:
        self.regions = {r.name: r for r in regions}
        self.folder = folder
        self._running: dict[str, list[subprocess.Popen]] = {}
        self._logs = ExitStack()

    @property
    def names(self) -> list[str]:
        return list(self.regions)

    def url(self, region: str) -> str:
        return self.regions[region].client_url

    def start(self, region: str) -> None:
        """Start the region's nats-server and relay (again: same ports, same store); returns
        once both listen. Call ``wait_ready`` before relying on the gateways."""
        self._spawn(region)
        self._wait_listening(region)

    def _spawn(self, region: str) -> None:
        if region in self._running:
            raise RuntimeError(f"region {region} is running")
        local = self.regions[region]
        log = self._logs.enter_context(open(self.folder / f"{region}.log", "ab"))
        env = procs.child_env()
        started = [procs.spawn(local.nats_command, stdout=log), procs.spawn(local.relay_command, env=env, stdout=log)]
        self._running[region] = started

    def _wait_listening(self, region: str) -> None:
        spec, (server, relay) = self.regions[region].spec, self._running[region]
        procs.wait_for_port(spec.host, spec.client_port, 15.0, server)
        procs.wait_for_port(spec.host, spec.gateway.port, 15.0, relay)

    def kill(self, region: str) -> None:
        """SIGKILL the region's processes (a region lost, not stopped)."""
        if region not in self._running:
            raise RuntimeError(f"region {region} is not running")
        for proc in self._running.pop(region):
            proc.kill()
            proc.wait()

    def stop(self) -> None:
        for region in list(self._running):
            procs.stop(self._running.pop(region))
        self._logs.close()

    def wait_ready(self, regions: Iterable[str] | None = None, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Until each of ``regions`` (default: every running one) has its gateways connected
        both ways to each of the others, and sees a JetStream meta leader."""
        names = list(self._running if regions is None else regions)
        deadline = time.monotonic() + timeout_s
        while (missing := self._not_ready(names)) and time.monotonic() < deadline:
            time.sleep(0.05)
        if missing:
            raise procs.ProcessError(f"regions not ready within {timeout_s} s: {missing}")

    def _not_ready(self, names: Sequence[str]) -> str:
        return not_ready([self.regions[name] for name in names])


@contextmanager
def local_supercluster(names: Sequence[str], folder: Path, rtt: RttTable | str = "") -> Iterator[Supercluster]:
    """Regions ``names`` running on loopback, ready (see the module's docstring)."""
    folder.mkdir(parents=True, exist_ok=True)
    cluster = Supercluster(local_regions(names, folder, rtt), folder)
    try:
        for name in names:  # every child first: they start side by side
            cluster._spawn(name)
        for name in names:
            cluster._wait_listening(name)
        cluster.wait_ready()
        yield cluster
    finally:
        cluster.stop()
