"""NATS users for every role: the server's authorization block and one credentials file each.

``switchyard up`` writes them into its private nats-server's folder and starts the server
with them (``-c``); ``switchyard nats-auth --out DIR`` writes the same files for a real
deployment, whose operator includes ``nats-auth.conf`` in the server's configuration and
hands each service its file (``--nats-credentials-file``). The rights are the table of
``schemas.permissions``: a scheduler user, an ingress user (shared by every ingress), one
user per worker id (a worker's rights name its own task subject), and an admin.

Passwords are 32 random bytes, stored as they are in the server's file: nats-server also
takes bcrypt hashes, but nothing here can compute one without another dependency. Every
file is readable by its owner only.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from switchyard.schemas import permissions

SERVER_CONFIG = "nats-auth.conf"
BATCH_RUNNER_USER = "batch-runner"


@dataclass(frozen=True)
class Identity:
    user: str  # also the credentials file's name: <user>.json
    rights: permissions.Permissions
    password: str = field(default_factory=lambda: secrets.token_urlsafe(32), repr=False)


def identities(worker_ids: Iterable[str]) -> list[Identity]:
    """Every role's user; ``worker-<id>`` for each worker."""
    fixed = [
        Identity("scheduler", permissions.scheduler()),
        Identity("ingress", permissions.ingress()),
        Identity(BATCH_RUNNER_USER, permissions.batch_runner()),
        Identity("admin", permissions.admin()),
    ]
    return fixed + [Identity(worker_user(w), permissions.worker(w)) for w in worker_ids]


def worker_user(worker_id: str) -> str:
    return f"worker-{worker_id}"


def server_config(users: Sequence[Identity]) -> str:
    """nats-server's ``authorization`` block (its config syntax takes JSON values)."""
    entries = ",\n".join(f"    {json.dumps(_user_entry(u))}" for u in users)
    return f"# Written by switchyard: one user per role (schemas/permissions.py).\nauthorization {{\n  users = [\n{entries}\n  ]\n}}\n"


def _user_entry(identity: Identity) -> dict[str, object]:
    rights = identity.rights
    entry: dict[str, object] = {
        "publish": {"allow": list(rights.publish)},
        "subscribe": {"allow": list(rights.subscribe)},
    }
    if rights.responses:
        entry["allow_responses"] = True
    return {"user": identity.user, "password": identity.password, "permissions": entry}


def credentials(identity: Identity) -> str:
    """What ``observability.bus.load_credentials`` reads."""
    body = {"user": identity.user, "password": identity.password, "inbox_prefix": identity.rights.inbox_prefix}
    return json.dumps(body, indent=2) + "\n"


def write_credentials(path: Path, user: str, password: str) -> Path:
    """One credentials file, for a user made elsewhere (an external server's)."""
    body = {"user": user, "password": password, "inbox_prefix": permissions.DEFAULT_INBOX}
    return _write_private(path, json.dumps(body, indent=2) + "\n")


def write(out_dir: Path, worker_ids: Iterable[str]) -> dict[str, Path]:
    """The server's config and every user's credentials file in ``out_dir`` (created, owner
    only); returns user -> credentials file, and ``SERVER_CONFIG`` -> the server's config."""
    out_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    users = identities(worker_ids)
    written = {SERVER_CONFIG: _write_private(out_dir / SERVER_CONFIG, server_config(users))}
    for identity in users:
        written[identity.user] = _write_private(out_dir / f"{identity.user}.json", credentials(identity))
    return written


def _write_private(path: Path, text: str) -> Path:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, 0o600)  # an existing file keeps its mode through O_CREAT
    return path


# --- switchyard nats-auth ------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, required=True, metavar="DIR", help="folder to write the files into")
    parser.add_argument(
        "--workers",
        required=True,
        metavar="ID,ID,...",
        help="the worker ids: each worker runs with --worker-id ID --nats-credentials-file DIR/worker-ID.json",
    )
    existing = parser.add_mutually_exclusive_group()
    existing.add_argument("--force", action="store_true", help="overwrite the files there (new passwords for all)")
    existing.add_argument(
        "--keep", action="store_true", help="files there already: keep them, succeed (a container run at every start)"
    )


def run(args: argparse.Namespace) -> int:
    workers = [w.strip() for w in args.workers.split(",") if w.strip()]
    if (args.out / SERVER_CONFIG).exists() and args.keep:
        print(f"switchyard nats-auth: {args.out / SERVER_CONFIG} exists; kept as it is")
        return 0
    if (args.out / SERVER_CONFIG).exists() and not args.force:
        print(
            f"switchyard nats-auth: {args.out / SERVER_CONFIG} exists (--force writes new passwords)", file=sys.stderr
        )
        return 1
    written = write(args.out, workers)
    print(f"{written[SERVER_CONFIG]}: include it in the nats-server configuration (`include {SERVER_CONFIG}`)")
    for user, path in written.items():
        if user != SERVER_CONFIG:
            print(f"{path}: --nats-credentials-file for {user}")
    return 0
