"""The NATS users ``up`` and ``switchyard nats-auth`` make, and how each child gets its own:
a credentials file's path in its config, never a password."""

from __future__ import annotations

import json
import stat
import subprocess
from contextlib import ExitStack

from switchyard import cli, nats_auth, procs, settings, up
from switchyard.observability.bus import load_credentials
from switchyard.schemas import permissions, subjects


def _plan() -> up.Plan:
    return up.plan(cli.sources_of(cli.build_parser().parse_args(["up", "--prefill", "2"]), env={}))


def test_every_file_is_private_and_the_server_accepts_its_config(tmp_path) -> None:
    files = nats_auth.write(tmp_path / "auth", ["prefill-0"])
    assert sorted(files) == sorted(
        ["nats-auth.conf", "scheduler", "ingress", "batch-runner", "admin", "worker-prefill-0"]
    )
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files.values())
    checked = subprocess.run(
        [str(procs.nats_server_binary()), "-c", str(files[nats_auth.SERVER_CONFIG]), "-t"], capture_output=True
    )
    assert checked.returncode == 0, checked.stderr
    ingress = load_credentials(str(files["ingress"]))
    assert ingress.user == "ingress" and ingress.inbox_prefix == permissions.ingress().inbox_prefix
    assert ingress.password not in repr(ingress)


def test_a_workers_rights_name_only_its_own_tasks() -> None:
    rights = permissions.worker("decode-3")
    assert subjects.worker_tasks("decode-3") in rights.subscribe
    assert not [s for s in rights.subscribe if "*" in s or ">" in s]
    assert subjects.CANCEL not in rights.publish and not [s for s in rights.publish if "tasks" in s]


def test_up_gives_each_child_its_own_credentials_file_and_no_password(tmp_path) -> None:
    plan = _plan()
    auth = up.Auth(nats_auth.write(tmp_path, [c.name for c in plan.children if c.command == "worker"]))
    passwords = [json.loads(f.read_text())["password"] for u, f in auth.files.items() if u != "nats-auth.conf"]
    for child in plan.children:
        _command, env = up.child_spec(child, "nats://127.0.0.1:5555", auth)
        data = env[settings.CONFIG_DATA_ENV]
        _process, tree = settings.decode_child(data, settings.COMMAND_TREES[child.command][1])
        user = load_credentials(tree.nats_client.credentials_file).user
        assert user == {"scheduler": "scheduler", "ingress": "ingress", "batch-runner": "batch-runner"}.get(
            child.name, f"worker-{child.name}"
        )
        if child.command == "worker":
            assert tree.worker_id == child.name  # its user's rights name it
        assert not [p for p in passwords if p in data]


def test_a_password_in_an_external_url_moves_into_a_file(tmp_path) -> None:
    with ExitStack() as stack:
        url, auth = up._external_nats("nats://svc:p%40ss@nats.example:4222", stack)
        assert url == "nats://nats.example:4222" and auth is not None
        child = _plan().children[0]
        _command, env = up.child_spec(child, url, auth)
        assert "p@ss" not in env[settings.CONFIG_DATA_ENV] and "p%40ss" not in env[settings.CONFIG_DATA_ENV]
        assert auth.shared is not None
        creds = load_credentials(str(auth.shared))
        assert (creds.user, creds.password) == ("svc", "p@ss")
    assert up._external_nats("nats://nats.example:4222", ExitStack()) == ("nats://nats.example:4222", None)


def test_keep_leaves_the_files_there_and_succeeds(tmp_path, capsys):
    out = tmp_path / "auth"
    args = cli.build_parser().parse_args(["nats-auth", "--out", str(out), "--workers", "prefill", "--keep"])
    assert nats_auth.run(args) == 0
    first = (out / nats_auth.SERVER_CONFIG).read_text()
    assert nats_auth.run(args) == 0 and "kept" in capsys.readouterr().out
    assert (out / nats_auth.SERVER_CONFIG).read_text() == first  # the same passwords
    again = cli.build_parser().parse_args(["nats-auth", "--out", str(out), "--workers", "prefill"])
    assert nats_auth.run(again) == 1  # neither --keep nor --force: refused
