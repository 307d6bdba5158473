"""API keys: the keys file (digests only, round trip, revoke), the gate's decisions on a
fake clock (who the caller is, which tenant, rpm/tpm/stream limits), and ``switchyard keys``."""

from __future__ import annotations

import json
import logging
import stat

import pytest

from switchyard import cli
from switchyard.ingress.auth import (
    DEFAULT_TENANT,
    Gate,
    KeyStore,
    KeyStoreError,
    Limits,
    digest,
    key_id_of,
)
from switchyard.ingress.config import IngressConfig
from switchyard.ingress.errors import InvalidRequest, PermissionDenied, RateLimited, Unauthorized


@pytest.fixture
def store(tmp_path) -> KeyStore:
    return KeyStore(tmp_path / "data" / "keys.json")


def bearer(secret: str) -> str:
    return f"Bearer {secret}"


# --- the file ----------------------------------------------------------------------------------


def test_the_file_keeps_the_digest_never_the_secret(store) -> None:
    record, secret = store.create("acme", now=1000.0)
    text = store.path.read_text()
    assert secret not in text and secret.split("-", 3)[-1] not in text
    assert digest(secret) in text and record.sha256 == digest(secret)
    assert key_id_of(secret) == record.key_id and record.tenant == "acme"
    assert stat.S_IMODE(store.path.stat().st_mode) == 0o600


def test_records_round_trip_through_the_file(store) -> None:
    a, _ = store.create("acme", Limits(rpm=5, tpm=1000, max_streams=2), now=1.0)
    b, _ = store.create("front", trusted_proxy=True, now=2.0)
    assert KeyStore(store.path).read() == [a, b]
    assert a.key_id != b.key_id and b.trusted_proxy and not a.trusted_proxy


def test_revoke_marks_the_key_and_keeps_it(store) -> None:
    record, _ = store.create("acme", now=1.0)
    other, _ = store.create("globex", now=1.0)
    revoked = store.revoke(record.key_id, now=50.0)
    assert revoked.revoked == 50.0
    assert store.revoke(record.key_id, now=99.0).revoked == 50.0  # the first time stands
    assert store.read() == [revoked, other]
    with pytest.raises(KeyStoreError, match="no key"):
        store.revoke("nope")


def test_bad_input_is_refused(store) -> None:
    with pytest.raises(KeyStoreError, match="no keys file"):
        store.read()
    with pytest.raises(KeyStoreError, match="tenant"):
        store.create("a tenant with spaces")
    with pytest.raises(ValueError, match="rpm"):
        Limits(rpm=-1)
    store.path.parent.mkdir(parents=True)
    store.path.write_text('{"keys": [{"key_id": 1}]}')
    with pytest.raises(KeyStoreError, match="not a keys file"):
        store.read()


def test_auth_keys_needs_a_keys_file() -> None:
    with pytest.raises(ValueError, match="keys file"):
        IngressConfig(auth="keys")


# --- who is calling --------------------------------------------------------------------------------


def test_a_live_key_gives_its_tenant_and_nothing_else_passes(store) -> None:
    _, secret = store.create("acme")
    gate = Gate("keys", store)
    assert gate.authenticate(bearer(secret), [], 0.0).tenant == "acme"
    for header, message in (
        (None, "didn't provide"),
        ("Basic abc", "Bearer"),
        (bearer(secret[:-1] + ("A" if secret[-1] != "A" else "B")), "Incorrect"),  # the right id, a wrong secret
        (bearer("sk-sy-000000000000-guess"), "Incorrect"),
        (bearer("sk-" + "x" * 5000), "Incorrect"),
    ):
        with pytest.raises(Unauthorized, match=message):
            gate.authenticate(header, [], 0.0)


def test_a_key_revoked_or_created_in_the_file_counts_after_the_reload(store) -> None:
    record, secret = store.create("acme")
    gate = Gate("keys", store, reload_every_s=1.0)
    assert gate.authenticate(bearer(secret), [], 0.0).tenant == "acme"
    store.revoke(record.key_id)
    assert gate.authenticate(bearer(secret), [], 0.5).tenant == "acme"  # not looked at again yet
    with pytest.raises(Unauthorized, match="revoked"):
        gate.authenticate(bearer(secret), [], 1.5)
    _, fresh = store.create("globex")
    assert gate.authenticate(bearer(fresh), [], 3.0).tenant == "globex"


def test_an_unreadable_file_refuses_every_key(store, caplog) -> None:
    _, secret = store.create("acme")
    gate = Gate("keys", store)
    store.path.write_text("not json")
    with caplog.at_level(logging.ERROR), pytest.raises(Unauthorized):
        gate.authenticate(bearer(secret), [], 10.0)
    assert "refusing every key" in caplog.text


def test_only_a_trusted_proxy_key_may_assert_a_tenant(store) -> None:
    _, plain = store.create("mallory")
    _, proxy = store.create("front", trusted_proxy=True)
    gate = Gate("keys", store)
    with pytest.raises(PermissionDenied):
        gate.authenticate(bearer(plain), ["acme"], 0.0)
    assert gate.authenticate(bearer(proxy), ["acme"], 0.0).tenant == "acme"
    assert gate.authenticate(bearer(proxy), [], 0.0).tenant == "front"
    with pytest.raises(InvalidRequest):
        gate.authenticate(bearer(proxy), ["a/b"], 0.0)
    with pytest.raises(InvalidRequest):
        gate.authenticate(bearer(proxy), ["acme", "globex"], 0.0)


def test_without_keys_the_header_is_refused_unless_proxy_mode() -> None:
    none = Gate("none")
    assert none.authenticate(None, [], 0.0).tenant == DEFAULT_TENANT
    assert none.authenticate("Bearer anything", [], 0.0).tenant == DEFAULT_TENANT
    with pytest.raises(PermissionDenied):
        none.authenticate(None, ["acme"], 0.0)
    assert Gate("proxy").authenticate(None, ["acme"], 0.0).tenant == "acme"
    assert Gate("proxy").authenticate(None, [], 0.0).tenant == DEFAULT_TENANT


def test_auth_off_is_said_loudly_at_start(caplog) -> None:
    with caplog.at_level(logging.WARNING):
        Gate.for_config(IngressConfig())
    assert "AUTHENTICATION IS OFF" in caplog.text and "switchyard keys create" in caplog.text


# --- limits ------------------------------------------------------------------------------------------


def test_requests_per_minute_with_a_true_retry_after(store) -> None:
    _, secret = store.create("acme", Limits(rpm=2))
    gate = Gate("keys", store)
    gate.authenticate(bearer(secret), [], 0.0)
    gate.authenticate(bearer(secret), [], 0.0)
    with pytest.raises(RateLimited) as refused:
        gate.authenticate(bearer(secret), [], 0.0)
    assert refused.value.headers() == {"retry-after": "30"} and refused.value.code == "rate_limit_exceeded"
    gate.authenticate(bearer(secret), [], 30.0)


def test_tokens_per_minute_reserve_then_refund_what_was_not_used(store) -> None:
    _, secret = store.create("acme", Limits(tpm=100))
    gate = Gate("keys", store)
    caller = gate.authenticate(bearer(secret), [], 0.0)
    first = gate.admit(caller, 60, 0.0)
    with pytest.raises(RateLimited) as refused:
        gate.admit(caller, 60, 0.0)
    assert refused.value.headers() == {"retry-after": "12"}  # 20 tokens short at 100 a minute
    first.measure(lambda: 20)
    first.close()  # 40 of its 60 refunded
    gate.admit(caller, 60, 0.0).close()


def test_a_request_larger_than_the_bucket_waits_for_a_full_one(store) -> None:
    _, secret = store.create("acme", Limits(tpm=100))
    gate = Gate("keys", store)
    caller = gate.authenticate(bearer(secret), [], 0.0)
    gate.admit(caller, 250, 0.0).measure(lambda: 250)  # admitted on a full bucket: 150 in debt
    with pytest.raises(RateLimited) as refused:
        gate.admit(caller, 250, 0.0)
    assert refused.value.headers() == {"retry-after": "150"}
    gate.admit(caller, 250, 150.0)


def test_concurrent_requests_are_bounded_until_one_ends(store) -> None:
    _, secret = store.create("acme", Limits(max_streams=1))
    gate = Gate("keys", store)
    caller = gate.authenticate(bearer(secret), [], 0.0)
    held = gate.admit(caller, 10, 0.0)
    with pytest.raises(RateLimited, match="in flight"):
        gate.admit(caller, 10, 0.0)
    held.close()
    held.close()  # idempotent: one slot back, not two
    gate.admit(caller, 10, 0.0)
    with pytest.raises(RateLimited):
        gate.admit(caller, 10, 0.0)


def test_no_keys_no_limits() -> None:
    gate = Gate("none")
    caller = gate.authenticate(None, [], 0.0)
    for _ in range(1000):
        gate.admit(caller, 10**6, 0.0)


# --- switchyard keys ---------------------------------------------------------------------------------


def test_keys_create_list_revoke(tmp_path, capsys) -> None:
    path = tmp_path / "keys.json"
    assert (
        cli.main(["keys", "create", "--tenant", "acme", "--rpm", "5", "--trusted-proxy", "--keys-file", str(path)]) == 0
    )
    out = capsys.readouterr()
    secret = out.out.strip()
    assert secret.startswith("sk-sy-") and "\n" not in secret  # the secret alone on stdout
    key_id = key_id_of(secret)
    assert key_id and key_id in out.err and "shown this once" in out.err
    assert Gate("keys", KeyStore(path)).authenticate(bearer(secret), ["x"], 0.0).tenant == "x"

    assert cli.main(["keys", "list", "--keys-file", str(path)]) == 0
    listed = capsys.readouterr().out
    assert key_id in listed and "tenant=acme" in listed and "rpm=5" in listed and "trusted-proxy" in listed
    assert secret not in listed and digest(secret) not in listed

    assert cli.main(["keys", "revoke", key_id, "--keys-file", str(path)]) == 0
    assert "revoked" in capsys.readouterr().out
    assert cli.main(["keys", "list", "--json", "--keys-file", str(path)]) == 0
    (shown,) = json.loads(capsys.readouterr().out)
    assert shown["key_id"] == key_id and shown["revoked"] is not None and "sha256" not in shown


def test_keys_file_from_the_environment_or_an_error(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.delenv("SWITCHYARD_KEYS_FILE", raising=False)
    monkeypatch.delenv("SWITCHYARD_CONFIG", raising=False)
    assert cli.main(["keys", "list"]) == 2
    assert "keys-file: required" in capsys.readouterr().err
    assert cli.main(["keys", "revoke", "abc", "--keys-file", str(tmp_path / "none.json")]) == 2
    assert "no key" in capsys.readouterr().err
    monkeypatch.setenv("SWITCHYARD_KEYS_FILE", str(tmp_path / "env.json"))
    assert cli.main(["keys", "create", "--tenant", "acme"]) == 0
    assert (tmp_path / "env.json").exists()


def test_up_takes_auth_keys_only_with_a_keys_file(tmp_path, capsys) -> None:
    assert cli.main(["config", "show", "--auth", "keys"]) == 2
    assert "keys file" in capsys.readouterr().err
    assert cli.main(["config", "show", "--auth", "keys", "--keys-file", str(tmp_path / "k.json")]) == 0
    assert 'auth = "keys"' in capsys.readouterr().out
