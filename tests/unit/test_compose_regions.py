"""compose.regions.yaml against the real CLI and nats-server: two regions joined by their NATS
gateways, every service in the region of the NATS server it connects to, and nothing else
shared between the regions (KV blocks stay in their region's Mooncake Store).

A service's region is found through the files, not the names: the nats-server it names in
--nats loads a config (-c) from a volume, and the one-shot `nats-config` service that writes
that file says which region it is (--region)."""

from __future__ import annotations

import argparse
import copy
import functools
import subprocess
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from switchyard import cli, nats_config, procs
from tests.support import compose

COMPOSE = Path(__file__).resolve().parents[2] / "compose.regions.yaml"
REGIONS = {"us", "eu"}
INGRESS_PORTS = {"us": 8000, "eu": 8001}  # as `switchyard up --regions`: 8000 + the region's position
SETUP_COMMANDS = {"nats-config"}  # one-shot: they write files, they serve nothing
ROLES = {"scheduler", "ingress", "prefill", "decode"}


@pytest.fixture(scope="module")
def services() -> dict[str, dict]:
    return compose.load(COMPOSE)["services"]


@dataclass(frozen=True)
class NatsServer:
    region: str  # "" when no nats-config service writes the file it loads
    config: str  # the -c path inside its container


def config_writers(services: dict[str, dict]) -> dict[str, argparse.Namespace]:
    """The `switchyard nats-config` services, by name: their parsed arguments."""
    return {
        name: compose.parse_args(svc["command"])
        for name, svc in services.items()
        if compose.is_switchyard(svc) and svc["command"][1] == "nats-config"
    }


def nats_servers(services: dict[str, dict]) -> dict[str, NatsServer]:
    """Every nats-server service and the region whose config it loads."""
    written = {
        compose.in_volume(services[name], str(args.out)): args.region for name, args in config_writers(services).items()
    }
    found = {}
    for name, svc in services.items():
        if str(svc.get("image", "")).startswith("nats:"):
            conf = svc["command"][svc["command"].index("-c") + 1]
            found[name] = NatsServer(written.get(compose.in_volume(svc, conf), ""), conf)
    return found


@functools.cache
def _parse(command: tuple[str, ...]) -> compose.Parsed:
    return compose.parse_command(list(command))  # a frozen config: safe to share between tests


def serving(services: dict[str, dict]) -> dict[str, compose.Parsed]:
    return {
        name: _parse(tuple(svc["command"]))
        for name, svc in services.items()
        if compose.is_switchyard(svc) and svc["command"][1] not in SETUP_COMMANDS
    }


def regions_of(services: dict[str, dict]) -> dict[str, str]:
    """Switchyard service -> the region of the nats-server its --nats names ("" if none)."""
    servers = nats_servers(services)
    return {
        name: servers.get(urlsplit(p.config.nats_url).hostname or "", NatsServer("", "")).region
        for name, p in serving(services).items()
    }


def role(parsed: compose.Parsed) -> str:
    return parsed.config.role if parsed.command == "worker" else parsed.command


def region_mismatches(services: dict[str, dict]) -> list[str]:
    """What is wrong with each Switchyard service's region: a --nats that is no region's
    server, or a --region that is not its server's."""
    problems = []
    servers, regions = nats_servers(services), regions_of(services)
    for name, parsed in serving(services).items():
        host = urlsplit(parsed.config.nats_url).hostname or ""
        if not regions[name]:
            problems.append(f"{name}: --nats {parsed.config.nats_url} is no region's nats-server")
        elif parsed.command in ("scheduler", "ingress") and parsed.config.region != regions[name]:
            problems.append(f"{name}: --region {parsed.config.region!r}, its NATS server {host} is {regions[name]!r}")
        elif host not in compose.depends_on(services[name]) or host not in servers:
            problems.append(f"{name} does not wait for {host}")
    return problems


# --- regions ------------------------------------------------------------------------------------


def test_each_nats_server_loads_the_config_of_one_region(services):
    servers = nats_servers(services)
    assert sorted(s.region for s in servers.values()) == sorted(REGIONS), servers
    for name, server in servers.items():
        assert services[name]["image"].startswith("nats:2.10"), name
        assert f"nats-config-{server.region}" in compose.depends_on(services[name])
        writer = services[name]["depends_on"][f"nats-config-{server.region}"]
        assert writer["condition"] == "service_completed_successfully", name


def test_every_service_is_in_the_region_of_its_nats_server(services):
    assert region_mismatches(services) == []


def test_a_service_with_the_other_regions_name_is_caught(services):
    swapped = copy.deepcopy(services)
    command = swapped["ingress-eu"]["command"]
    command[command.index("--region") + 1] = "us"
    assert region_mismatches(swapped) == ["ingress-eu: --region 'us', its NATS server nats-eu is 'eu'"]


def test_each_region_has_a_scheduler_an_ingress_and_both_worker_pools(services):
    regions = regions_of(services)
    for region in REGIONS:
        roles = [role(p) for name, p in serving(services).items() if regions[name] == region]
        assert set(roles) >= ROLES, (region, roles)
        assert Counter(roles)["scheduler"] == 1, (region, roles)


def test_the_regions_share_only_the_gateway_network(services):
    """A region's workers cannot reach the other's Mooncake Store: only the NATS servers meet."""
    regions, servers = regions_of(services), nats_servers(services)
    on: dict[str, set[str]] = {r: set() for r in REGIONS}  # region -> its networks
    for name, region in regions.items():
        on[region] |= compose.networks(services[name])
    assert not on["us"] & on["eu"], on
    shared = {n for svc in services.values() for n in compose.networks(svc)} - on["us"] - on["eu"]
    for name, svc in services.items():
        if compose.networks(svc) & shared:
            assert name in servers, f"{name} is on {compose.networks(svc) & shared}, the gateways' network"
        in_regions = [r for r in REGIONS if compose.networks(svc) & on[r]]
        assert len(in_regions) <= 1, f"{name} is in {in_regions}"
    for name, server in servers.items():
        assert compose.networks(services[name]) & on[server.region] and compose.networks(services[name]) & shared


def test_vllm_workers_and_ingress_agree_and_reach_their_regions_mooncake_store(services):
    regions = regions_of(services)
    for region in REGIONS:
        here = {name: p for name, p in serving(services).items() if regions[name] == region}
        (ingress,) = (p.config for p in here.values() if p.command == "ingress")
        master = services[f"mooncake-master-{region}"]["command"]
        rpc = compose.flag_value(master, "--rpc_port")
        http = compose.flag_value(master, "--http_metadata_server_port")
        segment = f"mooncake-segment-{region}"
        assert f"--master_server_address=mooncake-master-{region}:{rpc}" in services[segment]["command"]
        for name, parsed in here.items():
            if parsed.command != "worker":
                continue
            worker = parsed.config
            assert worker.engine == "vllm" and worker.block_size == worker.vllm.block_size == ingress.block_size
            assert worker.vllm.mooncake.master == f"mooncake-master-{region}:{rpc}", name
            assert worker.vllm.mooncake.metadata_server == f"http://mooncake-master-{region}:{http}/metadata", name
            assert segment in compose.depends_on(services[name]), name
            assert worker.worker_id == f"{worker.role}-{region}", name  # ids unique across the supercluster


def test_workers_pin_distinct_gpus(services):
    """device_ids, not `count: 1`: Docker gives each `count: 1` container the first GPU."""
    pinned = []
    for name, parsed in serving(services).items():
        if parsed.command != "worker":
            continue
        (device,) = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert device.get("driver") == "nvidia" and "gpu" in device["capabilities"], (name, device)
        assert "count" not in device and len(device["device_ids"]) == 1, (name, device)
        pinned += device["device_ids"]
    assert len(pinned) == 4 and len(set(pinned)) == len(pinned), pinned


def test_each_ingress_listens_on_its_own_published_port(services):
    regions = regions_of(services)
    for name, parsed in serving(services).items():
        if parsed.command == "ingress":
            assert parsed.config.host == "0.0.0.0", name
            assert (parsed.config.port, parsed.config.port) in compose.published_ports(services[name]), name
            assert parsed.config.port == INGRESS_PORTS[regions[name]], name
    host_ports = [host for svc in services.values() for host, _ in compose.published_ports(svc)]
    assert len(host_ports) == len(set(host_ports)), host_ports


def test_the_image_is_built_and_shared(services):
    switchyard = [svc for svc in services.values() if compose.is_switchyard(svc)]
    assert {svc.get("image") for svc in switchyard} == {"switchyard:latest"}
    assert any("build" in svc for svc in switchyard), "nothing builds the image"


def test_every_dependency_exists(services):
    for name, svc in services.items():
        for dep in compose.depends_on(svc):
            assert dep in services, f"{name} depends on unknown service {dep!r}"


# --- the NATS configs ----------------------------------------------------------------------------


def test_both_configs_come_from_one_list_whose_gateways_are_the_nats_services(services):
    writers = config_writers(services)
    lists = {args.regions for args in writers.values()}
    assert len(lists) == 1, f"the regions' configs come from different --regions lists: {lists}"
    (listed,) = lists
    assert sorted(args.region for args in writers.values()) == sorted(REGIONS)
    servers = nats_servers(services)
    for spec in nats_config.parse_regions(listed):
        server = servers.get(spec.gateway.host)
        assert server is not None and server.region == spec.name, f"{spec.name}'s gateway {spec.gateway} is not its"
        (args,) = (a for a in writers.values() if a.region == spec.name)
        assert (args.gateway_port or spec.gateway.port) == spec.gateway.port, "the gateway listens where it is dialed"


def test_services_connect_at_their_servers_client_port(services):
    writers = {args.region: args for args in config_writers(services).values()}
    regions = regions_of(services)
    for name, parsed in serving(services).items():
        args = writers[regions[name]]
        url = urlsplit(parsed.config.nats_url)
        assert url.scheme == "nats" and url.username is None, f"{name}: no credentials, the region's no_auth_user"
        assert (url.port or 4222) == (args.client_port or nats_config.DEFAULT_CLIENT_PORT), name


def test_each_nats_server_keeps_jetstream_on_its_volume_and_answers_its_healthcheck(services):
    writers = {args.region: args for args in config_writers(services).values()}
    for name, server in nats_servers(services).items():
        args, svc = writers[server.region], services[name]
        assert compose.mounts(svc)[args.store_dir] == f"nats-data-{server.region}", name
        assert f"http://127.0.0.1:{args.http_port}/healthz" in " ".join(svc["healthcheck"]["test"]), name


def test_the_generated_configs_pass_nats_server_t(services, tmp_path):
    """`switchyard nats-config` with the compose file's own arguments, then `nats-server -t`.
    The gateway hosts (nats-us, nats-eu) do not resolve here; -t does not resolve them
    (checked with nats-server 2.15.1, the wheel's, and 2.10.26, the image's line), so the
    files are checked as compose writes them."""
    for name, args in config_writers(services).items():
        command = services[name]["command"]
        out = tmp_path / Path(str(args.out)).name
        argv = command[1:]
        argv[argv.index("--out") + 1] = str(out)
        assert cli.main(argv) == 0, name
        text = out.read_text()
        assert f'no_auth_user: "{nats_config.region_user(args.region)}"' in text, name
        checked = subprocess.run(
            [str(procs.nats_server_binary()), "-t", "-c", str(out)], capture_output=True, text=True, timeout=30
        )
        assert checked.returncode == 0, f"{name}: {checked.stdout}{checked.stderr}"
