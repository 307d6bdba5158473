"""compose.yaml against the real CLI: every Switchyard service's command must parse, and the wiring holds."""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from switchyard import cli, settings

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


def switchyard_services(services: dict[str, dict]) -> dict[str, list[str]]:
    return {
        name: svc["command"]
        for name, svc in services.items()
        if isinstance(svc.get("command"), list) and svc["command"][:1] == ["switchyard"]
    }


@dataclass(frozen=True)
class Parsed:
    command: str
    config: Any  # the service's config tree, every setting checked


def parse_command(command: list[str]) -> Parsed:
    """Resolve a compose `command` with the real CLI and settings; fail the test (not exit) if it is rejected.
    The environment is not read and the model directory (inside the image) is not opened."""
    assert isinstance(command, list) and all(isinstance(a, str) for a in command), command
    assert command[:1] == ["switchyard"], command
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            args = cli.build_parser().parse_args(command[1:])
        tree = settings.COMMAND_TREES[args.command][1]
        sources = cli.sources_of(args, env={})
        defaults = settings.engine_defaults(*cli._engine_hints(tree, sources, args.command))
        return Parsed(args.command, settings.resolve(tree, sources, args.command, defaults=defaults).config)
    except SystemExit as exc:
        pytest.fail(f"switchyard rejects {command!r} (exit {exc.code}): {stderr.getvalue().strip()}")
    except settings.ConfigError as exc:
        pytest.fail(f"switchyard rejects {command!r}: {exc}")


def depends_on(svc: dict) -> list[str]:
    deps = svc.get("depends_on", [])
    return list(deps) if isinstance(deps, (list, dict)) else []


def published_ports(svc: dict) -> list[tuple[int, int]]:
    """(host port, container port) pairs from short ("8000:8000", "127.0.0.1:8000:8000") or long syntax."""
    pairs = []
    for entry in svc.get("ports", []):
        if isinstance(entry, dict):
            target = int(entry["target"])
            pairs.append((int(entry.get("published", target)), target))
        else:
            parts = str(entry).split("/")[0].split(":")
            target = int(parts[-1])
            pairs.append((int(parts[-2]) if len(parts) > 1 else target, target))
    return pairs


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
    assert nats["command"] == ["-js", "-sd", "/data", "-m", "8222"]
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
