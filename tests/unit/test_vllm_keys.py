"""The block keys the ingress computes for vLLM workers are the engine's own block hashes,
checked against vLLM's code (same algorithm, same root, same salt rule), and the KV-event
bridge turns vLLM's events into those keys. Imports vLLM (the CPU build ``make`` installs)."""

from __future__ import annotations

from typing import ClassVar

import msgspec
import pytest

# Not skipped without vLLM: `make test` installs it, and its absence is a failure.
from vllm.distributed import kv_events as vllm_events
from vllm.utils.hashing import sha256_cbor
from vllm.v1.core import kv_cache_utils

from switchyard.kvbus import KeyScheme, cache_salt_for, key_of_digest, vllm_block_hashes
from switchyard.workers.vllm_engine import VllmKvEvents


def _engine_hashes(tokens: list[int], block_size: int, salt: str | None) -> list[bytes]:
    """What vLLM's scheduler computes: its own chained hash, its own extra-keys rule."""
    kv_cache_utils.init_none_hash(sha256_cbor)

    class _Request:  # the fields generate_block_hash_extra_keys reads
        mm_features: ClassVar[list[object]] = []
        lora_request = None
        cache_salt = salt
        prompt_embeds = None

    parent, hashes = None, []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        extra, _ = kv_cache_utils.generate_block_hash_extra_keys(_Request(), start, start + block_size, 0)
        parent = kv_cache_utils.hash_block_tokens(sha256_cbor, parent, tokens[start : start + block_size], extra)
        hashes.append(parent)
    return hashes


@pytest.mark.parametrize("salt", [None, "tenant-salt"])
@pytest.mark.parametrize("length", [31, 32, 100, 257])
def test_our_hashes_are_the_engines(salt, length, monkeypatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    tokens = [(i * 7919) % 4000 for i in range(length)]
    assert vllm_block_hashes(tokens, 32, salt) == _engine_hashes(tokens, 32, salt)
    assert len(vllm_block_hashes(tokens, 32, salt)) == length // 32


def test_a_seed_changes_every_hash_and_the_salt_only_through_the_first_block(monkeypatch) -> None:
    tokens = list(range(64))
    monkeypatch.setenv("PYTHONHASHSEED", "1234")
    assert vllm_block_hashes(tokens, 32, None, seed="1234") == _engine_hashes(tokens, 32, None)
    assert vllm_block_hashes(tokens, 32, None, seed="1234") != vllm_block_hashes(tokens, 32, None)
    a, b = (
        KeyScheme("vllm-sha256-cbor").keys(tokens, 32, "acme", "m"),
        KeyScheme("vllm-sha256-cbor").keys(tokens, 32, "globex", "m"),
    )
    assert a[0] != b[0] and a[1] != b[1]  # chained: the salted first block changes all that follow


def test_bus_keys_are_vllms_int_form_of_the_hash() -> None:
    digest = vllm_block_hashes(list(range(32)), 32)[0]
    assert key_of_digest(digest) == kv_cache_utils.maybe_convert_block_hash(digest)


def test_the_bridge_turns_engine_events_into_ingress_keys() -> None:
    tokens = list(range(300, 396))
    salt = cache_salt_for("default", "tiny")
    hashes = vllm_block_hashes(tokens, 32, salt)
    expected = KeyScheme("vllm-sha256-cbor").keys(tokens, 32, "default", "tiny")
    batch = vllm_events.KVEventBatch(
        ts=1.0,
        events=[
            vllm_events.BlockStored(
                block_hashes=[kv_cache_utils.maybe_convert_block_hash(h) for h in hashes],
                parent_block_hash=None,
                token_ids=tokens,
                block_size=32,
                lora_id=None,
                medium="GPU",
                lora_name=None,
            ),
            vllm_events.BlockRemoved(block_hashes=[hashes[2]], medium="GPU"),  # the bytes form, too
        ],
    )
    wire = msgspec.msgpack.Decoder(vllm_events.KVEventBatch).decode(msgspec.msgpack.Encoder().encode(batch))
    bridge = VllmKvEvents("ipc:///unused")
    bridge.apply(wire)
    events = bridge.take_kv_events()
    assert [type(e).__name__ for e in events] == ["BlocksStored", "BlocksRemoved"]
    assert events[0].keys == expected and events[1].keys == [expected[2]]
    assert sorted(bridge.cached_blocks()["device"]) == sorted(expected[:2])
    assert bridge.take_kv_events() == []
    # What a KV connector wrote to its store (medium "cpu") is the cluster tier, and survives
    # the engine clearing its own cache.
    bridge.apply(
        vllm_events.KVEventBatch(
            ts=2.0,
            events=[
                vllm_events.BlockStored(
                    block_hashes=[kv_cache_utils.maybe_convert_block_hash(hashes[0])],
                    parent_block_hash=None,
                    token_ids=tokens[:32],
                    block_size=32,
                    lora_id=None,
                    medium="cpu",
                    lora_name=None,
                )
            ],
        )
    )
    assert bridge.take_kv_events()[0].tier == "cluster"
    bridge.apply(vllm_events.KVEventBatch(ts=3.0, events=[vllm_events.AllBlocksCleared()]))
    assert bridge.cached_blocks() == {"cluster": [expected[0]]}
    assert type(bridge.take_kv_events()[0]).__name__ == "AllBlocksCleared"


@pytest.mark.anyio
async def test_waiting_for_the_store_returns_when_the_blocks_are_written() -> None:
    import asyncio

    bridge = VllmKvEvents("ipc:///unused")
    hashes = vllm_block_hashes(list(range(64)), 32)
    keys = [key_of_digest(h) for h in hashes]
    assert not await bridge.wait_stored("cluster", keys, 0.05)

    async def write_later():
        for h in hashes:
            await asyncio.sleep(0.02)
            bridge.apply(
                vllm_events.KVEventBatch(
                    ts=1.0,
                    events=[
                        vllm_events.BlockStored(
                            block_hashes=[kv_cache_utils.maybe_convert_block_hash(h)],
                            parent_block_hash=None,
                            token_ids=[],
                            block_size=32,
                            lora_id=None,
                            medium="cpu",
                            lora_name=None,
                        )
                    ],
                )
            )

    writer = asyncio.create_task(write_later())
    assert await bridge.wait_stored("cluster", keys, 5)
    await writer


def test_a_nixl_handle_tells_the_decode_engine_where_to_pull_from() -> None:
    from switchyard.schemas import MooncakeStoreKvHandle, NixlKvHandle, codec
    from switchyard.workers.vllm_engine import decode_transfer_args

    params = {"remote_block_ids": [3, 4], "remote_engine_id": "e-1", "remote_host": "10.0.0.7", "remote_port": 5600}
    handle = NixlKvHandle(worker_id="p", num_tokens=70, block_size=32, params=__import__("json").dumps(params))
    wire = codec.WORKER_EVENT  # the handle survives the bus inside PrefillDone
    from switchyard.schemas import PrefillDone, PromptUsage

    done = wire.decode(
        wire.encode(
            PrefillDone(
                worker_id="p",
                request_id="r",
                handle=handle,
                first_token=1,
                usage=PromptUsage(prompt_tokens=70, cached_tokens=0),
                finished=False,
            )
        )
    )
    assert decode_transfer_args(done.handle) == {"kv_transfer_params": params | {"do_remote_prefill": True}}
    assert decode_transfer_args(MooncakeStoreKvHandle(worker_id="p", num_tokens=70, block_size=32)) is None
