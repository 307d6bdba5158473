"""The NATS users ``switchyard up`` made for its private nats-server, found as an operator
finds them: beside the server's configuration file (``-c``, on its command line)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from switchyard.observability.bus import Credentials, load_credentials


def auth_dir(nats_server_cmdline: Sequence[str]) -> Path:
    return Path(nats_server_cmdline[list(nats_server_cmdline).index("-c") + 1]).parent


def credentials(nats_server_cmdline: Sequence[str], user: str) -> Credentials:
    return load_credentials(str(auth_dir(nats_server_cmdline) / f"{user}.json"))


def admin_credentials(nats_server_cmdline: Sequence[str]) -> Credentials:
    return credentials(nats_server_cmdline, "admin")
