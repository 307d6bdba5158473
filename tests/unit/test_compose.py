"""compose.yaml against the real CLI: every Switchyard service's command must parse, and the wiring holds."""

from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from switchyard import cli, settings
from tests.support.compose import depends_on, parse_command, published_ports

COMPOSE = Path(__file__).resolve().parents[2] / "compose.yaml"
NATS_SERVICE = "nats"
GPU_WORKERS = ("prefill", "decode")


@pytest.fixture(scope="module")
def compose() -> dict:
    with COMPOSE.open(encoding="utf-8") as f:
        return yaml.safe_load(f)


@pytest.fixture(scope="module")
def services(compose: dict) -> dict[str, dict]:
    return compose["services"]


SETUP_COMMANDS = {"nats-auth"}  # one-shot: they write files, they serve nothing


def switchyard_services(services: dict[str, dict]) -> dict[str, list[str]]:
    return {
        name: svc["command"]
        for name, svc in services.items()
        if isinstance(svc.get("command"), list)
        and svc["command"][:1] == ["switchyard"]
        and svc["command"][1] not in SETUP_COMMANDS
    }


def test_there_are_switchyard_services(services):
    commands = switchyard_services(services)
    assert {"scheduler", "ingress", *GPU_WORKERS} <= commands.keys()


def test_every_switchyard_command_parses_and_points_at_nats(services):
    for name, command in switchyard_services(services).items():
        nats = parse_command(command).config.nats_url
        url = urlsplit(nats)
        assert url.scheme == "nats", f"{name}: --nats {nats!r}"
        assert url.hostname == NATS_SERVICE, f"{name}: --nats {nats!r} is not the {NATS_SERVICE} service"
        assert (url.port or 4222) == 4222, f"{name}: --nats {nats!r}"
        assert NATS_SERVICE in depends_on(services[name]), f"{name} does not depend on {NATS_SERVICE}"


def test_workers_have_the_roles_they_are_named_for(services):
    for name in GPU_WORKERS:
        parsed = parse_command(services[name]["command"])
        assert (parsed.command, parsed.config.role) == ("worker", name)


def test_vllm_workers_and_ingress_agree_and_reach_the_mooncake_store(services):
    ingress = parse_command(services["ingress"]["command"]).config
    assert ingress.key_scheme == "vllm-sha256-cbor"
    master = services["mooncake-master"]["command"]
    rpc = next(a.split("=", 1)[1] for a in master if a.startswith("--rpc_port="))
    http = next(a.split("=", 1)[1] for a in master if a.startswith("--http_metadata_server_port="))
    segment = services["mooncake-segment"]["command"]
    assert f"--master_server_address=mooncake-master:{rpc}" in segment
    for name in GPU_WORKERS:
        worker = parse_command(services[name]["command"]).config
        assert worker.engine == "vllm" and worker.block_size == worker.vllm.block_size == ingress.block_size
        assert worker.vllm.mooncake.master == f"mooncake-master:{rpc}"
        assert worker.vllm.mooncake.metadata_server == f"http://mooncake-master:{http}/metadata"
        assert "mooncake-segment" in depends_on(services[name])


def test_nats_runs_jetstream_with_a_volume(services):
    nats = services[NATS_SERVICE]
    assert nats["image"].startswith("nats:2.10")
    assert nats["command"][:5] == ["-js", "-sd", "/data", "-m", "8222"]
    assert any(
        str(v).split(":")[1:2] == ["/data"] if isinstance(v, str) else v.get("target") == "/data"
        for v in nats.get("volumes", [])
    ), "no volume at /data"


@pytest.mark.parametrize("name", GPU_WORKERS)
def test_gpu_workers_reserve_a_gpu(services, name):
    devices = services[name]["deploy"]["resources"]["reservations"]["devices"]
    assert any("gpu" in d.get("capabilities", []) and (d.get("count") == 1 or d.get("device_ids")) for d in devices), (
        devices
    )
    assert all(d.get("driver", "nvidia") == "nvidia" for d in devices), devices


def test_ingress_publishes_its_port(services):
    svc = services["ingress"]
    parsed = parse_command(svc["command"])
    assert parsed.command == "ingress"
    args = parsed.config
    assert args.host == "0.0.0.0", "ingress must listen on all interfaces inside the container"
    assert args.port in [target for _, target in published_ports(svc)], (args.port, svc.get("ports"))


def test_every_dependency_exists(services):
    for name, svc in services.items():
        for dep in depends_on(svc):
            assert dep in services, f"{name} depends on unknown service {dep!r}"


def test_the_switchyard_image_is_built(services):
    names = switchyard_services(services)
    images = {services[n].get("image") for n in names}
    assert len(images) == 1, f"Switchyard services use several images: {images}"
    assert any("build" in services[n] for n in names), "nothing builds the image"


@pytest.mark.parametrize(
    "bad",
    [
        ["switchyard", "worker", "--role", "nonsense"],
        ["switchyard", "worker", "--engine", "sim"],  # --role is required
        ["switchyard", "ingress", "--no-such-flag"],
        ["switchyard", "ingress", "--port", "70000"],
        ["switchyard", "worker", "--role", "decode", "--engine", "vllm", "--block-size", "20"],
        ["switchyard", "nonsense"],
    ],
)
def test_a_bad_command_is_rejected(bad):
    with pytest.raises(pytest.fail.Exception, match="switchyard rejects"):
        parse_command(bad)


# --- what an operator sees: Prometheus, Grafana, the trace collector ----------------------------

ROOT = COMPOSE.parent


def mounts(svc: dict) -> dict[str, str]:
    """Container path -> what is mounted there (a path in this repository, or a volume's name)."""
    found = {}
    for entry in svc.get("volumes", []):
        if isinstance(entry, dict):
            source, target = str(entry.get("source", "")), str(entry["target"])
        else:
            source, target = str(entry).split(":")[:2]
        found[target] = str((ROOT / source).resolve()) if source.startswith(".") else source
    return found


def mounted_file(svc: dict, container_path: str) -> Path:
    """The repository file a service sees at ``container_path`` (mounted itself or in a folder;
    the deepest mount wins, as in the container)."""
    for target, source in sorted(mounts(svc).items(), key=lambda m: -len(m[0])):
        if container_path == target or container_path.startswith(target.rstrip("/") + "/"):
            path = Path(source) / Path(container_path).relative_to(target)
            assert path.is_relative_to(ROOT), f"{container_path} is mounted from {source}, not from this repository"
            assert path.exists(), f"{container_path} is mounted from {path}, which does not exist"
            return path
    pytest.fail(f"nothing is mounted at {container_path}: {svc.get('volumes')}")


def flag_value(command: list[str], flag: str) -> str:
    return next(a.split("=", 1)[1] for a in command if a.startswith(flag + "="))


def load_yaml(path: Path) -> dict:
    with path.open(encoding="utf-8") as f:
        return yaml.safe_load(f)


@pytest.fixture(scope="module")
def prometheus(services: dict[str, dict]) -> dict:
    svc = services["prometheus"]
    return load_yaml(mounted_file(svc, flag_value(svc["command"], "--config.file")))


def scrape_targets(prometheus: dict) -> dict[str, set[tuple[str, int]]]:
    """Job -> (host, port) it scrapes at /metrics, from static targets or DNS names."""
    jobs: dict[str, set[tuple[str, int]]] = {}
    for job in prometheus["scrape_configs"]:
        assert job.get("metrics_path", "/metrics") == "/metrics", job
        targets = jobs.setdefault(job["job_name"], set())
        for static in job.get("static_configs", []):
            for target in static["targets"]:
                host, port = target.rsplit(":", 1)
                targets.add((host, int(port)))
        for dns in job.get("dns_sd_configs", []):
            assert dns.get("type", "SRV") == "A", "compose's DNS answers A records"
            targets |= {(name, int(dns["port"])) for name in dns["names"]}
    return jobs


def test_prometheus_scrapes_the_ingress_port(services, prometheus):
    ingress = parse_command(services["ingress"]["command"]).config
    scraped = set().union(*scrape_targets(prometheus).values())
    assert ("ingress", ingress.port) in scraped, scraped


def test_prometheus_scrapes_mooncake_and_nats(services, prometheus):
    scraped = set().union(*scrape_targets(prometheus).values())
    master = int(flag_value(services["mooncake-master"]["command"], "--metrics_port"))
    assert ("mooncake-master", master) in scraped, scraped
    exporter = services["nats-exporter"]
    monitor = services[NATS_SERVICE]["command"]
    assert f"http://{NATS_SERVICE}:{monitor[monitor.index('-m') + 1]}" in exporter["command"]
    assert ("nats-exporter", 7777) in scraped, scraped  # the exporter's default port


def test_every_scrape_target_is_a_service(services, prometheus):
    for job, targets in scrape_targets(prometheus).items():
        for host, _ in targets:
            assert host in services or (host, job) == ("localhost", "prometheus"), (job, host)


@pytest.fixture(scope="module")
def grafana(services: dict[str, dict]) -> dict:
    return services["grafana"]


def test_grafana_provisions_its_datasources_and_the_dashboard(services, grafana):
    provisioning = mounted_file(grafana, "/etc/grafana/provisioning")
    datasources = [
        ds for f in sorted((provisioning / "datasources").glob("*.yaml")) for ds in load_yaml(f)["datasources"]
    ]
    prometheus = next(ds for ds in datasources if ds["type"] == "prometheus")
    url = urlsplit(prometheus["url"])
    assert url.hostname == "prometheus" and "prometheus" in services, prometheus
    assert url.port == 9090 and "--config.file=/etc/prometheus/prometheus.yml" in services["prometheus"]["command"]
    for ds in datasources:
        assert urlsplit(ds["url"]).hostname in services, ds
    providers = [p for f in sorted((provisioning / "dashboards").glob("*.yaml")) for p in load_yaml(f)["providers"]]
    dashboards = [d for p in providers for d in mounted_file(grafana, p["options"]["path"]).glob("*.json")]
    assert {d.name for d in dashboards} == {"switchyard.json"}, dashboards
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert mounted_file(grafana, home) == dashboards[0]


def test_every_dashboard_panel_names_a_provisioned_datasource(grafana):
    provisioning = mounted_file(grafana, "/etc/grafana/provisioning")
    uids = {ds["uid"] for f in (provisioning / "datasources").glob("*.yaml") for ds in load_yaml(f)["datasources"]}
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "dashboards" / "switchyard.json").read_text())
    # A panel names a provisioned uid, or a data source variable whose default is one.
    variables = {
        f"${{{v['name']}}}": v["current"]["value"] for v in dashboard["templating"]["list"] if v["type"] == "datasource"
    }
    queried = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert queried
    for panel in queried:
        refs = [panel["datasource"], *(t["datasource"] for t in panel["targets"])]
        assert all(variables.get(ref["uid"], ref["uid"]) in uids for ref in refs), (panel["title"], refs, uids)


def test_every_switchyard_service_sends_its_traces_to_the_collector(services):
    collector = services["otel-collector"]
    config = load_yaml(mounted_file(collector, flag_value(collector["command"], "--config")))
    receiver = config["receivers"]["otlp"]["protocols"]["http"]["endpoint"]
    assert receiver.startswith("0.0.0.0:"), "the collector must listen beyond its own container"
    assert "otlp" in config["service"]["pipelines"]["traces"]["receivers"]
    for name, command in switchyard_services(services).items():
        env = {k: str(v) for k, v in services[name].get("environment", {}).items()}
        args = cli.build_parser().parse_args(command[1:])
        process = settings.resolve(settings.ProcessConfig, cli.sources_of(args, env=env), args.command).config
        assert process.trace_exporter == "otlp", name
        endpoint = urlsplit(env.get("OTEL_EXPORTER_OTLP_ENDPOINT", ""))
        assert (endpoint.scheme, endpoint.hostname) == ("http", "otel-collector"), (name, endpoint)
        assert str(endpoint.port) == receiver.rsplit(":", 1)[1], (name, endpoint, receiver)


def test_the_image_has_the_otlp_exporter():
    # --trace-exporter otlp fails at start without the `otlp` extra (observability/tracing.py).
    dockerfile = (ROOT / "Dockerfile").read_text(encoding="utf-8")
    install = next(line for line in dockerfile.splitlines() if "pip install" in line and "'.[" in line)
    extras = install.split("'.[", 1)[1].split("]", 1)[0].split(",")
    assert "otlp" in extras, install


def test_the_operator_pages_listen_on_loopback_only(services):
    for name in ("prometheus", "grafana", "jaeger"):
        for entry in services[name].get("ports", []):
            assert str(entry).startswith("127.0.0.1:"), (name, entry)


def _mounts(svc: dict) -> dict[str, str]:
    """container path -> volume or host path (short syntax)."""
    return {str(v).split(":")[1]: str(v).split(":")[0] for v in svc.get("volumes", []) if isinstance(v, str)}


def test_every_role_connects_as_its_own_nats_user(services):
    """The users `switchyard nats-auth` writes into the volume are the ones nats-server loads
    and each service names: a worker's by its --worker-id."""
    auth = services["nats-auth"]
    args = cli.build_parser().parse_args(auth["command"][1:])
    out, workers = str(args.out), args.workers.split(",")
    assert args.keep and _mounts(auth)[out] == "nats-auth"
    nats = services[NATS_SERVICE]
    conf = nats["command"][nats["command"].index("-c") + 1]
    assert _mounts(nats)[str(Path(conf).parent)] == "nats-auth" and Path(conf).name == "nats-auth.conf"
    assert nats["depends_on"]["nats-auth"]["condition"] == "service_completed_successfully"
    users = {"scheduler", "ingress", "batch-runner", *(f"worker-{w}" for w in workers)}
    named = set()
    for name, command in switchyard_services(services).items():
        config = parse_command(command).config
        path = Path(config.nats_client.credentials_file)
        assert _mounts(services[name]).get(str(path.parent)) == "nats-auth", f"{name}: {path} is not in the volume"
        user = path.stem
        if parse_command(command).command == "worker":
            assert user == f"worker-{config.worker_id}", f"{name}: its id and its user differ"
        named.add(user)
    assert named <= users, f"users nats-auth does not write: {named - users}"
