"""``switchyard keys``: the API keys that an ingress started with ``--auth keys`` accepts.

    switchyard keys create --tenant T [--rpm N] [--tpm N] [--max-streams N] [--trusted-proxy]
    switchyard keys list [--json]
    switchyard keys revoke KEY_ID

Each finds the keys file as the ingress does: ``--keys-file``, ``SWITCHYARD_KEYS_FILE``, or
``keys-file`` in a config file (``--config``). ``create`` prints the secret once, alone on
stdout (what it says about the key goes to stderr, so ``KEY=$(switchyard keys create ...)``
captures the secret); the file keeps only its SHA-256. A running ingress re-reads the file,
so a new or revoked key takes effect within about a second.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import msgspec

from switchyard import settings
from switchyard.ingress import IngressConfig, KeyRecord, KeyStore, Limits
from switchyard.settings import ConfigError, Sources


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="keys_command", required=True, metavar="ACTION")
    create = sub.add_parser("create", help="a new key for a tenant; its secret is printed once")
    create.add_argument("--tenant", required=True, help="the tenant the key's requests belong to")
    for flag, help_ in (
        ("--rpm", "requests per minute"),
        ("--tpm", "tokens per minute (prompt + max_tokens reserved, unused tokens refunded)"),
        ("--max-streams", "requests in flight at once"),
    ):
        create.add_argument(flag, type=int, default=0, metavar="N", help=f"{help_} (default: 0, no limit)")
    create.add_argument(
        "--trusted-proxy",
        action="store_true",
        help="a front proxy's key: it may assert its end user's tenant with x-switchyard-tenant",
    )
    listing = sub.add_parser("list", help="every key (revoked ones too), without secrets")
    listing.add_argument("--json", action="store_true", help="as JSON")
    revoke = sub.add_parser("revoke", help="stop accepting a key")
    revoke.add_argument("key_id", metavar="KEY_ID")
    for action in (create, listing, revoke):
        _add_keys_file(action)


def _keys_file_setting() -> settings.Setting:
    return next(s for s in settings.settings_of(IngressConfig) if s.name == "keys-file")


def _add_keys_file(parser: argparse.ArgumentParser) -> None:
    s = _keys_file_setting()
    parser.add_argument("--config", metavar="FILE", default=None, help="a TOML file of settings (its keys-file)")
    parser.add_argument(s.flag, dest=f"setting:{s.name}", default=argparse.SUPPRESS, metavar="FILE", help=s.help)


def store_of(args: argparse.Namespace) -> KeyStore:
    s = _keys_file_setting()
    found = Sources.load(settings.flags_given(args), settings.environ(), args.config).pick(s, "ingress")
    if found is None or not found.value:
        raise ConfigError(f"{s.name}: required ({s.flag}, {s.env} or {s.name} in a config file)")
    return KeyStore(str(found.value))


def run(args: argparse.Namespace) -> int:
    store = store_of(args)
    match args.keys_command:
        case "create":
            limits = Limits(rpm=args.rpm, tpm=args.tpm, max_streams=args.max_streams)
            record, secret = store.create(args.tenant, limits, trusted_proxy=args.trusted_proxy)
            print(f"created key {record.key_id} in {store.path}: {_describe(record)}", file=sys.stderr)
            print("the secret below is shown this once; the keys file keeps only its SHA-256", file=sys.stderr)
            print(secret, flush=True)
        case "list":
            records = store.read()
            if args.json:
                print(msgspec.json.format(msgspec.json.encode([_public(r) for r in records])).decode())
            else:
                for record in records:
                    print(f"{record.key_id}  {_describe(record)}")
        case "revoke":
            record = store.revoke(args.key_id)
            print(f"revoked key {record.key_id} ({_describe(record)}); an ingress refuses it within about a second")
    return 0


def _describe(record: KeyRecord) -> str:
    lim = record.limits
    bits = [
        f"tenant={record.tenant}",
        f"rpm={lim.rpm or '-'}",
        f"tpm={lim.tpm or '-'}",
        f"max-streams={lim.max_streams or '-'}",
        "trusted-proxy" if record.trusted_proxy else "",
        f"created {_when(record.created)}",
        f"REVOKED {_when(record.revoked)}" if record.revoked is not None else "",
    ]
    return "  ".join(b for b in bits if b)


def _when(unix: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(unix))


def _public(record: KeyRecord) -> dict[str, Any]:
    """A record without its digest: nothing a listing shows helps anyone guess a secret."""
    fields: dict[str, Any] = msgspec.to_builtins(record)
    fields.pop("sha256")
    return fields
