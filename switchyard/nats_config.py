"""nats-server configurations for regions joined as a supercluster (docs/federation.md).

Each region is one nats-server cluster (one server here), joined to the others by gateways,
with JetStream in cluster mode. Each region is also one NATS *account* (its name upper-cased),
and every server lists every region's account, identically: a client that connects without
credentials lands in its own region's account (``no_auth_user``), so every subject stays in
its region unless the accounts' exports and imports let it cross. Those are written from the
federation table of ``schemas.subjects``; a region exports:

- streams ``fed_root(R)`` (its summaries, session bindings) and ``every_stream()``;
- services ``FED_SERVICES`` (submit, cancel, ping);

and imports from every other region O: ``fed_root(O)``, ``region_streams(R)`` (what O's
workers stream to R's ingresses) and O's services under ``to_region(O, name)``. A region's
own subjects carry its name, so no import is ever exported again (nats-server refuses
cycles).

An edge ingress may join a region as a *leaf node*: a server without JetStream whose local
clients are bound, through the region's leafnode listener, to the region's account.

Everything here is pure text; ``write`` is the only I/O, ``load_toml`` reads one file.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from switchyard.schemas import subjects
from switchyard.settings import ConfigError

__all__ = [
    "Address",
    "ConfigError",
    "LeafSpec",
    "RegionSpec",
    "account",
    "add_arguments",
    "check_port",
    "check_region_name",
    "config_text",
    "leaf_user",
    "load_toml",
    "own",
    "parse_address",
    "parse_regions",
    "parse_table",
    "region_user",
    "render",
    "render_leaf",
    "run",
    "write",
]

# A NATS subject token and an account name both: no dots, wildcards or spaces, and short.
_REGION_NAME = re.compile(r"[a-z][a-z0-9-]{0,31}")
SYSTEM_ACCOUNT = "SYS"
DEFAULT_CLIENT_PORT = 4222
DEFAULT_CLUSTER_PORT = 6222
DEFAULT_LISTEN_HOST = "0.0.0.0"


@dataclass(frozen=True)
class Address:
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"nats://{self}"


@dataclass(frozen=True)
class RegionSpec:
    """One region's server. ``gateway`` is the address the other regions dial (the
    ``advertise`` address: a relay or a load balancer may stand before ``gateway_port``);
    only ``name`` and ``gateway`` matter for the other regions' configs."""

    name: str
    gateway: Address
    host: str = DEFAULT_LISTEN_HOST  # where this server listens (clients, cluster, gateway, leafnodes)
    client_port: int = DEFAULT_CLIENT_PORT
    gateway_port: int | None = None  # where the gateway listens; None: gateway.port
    cluster_port: int = DEFAULT_CLUSTER_PORT
    leafnode_port: int | None = None  # a leafnode listener for edge servers (render_leaf)
    http_port: int | None = None  # nats-server's monitoring endpoint (/varz, /gatewayz, /jsz)
    store_dir: str | None = None  # None: data/nats/<name>, relative to nats-server's folder

    def __post_init__(self) -> None:
        check_region_name(self.name)
        for what, port in (
            ("gateway", self.gateway.port),
            ("client", self.client_port),
            ("gateway listen", self.gateway_port),
            ("cluster", self.cluster_port),
            ("leafnode", self.leafnode_port),
            ("http", self.http_port),
        ):
            if port is not None:
                check_port(port, f"region {self.name}: {what} port")

    @property
    def listen_gateway_port(self) -> int:
        return self.gateway.port if self.gateway_port is None else self.gateway_port

    @property
    def store(self) -> str:
        return self.store_dir if self.store_dir is not None else f"data/nats/{self.name}"


@dataclass(frozen=True)
class LeafSpec:
    """An edge server: its local clients are ``region``'s clients, through ``hub`` (the
    region's leafnode listener). No JetStream: the region's is used."""

    region: str
    hub: Address
    host: str = DEFAULT_LISTEN_HOST
    client_port: int = DEFAULT_CLIENT_PORT
    server_name: str | None = None  # None: <region>-leaf-<client port>

    def __post_init__(self) -> None:
        check_region_name(self.region)
        check_port(self.hub.port, "--hub port")
        check_port(self.client_port, "leaf client port")


# --- names ------------------------------------------------------------------------------------


def check_region_name(name: str) -> str:
    if not _REGION_NAME.fullmatch(name):
        raise ConfigError(
            f"region name {name!r}: use lowercase letters, digits and '-', starting with a letter, at most 32"
        )
    return name


def check_port(port: object, what: str) -> int:
    if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
        raise ConfigError(f"{what}: {port!r} is not a port (1-65535)")
    return port


def account(region: str) -> str:
    """The region's NATS account."""
    return region.upper()


def region_user(region: str) -> str:
    """The account's user, the one clients without credentials become (``no_auth_user``)."""
    return region


def leaf_user(region: str) -> str:
    """The user a leaf node of ``region`` connects as: bound to the region's account."""
    return f"leaf-{region}"


# --- parsing -----------------------------------------------------------------------------------


def parse_address(text: str, what: str) -> Address:
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"{what}: {text!r} is not host:port")
    return Address(host.strip("[]"), check_port(int(port), what))


def parse_regions(text: str) -> list[RegionSpec]:
    """``us=host:port,eu=host:port,...``: each region's advertised gateway address."""
    regions = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        name, sep, address = item.partition("=")
        if not sep:
            raise ConfigError(f"--regions: {item!r} is not NAME=HOST:PORT")
        name = check_region_name(name.strip())
        regions.append(RegionSpec(name=name, gateway=parse_address(address, f"--regions {name}")))
    return _checked(regions, "--regions")


_TOML_KEYS = {
    "gateway": "gateway",
    "gateway-listen": "gateway_port",
    "client": "client_port",
    "cluster": "cluster_port",
    "leafnode": "leafnode_port",
    "http": "http_port",
    "store-dir": "store_dir",
    "host": "host",
}


def load_toml(path: Path) -> list[RegionSpec]:
    """One table per region::

    [us]
    gateway = "us.example.net:7222"   # the address the others dial (required)
    gateway-listen = 7222             # where the gateway listens (default: gateway's port)
    client = 4222
    cluster = 6222
    leafnode = 7422                   # optional: edge servers join here
    http = 8222                       # optional: monitoring
    store-dir = "/var/lib/nats/us"
    host = "0.0.0.0"                  # where this server listens
    """
    try:
        data = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"regions file {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"regions file {path}: {exc}") from None
    return parse_table(data, str(path))


def parse_table(data: Mapping[str, Any], source: str) -> list[RegionSpec]:
    regions = []
    for name, table in data.items():
        check_region_name(name)
        if not isinstance(table, dict):
            raise ConfigError(f"{source}: {name} must be a table ([{name}])")
        regions.append(_region_from_table(name, table, f"{source} [{name}]"))
    return _checked(regions, source)


def _region_from_table(name: str, table: Mapping[str, Any], where: str) -> RegionSpec:
    unknown = sorted(set(table) - set(_TOML_KEYS))
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r}; use {', '.join(_TOML_KEYS)}")
    if "gateway" not in table:
        raise ConfigError(f'{where}: gateway = "HOST:PORT" is required')
    fields: dict[str, Any] = {}
    for key, value in table.items():
        if key == "gateway":
            fields["gateway"] = parse_address(str(value), f"{where} gateway")
        elif key in ("store-dir", "host"):
            if not isinstance(value, str) or not value:
                raise ConfigError(f"{where} {key}: {value!r} is not a non-empty string")
            fields[_TOML_KEYS[key]] = value
        else:
            fields[_TOML_KEYS[key]] = check_port(value, f"{where} {key}")
    return RegionSpec(name=name, **fields)


def _checked(regions: list[RegionSpec], source: str) -> list[RegionSpec]:
    seen: set[str] = set()
    for region in regions:
        if region.name in seen:
            raise ConfigError(f"{source}: region {region.name} is given twice")
        seen.add(region.name)
    if not regions:
        raise ConfigError(f"{source}: no regions")
    return regions


def own(regions: Sequence[RegionSpec], name: str, source: str = "--regions", **overrides: Any) -> RegionSpec:
    """The spec of region ``name`` in ``regions``, with ``overrides`` (those not None)."""
    check_region_name(name)
    for region in regions:
        if region.name == name:
            return replace(region, **{k: v for k, v in overrides.items() if v is not None})
    raise ConfigError(f"{source}: region {name} (--region) is not in the list ({', '.join(r.name for r in regions)})")


# --- rendering ----------------------------------------------------------------------------------


def render(region: RegionSpec, regions: Sequence[RegionSpec]) -> str:
    """nats-server's configuration for ``region``'s server, in the supercluster of ``regions``
    (which must include it). Every server's accounts block is the same text."""
    names = [r.name for r in _checked(list(regions), "regions")]
    if region.name not in names:
        raise ConfigError(f"regions: region {region.name} is not in the list ({', '.join(names)})")
    q = json.dumps
    host = region.host
    lines = [
        f"# Written by switchyard nats-config: region {region.name} of {', '.join(names)} (docs/federation.md).",
        f"server_name: {q(region.name + '-0')}",
        f"listen: {q(f'{host}:{region.client_port}')}",
    ]
    if region.http_port is not None:
        lines.append(f"http: {q(f'{host}:{region.http_port}')}")
    lines += [
        f"jetstream {{ store_dir: {q(region.store)} }}",
        "",
        "# A one-server cluster: JetStream across gateways needs cluster mode, which needs a route",
        "# (to its own cluster port will do). More servers: add their routes here.",
        "cluster {",
        f"  name: {q(region.name)}",
        f"  listen: {q(f'{host}:{region.cluster_port}')}",
        f"  routes: [{q(f'nats://{_reachable(host)}:{region.cluster_port}')}]",
        "}",
        "",
        "# The others dial this region only at its advertised address (gossip spreads it).",
        "gateway {",
        f"  name: {q(region.name)}",
        f"  listen: {q(f'{host}:{region.listen_gateway_port}')}",
        f"  advertise: {q(str(region.gateway))}",
        "  gateways: [",
        *(f"    {{ name: {q(r.name)}, urls: [{q(r.gateway.url)}] }}" for r in regions),
        "  ]",
        "}",
    ]
    if region.leafnode_port is not None:
        lines += ["", *_leafnode_listener(region)]
    lines += ["", *accounts_block(names), "", f"no_auth_user: {q(region_user(region.name))}", ""]
    return "\n".join(lines)


def _reachable(host: str) -> str:
    """An address this server can dial itself at: a wildcard listen host is not one."""
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def _leafnode_listener(region: RegionSpec) -> list[str]:
    q = json.dumps
    return [
        "# Edge servers (switchyard nats-config --leaf-of): their clients join this region's account.",
        "leafnodes {",
        f"  listen: {q(f'{region.host}:{region.leafnode_port}')}",
        "  authorization {",
        f"    users: [ {{ user: {q(leaf_user(region.name))}, account: {q(account(region.name))} }} ]",
        "  }",
        "}",
    ]


def accounts_block(names: Sequence[str]) -> list[str]:
    """Every region's account with its exports and imports, and the system account."""
    q = json.dumps
    lines = ["accounts {", f"  {SYSTEM_ACCOUNT}: {{}}"]
    for name in names:
        others = [o for o in names if o != name]
        lines += [
            f"  {account(name)}: {{",
            "    jetstream: enabled",
            f"    users: [ {{ user: {q(region_user(name))} }} ]",
            "    exports: [",
            *(f"      {entry}" for entry in _exports(name)),
            "    ]",
            "    imports: [",
            *(f"      {entry}" for other in others for entry in _imports(name, other)),
            "    ]",
            "  }",
        ]
    return [*lines, "}", f"system_account: {SYSTEM_ACCOUNT}"]


def _exports(region: str) -> list[str]:
    q = json.dumps
    streams = [subjects.fed_root(region), subjects.every_stream()]
    return [f"{{ stream: {q(s)} }}" for s in streams] + [
        f"{{ service: {q(s)} }}" for s in subjects.FED_SERVICES.values()
    ]


def _imports(region: str, other: str) -> list[str]:
    """What ``region`` takes from ``other``."""
    q = json.dumps
    source = q(account(other))
    streams = [subjects.fed_root(other), subjects.region_streams(region)]
    return [f"{{ stream: {{ account: {source}, subject: {q(s)} }} }}" for s in streams] + [
        f"{{ service: {{ account: {source}, subject: {q(s)} }}, to: {q(subjects.to_region(other, name))} }}"
        for name, s in subjects.FED_SERVICES.items()
    ]


def render_leaf(leaf: LeafSpec) -> str:
    """An edge server of ``leaf.region``: no JetStream, no accounts of its own; its clients'
    account is bound to the region's through the hub's leafnode listener."""
    q = json.dumps
    name = leaf.server_name or f"{leaf.region}-leaf-{leaf.client_port}"
    remote = f"nats://{leaf_user(leaf.region)}@{leaf.hub}"
    return "\n".join(
        [
            f"# Written by switchyard nats-config: a leaf node of region {leaf.region} (docs/federation.md).",
            f"server_name: {q(name)}",
            f"listen: {q(f'{leaf.host}:{leaf.client_port}')}",
            "leafnodes {",
            f"  remotes: [ {{ url: {q(remote)} }} ]",
            "}",
            "",
        ]
    )


# --- files ------------------------------------------------------------------------------------


def write(path: Path, text: str) -> Path:
    """One configuration file (its folder created); no secret is in it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path


# --- switchyard nats-config ---------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Write one region's nats-server configuration: its one-server cluster, gateways to every other "
        "region, and one account per region whose exports and imports let only the federation subjects "
        "cross (docs/federation.md). Run it once per region with the same --regions (or --config); "
        "every file gets the same accounts. With --leaf-of, write an edge server's instead."
    )
    regions = parser.add_argument_group("a region's server")
    regions.add_argument("--region", metavar="NAME", help="the region this server is (one of --regions)")
    regions.add_argument(
        "--regions",
        metavar="NAME=HOST:PORT,...",
        help="every region and the gateway address the others dial it at (its advertise address), e.g. "
        "us=nats-us.example.net:7222,eu=nats-eu.example.net:7222",
    )
    regions.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help='a TOML file instead of --regions: one table per region ([us] gateway = "HOST:PORT", client, '
        "cluster, leafnode, http, gateway-listen, store-dir, host)",
    )
    for flag, meta, help_ in (
        ("--client-port", "PORT", f"this server's client port (default {DEFAULT_CLIENT_PORT})"),
        ("--cluster-port", "PORT", f"this server's cluster (route) port (default {DEFAULT_CLUSTER_PORT})"),
        ("--gateway-port", "PORT", "where this server's gateway listens (default: its --regions port)"),
        ("--leafnode-port", "PORT", "a leafnode listener for edge servers (--leaf-of); none by default"),
        ("--http-port", "PORT", "nats-server's monitoring endpoint (/gatewayz, /jsz); none by default"),
    ):
        regions.add_argument(flag, type=int, metavar=meta, help=help_)
    regions.add_argument("--store-dir", metavar="DIR", help="the JetStream store (default data/nats/<region>)")
    regions.add_argument("--host", metavar="HOST", help=f"where this server listens (default {DEFAULT_LISTEN_HOST})")
    leaf = parser.add_argument_group("an edge server (leaf node)")
    leaf.add_argument(
        "--leaf-of", metavar="REGION", help="write a leaf node of REGION: no JetStream, the region's account"
    )
    leaf.add_argument("--hub", metavar="HOST:PORT", help="the region's leafnode listener (its --leafnode-port)")
    leaf.add_argument("--server-name", metavar="NAME", help="the leaf's server name (default <region>-leaf-<port>)")
    parser.add_argument("--out", type=Path, metavar="FILE", help="write the configuration here (default: stdout)")


def config_text(args: argparse.Namespace) -> str:
    """What ``switchyard nats-config`` writes, from its arguments."""
    if args.leaf_of is not None:
        if args.hub is None:
            raise ConfigError("--leaf-of: --hub HOST:PORT (the region's leafnode listener) is required")
        leaf = LeafSpec(
            region=args.leaf_of,
            hub=parse_address(args.hub, "--hub"),
            host=args.host or DEFAULT_LISTEN_HOST,
            client_port=args.client_port or DEFAULT_CLIENT_PORT,
            server_name=args.server_name,
        )
        return render_leaf(leaf)
    if args.region is None:
        raise ConfigError("--region NAME is required (or --leaf-of REGION for an edge server)")
    if (args.regions is None) == (args.config is None):
        raise ConfigError("give the regions either as --regions NAME=HOST:PORT,... or as --config FILE")
    regions = parse_regions(args.regions) if args.regions is not None else load_toml(args.config)
    source = "--regions" if args.regions is not None else str(args.config)
    this = own(
        regions,
        args.region,
        source,
        client_port=args.client_port,
        cluster_port=args.cluster_port,
        gateway_port=args.gateway_port,
        leafnode_port=args.leafnode_port,
        http_port=args.http_port,
        store_dir=args.store_dir,
        host=args.host,
    )
    return render(this, regions)


def run(args: argparse.Namespace) -> int:
    text = config_text(args)
    if args.out is None:
        sys.stdout.write(text)
    else:
        print(f"{write(args.out, text)}: nats-server -c {args.out}", file=sys.stderr)
    return 0
