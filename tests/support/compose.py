"""Reading a compose file the way its tests need: each Switchyard `command` resolved by the
real CLI and settings (a rejected one fails the test, it does not exit), and the plain facts
of a service (dependencies, published ports, mounts, networks).
Both compose files' tests read them through here (tests/unit/test_compose.py,
tests/unit/test_compose_regions.py).
"""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from switchyard import cli, settings


def load(path: Path) -> dict:
    with path.open(encoding="utf-8") as f:
        return yaml.safe_load(f)


def is_switchyard(svc: dict) -> bool:
    command = svc.get("command")
    return isinstance(command, list) and command[:1] == ["switchyard"]


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
        defaults = settings.engine_defaults(*settings.engine_hints(tree, sources, args.command))
        return Parsed(args.command, settings.resolve(tree, sources, args.command, defaults=defaults).config)
    except SystemExit as exc:
        pytest.fail(f"switchyard rejects {command!r} (exit {exc.code}): {stderr.getvalue().strip()}")
    except settings.ConfigError as exc:
        pytest.fail(f"switchyard rejects {command!r}: {exc}")


def parse_args(command: list[str]) -> Any:
    """The argparse namespace of a command that has no settings tree (nats-config, nats-auth)."""
    assert command[:1] == ["switchyard"], command
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            return cli.build_parser().parse_args(command[1:])
    except SystemExit as exc:
        pytest.fail(f"switchyard rejects {command!r} (exit {exc.code}): {stderr.getvalue().strip()}")


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


def mounts(svc: dict) -> dict[str, str]:
    """Container path -> the volume's name or host path mounted there (short or long syntax)."""
    found = {}
    for entry in svc.get("volumes", []):
        if isinstance(entry, dict):
            found[str(entry["target"])] = str(entry.get("source", ""))
        else:
            source, target = str(entry).split(":")[:2]
            found[target] = source
    return found


def in_volume(svc: dict, container_path: str) -> tuple[str, str]:
    """(volume, path inside it) of a file the service sees at ``container_path``; the deepest
    mount wins, as in the container. Fails the test if nothing is mounted there."""
    for target, source in sorted(mounts(svc).items(), key=lambda m: -len(m[0])):
        if container_path == target or container_path.startswith(target.rstrip("/") + "/"):
            return source, str(Path(container_path).relative_to(target))
    pytest.fail(f"nothing is mounted at {container_path}: {svc.get('volumes')}")


def networks(svc: dict) -> set[str]:
    """The networks a service joins; compose's `default` when it names none."""
    if svc.get("network_mode") is not None:
        return set()
    named = svc.get("networks", ["default"])
    return set(named)


def flag_value(command: list[str], flag: str) -> str:
    """The value of a ``--flag=value`` argument (Mooncake's commands take that form)."""
    return next(a.split("=", 1)[1] for a in command if a.startswith(flag + "="))
