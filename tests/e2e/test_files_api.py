"""The Files API through the real HTTP API with the official ``openai`` client (``--auth
keys``): upload, list in pages, retrieve, download, delete; an unknown id, an oversized file
and a bad purpose are OpenAI-shaped errors; another tenant's key cannot reach a file."""

from __future__ import annotations

import httpx
import openai
import pytest

from switchyard.ingress.auth import KeyStore
from switchyard.ingress.config import FilesConfig
from switchyard.procs import nats_server
from tests.support.stack import MODEL, running_stack

MAX_BYTES = 256 * 1024
LINE = b'{"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "m"}}\n'


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> dict[str, str]:
    store = KeyStore(tmp_path_factory.mktemp("auth") / "keys.json")
    secrets = {name: store.create(tenant)[1] for name, tenant in (("alice", "acme"), ("mallory", "evil"))}
    return secrets | {"path": str(store.path)}


@pytest.fixture(scope="module")
def stack(module_nats, keys):
    overrides = {"auth": "keys", "keys_file": keys["path"], "files": FilesConfig(max_bytes=MAX_BYTES)}
    with running_stack(module_nats.url, ingress_overrides=overrides) as stack:
        yield stack


def client(stack, secret: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key=secret, max_retries=0, timeout=30)


def test_upload_list_retrieve_download_delete(stack, keys):
    alice = client(stack, keys["alice"])
    data = LINE * 2000  # about 180 KB: two chunks and a spooled upload
    created = alice.files.create(file=("input.jsonl", data), purpose="batch")
    assert created.id.startswith("file-") and created.object == "file"
    assert (created.bytes, created.filename, created.purpose, created.status) == (
        len(data),
        "input.jsonl",
        "batch",
        "processed",
    )
    assert alice.files.retrieve(created.id) == created
    assert alice.files.content(created.id).content == data
    assert created.id in [f.id for f in alice.files.list(purpose="batch")]
    deleted = alice.files.delete(created.id)
    assert (deleted.id, deleted.object, deleted.deleted) == (created.id, "file", True)
    with pytest.raises(openai.NotFoundError):
        alice.files.retrieve(created.id)


def test_the_list_pages_with_after_and_limit(stack, keys):
    alice = client(stack, keys["alice"])
    made = [alice.files.create(file=(f"p{i}.jsonl", LINE), purpose="user_data").id for i in range(5)]
    page = alice.files.list(purpose="user_data", limit=2)
    assert [f.id for f in page.data] == made[::-1][:2] and page.has_more
    assert [f.id for f in page] == made[::-1]  # iterating, the client follows after= itself
    ascending = alice.files.list(purpose="user_data", order="asc", limit=10)
    assert [f.id for f in ascending.data] == made and not ascending.has_more
    raw = httpx.get(
        stack.base_url + "/files",
        params={"purpose": "user_data", "limit": 2, "after": made[3]},
        headers={"authorization": f"Bearer {keys['alice']}"},
    ).json()
    assert raw["object"] == "list" and raw["first_id"] == made[2] and raw["last_id"] == made[1]
    assert raw["has_more"] is True


def test_an_unknown_id_is_a_404_naming_it(stack, keys):
    alice = client(stack, keys["alice"])
    with pytest.raises(openai.NotFoundError) as missing:
        alice.files.retrieve("file-000000000000000000000000")
    assert "file-000000000000000000000000" in missing.value.message
    with pytest.raises(openai.NotFoundError):
        alice.files.content("nonsense")
    with pytest.raises(openai.NotFoundError):
        alice.files.delete("file-000000000000000000000000")


def test_an_oversized_file_is_a_413(stack, keys):
    alice = client(stack, keys["alice"])
    with pytest.raises(openai.APIStatusError) as refused:
        alice.files.create(file=("big.jsonl", b"x" * (MAX_BYTES + 1)), purpose="batch")
    assert refused.value.status_code == 413
    # Far past the limit, and without a length up front: cut off as it arrives.
    chunks = (b"x" * 65536 for _ in range(64))
    response = httpx.post(
        stack.base_url + "/files",
        headers={"authorization": f"Bearer {keys['alice']}", "content-type": "multipart/form-data; boundary=b"},
        content=(c for c in [b'--b\r\nContent-Disposition: form-data; name="file"; filename="f"\r\n\r\n', *chunks]),
    )
    assert response.status_code == 413 and response.json()["error"]["param"] == "file"
    # A file of exactly the limit is fine.
    assert alice.files.create(file=("edge.jsonl", b"x" * MAX_BYTES), purpose="batch").bytes == MAX_BYTES


@pytest.mark.parametrize("purpose", ["fine-tune", "batch_output", ""])
def test_a_bad_purpose_is_a_400_naming_purpose(stack, keys, purpose):
    with pytest.raises(openai.BadRequestError) as bad:
        client(stack, keys["alice"]).files.create(file=("f.jsonl", LINE), purpose=purpose)  # type: ignore[arg-type]
    assert bad.value.param == "purpose" and "purpose" in bad.value.message


def test_a_form_without_a_file_is_a_400(stack, keys):
    response = httpx.post(
        stack.base_url + "/files",
        headers={"authorization": f"Bearer {keys['alice']}"},
        data={"purpose": "batch"},
        files={"other": ("x", b"y")},
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "file"
    response = httpx.post(stack.base_url + "/files", headers={"authorization": f"Bearer {keys['alice']}"}, json={})
    assert response.status_code == 400


def test_another_tenants_key_cannot_reach_the_file(stack, keys):
    alice, mallory = client(stack, keys["alice"]), client(stack, keys["mallory"])
    secret = alice.files.create(file=("secret.jsonl", b"acme's prompts\n"), purpose="batch")
    with pytest.raises(openai.NotFoundError):
        mallory.files.retrieve(secret.id)
    with pytest.raises(openai.NotFoundError):
        mallory.files.content(secret.id)
    with pytest.raises(openai.NotFoundError):
        mallory.files.delete(secret.id)
    assert secret.id not in [f.id for f in mallory.files.list()]
    assert alice.files.content(secret.id).content == b"acme's prompts\n"


def test_no_key_no_files(stack):
    assert httpx.get(stack.base_url + "/files").status_code == 401
    assert httpx.post(stack.base_url + "/files", files={"file": ("f", b"x")}).status_code == 401


def test_without_jetstream_the_files_api_is_a_503_and_the_rest_serves():
    with nats_server(jetstream=False) as plain, running_stack(plain.url) as bare:
        anyone = openai.OpenAI(base_url=bare.base_url, api_key="unused", max_retries=0, timeout=30)
        with pytest.raises(openai.InternalServerError) as unavailable:
            anyone.files.list()
        assert unavailable.value.status_code == 503 and "JetStream" in unavailable.value.message
        with pytest.raises(openai.InternalServerError):
            anyone.files.create(file=("f.jsonl", LINE), purpose="batch")
        reply = anyone.completions.create(model=MODEL, prompt="still serving", max_tokens=3)
        assert reply.usage.completion_tokens == 3
