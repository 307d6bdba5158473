"""The CPU KV adapter for LMCache, on real tensors in vLLM's CPU_ATTN cache layout.

The layout is pinned by vLLM's own writer kernel (``cpu_attn_reshape_and_cache``), so a
change in vLLM's CPU layout fails here rather than as silent garbage in a served request.
No engine is booted.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("lmcache")
pytest.importorskip("vllm")

import lmcache.v1.gpu_connector as lmc_gc
from lmcache.utils import EngineType
from lmcache.v1.config import LMCacheEngineConfig, load_engine_config_with_overrides
from lmcache.v1.memory_allocators.ad_hoc_memory_allocator import AdHocMemoryAllocator
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.metadata import LMCacheMetadata

import switchyard.kvbus.lmcache_cpu as lmc_cpu
from switchyard.kvbus.lmcache_config import write_lmcache_config
from switchyard.kvbus.lmcache_cpu import CPUPagedKVConnector, block_layout, register_cpu_kv_connector

LAYERS, HEADS, HEAD, BS, BLOCKS = 2, 2, 32, 32, 12
DTYPE = torch.float32
ALLOC = AdHocMemoryAllocator("cpu")


def caches(fill: bool = True) -> list[torch.Tensor]:
    """Per-layer caches shaped as vLLM hands them to register_kv_caches on CPU."""
    make = torch.randn if fill else torch.zeros
    return [make(BLOCKS, HEADS, BS, 2 * HEAD, dtype=DTYPE) for _ in range(LAYERS)]


def vllm_write(kv: list[torch.Tensor], keys: list[torch.Tensor], vals: list[torch.Tensor], slots: torch.Tensor) -> None:
    """Store K/V [n, heads, head] at slots with vLLM's own CPU kernel, as CPU_ATTN does."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(DTYPE, BS, HEAD, "auto")
    for layer, cache in enumerate(kv):
        kc, vc = cache.view(cache.shape[0], HEADS, 2 * BS, HEAD).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(keys[layer], vals[layer], kc, vc, slots, isa)


def random_kv(n: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return ([torch.randn(n, HEADS, HEAD) for _ in range(LAYERS)], [torch.randn(n, HEADS, HEAD) for _ in range(LAYERS)])


def slots_for(block_order: list[int], n: int) -> torch.Tensor:
    """LMCache's full slot mapping: block_id * block_size + offset, token by token."""
    b = torch.tensor(block_order, dtype=torch.long)
    return (b[:, None] * BS + torch.arange(BS)).flatten()[:n]


def mem(n: int) -> MemoryObj:
    obj = ALLOC.allocate(torch.Size([2, LAYERS, n, HEADS * HEAD]), DTYPE, MemoryFormat.KV_2LTD)
    assert obj is not None
    return obj


def chunks(total: int, size: int) -> list[tuple[int, int]]:
    return [(s, min(s + size, total)) for s in range(0, total, size)]


def conn() -> CPUPagedKVConnector:
    return CPUPagedKVConnector(LAYERS, HEADS, HEAD, DTYPE)


def test_layout_is_a_permutation_of_a_block() -> None:
    layout = block_layout(DTYPE, BS, HEADS, HEAD)
    assert layout.shape == (BS, 2, HEADS, HEAD)
    assert torch.equal(layout.flatten().sort().values, torch.arange(2 * BS * HEADS * HEAD))


def test_gather_reads_what_vllm_cpu_kernel_wrote() -> None:
    n = 70
    kv = caches()  # noise everywhere: a gather from a wrong cell shows up
    slots = slots_for([5, 0, 9], n)
    keys, vals = random_kv(n)
    vllm_write(kv, keys, vals, slots)
    obj = mem(n)
    conn().from_gpu(obj, 0, n, kvcaches=kv, slot_mapping=slots)
    t = obj.tensor
    assert t is not None and obj.metadata.fmt == MemoryFormat.KV_2LTD
    for layer in range(LAYERS):
        assert torch.equal(t[0, layer], keys[layer].reshape(n, -1)), f"K of layer {layer}"
        assert torch.equal(t[1, layer], vals[layer].reshape(n, -1)), f"V of layer {layer}"


@pytest.mark.parametrize("n,chunk", [(288, 256), (300, 256), (300, 32), (5, 256)])
def test_round_trip_into_other_block_order(n: int, chunk: int) -> None:
    """Producer cache -> chunks (last one partial unless n % chunk == 0) -> consumer cache."""
    src_blocks, dst_blocks = [3, 7, 1, 0, 11, 4, 9, 2, 8, 5], [10, 2, 6, 0, 4, 11, 1, 9, 3, 7]
    s_slots, d_slots = slots_for(src_blocks, n), slots_for(dst_blocks, n)
    keys, vals = random_kv(n)
    src = caches()
    vllm_write(src, keys, vals, s_slots)
    dst, expected = caches(fill=False), caches(fill=False)
    vllm_write(expected, keys, vals, d_slots)

    spans = chunks(n, chunk)
    objs = [mem(e - s) for s, e in spans]
    starts, ends = [s for s, _ in spans], [e for _, e in spans]
    conn().batched_from_gpu(objs, starts, ends, kvcaches=src, slot_mapping=s_slots)
    conn().batched_to_gpu(objs, starts, ends, kvcaches=dst, slot_mapping=d_slots)
    for layer in range(LAYERS):
        # bit-identical to vLLM writing the same K/V there, and nothing else touched
        assert torch.equal(dst[layer], expected[layer]), f"layer {layer}"


def test_scatter_skips_tokens_vllm_already_has() -> None:
    src, dst = caches(), caches(fill=False)
    slots = slots_for([4, 6, 8], 96)
    obj = mem(96)
    conn().from_gpu(obj, 0, 96, kvcaches=src, slot_mapping=slots)
    conn().to_gpu(obj, 0, 96, kvcaches=dst, slot_mapping=slots, vllm_cached_tokens=32)
    for layer in range(LAYERS):
        assert not dst[layer][4].any()
        assert torch.equal(dst[layer][6], src[layer][6]) and torch.equal(dst[layer][8], src[layer][8])


def test_bad_inputs_raise_clear_errors() -> None:
    good, slots = caches(), slots_for([0, 1], 64)
    wrong_heads = [torch.zeros(BLOCKS, HEADS + 1, BS, 2 * HEAD) for _ in range(LAYERS)]
    with pytest.raises(ValueError, match=r"expected vLLM CPU KV cache \[blocks, 2, block_size, 64\]"):
        conn().from_gpu(mem(64), 0, 64, kvcaches=wrong_heads, slot_mapping=slots)
    with pytest.raises(ValueError, match="expected 2 layer KV caches, got 1"):
        conn().from_gpu(mem(64), 0, 64, kvcaches=good[:1], slot_mapping=slots)
    with pytest.raises(ValueError, match="dtype"):
        conn().from_gpu(mem(64), 0, 64, kvcaches=[c.half() for c in good], slot_mapping=slots)
    with pytest.raises(ValueError, match=r"memory object is \(2, 2, 32, 64\)"):
        conn().from_gpu(mem(32), 0, 64, kvcaches=good, slot_mapping=slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        conn().from_gpu(mem(64), 0, 64, kvcaches=good)
    with pytest.raises(ValueError, match="slot out of range"):
        conn().to_gpu(mem(64), 0, 64, kvcaches=good, slot_mapping=slots + BLOCKS * BS)
    with pytest.raises(ValueError, match="kvcaches"):
        conn().from_gpu(mem(64), 0, 64, slot_mapping=slots)
    obj = mem(64)
    obj.metadata.fmt = MemoryFormat.KV_T2D
    with pytest.raises(ValueError, match="KV_2LTD"):
        conn().to_gpu(obj, 0, 64, kvcaches=good, slot_mapping=slots)


def test_registration_replaces_the_missing_cpu_connector() -> None:
    meta = LMCacheMetadata(
        model_name="m",
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=DTYPE,
        kv_shape=(LAYERS, 2, 256, HEADS, HEAD),
    )
    cfg = LMCacheEngineConfig.from_defaults()
    register_cpu_kv_connector()
    register_cpu_kv_connector()  # idempotent
    original = lmc_cpu._original_factory
    assert original is not None and original is not lmc_gc.CreateGPUConnector
    if lmc_gc.torch_device_type == "cpu":  # what LMCache 0.5.6 does on its own
        with pytest.raises(RuntimeError, match="No supported cpu connector found"):
            original(cfg, meta, EngineType.VLLM)
    c = lmc_gc.CreateGPUConnector(cfg, meta, EngineType.VLLM)
    assert isinstance(c, CPUPagedKVConnector)
    assert c.get_shape(7) == torch.Size([2, LAYERS, 7, HEADS * HEAD])


def test_written_config_loads_in_lmcache(tmp_path: Path) -> None:
    from lmcache.v1.storage_backend.connector.mooncakestore_connector import MooncakeStoreConfig

    env, kvt = write_lmcache_config(
        tmp_path / "lmc.yaml",
        role="kv_consumer",
        block_size=32,
        chunk_blocks=8,
        cpu_gb=0.5,
        disk_dir=tmp_path / "disk",
        disk_gb=1,
        mooncake_rpc_port=51151,
        mooncake_http_port=51180,
    )
    assert kvt == {
        "kv_connector": "LMCacheCPUConnectorV1",
        "kv_connector_module_path": "switchyard.kvbus.lmcache_cpu",
        "kv_role": "kv_consumer",
        "kv_load_failure_policy": "recompute",
    }
    cfg = load_engine_config_with_overrides(config_file_path=env["LMCACHE_CONFIG_FILE"])
    assert cfg.chunk_size == 256 and cfg.pre_caching_hash_algorithm == "sha256_cbor"
    assert cfg.remote_url == "mooncakestore://127.0.0.1:51151/"
    assert cfg.local_disk == f"{(tmp_path / 'disk').resolve()}/" and cfg.max_local_disk_size == 1.0
    setup = MooncakeStoreConfig.load_from_lmcache_config(cfg).setup_config
    assert setup["master_server_addr"] == setup["master_server_address"] == "127.0.0.1:51151"
    assert setup["metadata_server"] == "http://127.0.0.1:51180/metadata"
    assert setup["global_segment_size"] == "0" and setup["protocol"] == "tcp"
