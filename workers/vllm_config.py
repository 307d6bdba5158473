"""The ``vllm`` engine's settings, and the vLLM engine arguments they become.

Pure: nothing here imports vLLM, so the settings are validated (and tested) on any
machine, and a bad setting fails when the worker starts, with a message naming it,
rather than deep inside the engine's boot.

KV transfer, by ``kv_transfer``:
- ``mooncake-store`` (the default): vLLM's ``MooncakeStoreConnector``. The prefill
  engine (``kv_both``: it also reuses what other prefills stored) saves every whole
  block to the Mooncake Store under the engine's block hash; the decode engine
  (``kv_consumer``) finds them there by the same hashes. A ``mooncake_client`` process
  owns the store's memory (``standalone-store``); the engines contribute none.
- ``lmcache``: vLLM's ``LMCacheConnectorV1`` with LMCache's local memory and disk tiers
  and the Mooncake Store as its remote tier (``kvbus.lmcache_config``). The connector is
  ``switchyard.kvbus.lmcache_cpu.LMCacheCPUConnectorV1``: LMCache's own, with the CPU KV adapter
  LMCache lacks registered first (on a GPU host it changes nothing).
- ``nixl``: vLLM's ``NixlConnector``: the decode engine pulls the blocks straight from
  the prefill engine's GPU memory; the handle carries the engine's transfer params.
- ``none``: no transfer; the decode engine recomputes the prompt (a baseline).

A load that fails is recomputed (``kv_load_failure_policy="recompute"``), never failed:
the decode worker sees it in the engine's counters and reports it (``workers.vllm_engine``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

from switchyard.kvbus import VLLM_DEFAULT_HASH_SEED
from switchyard.schemas import ConfigStruct, PositiveInt, setting

KvTransfer = Literal["mooncake-store", "lmcache", "nixl", "none"]
SpecMethod = Literal["ngram", "eagle", "eagle3", "draft_model", "mtp"]


class SpeculativeSettings(ConfigStruct, frozen=True, kw_only=True):
    """Speculative decoding for a decode pool: vLLM's ``speculative_config``."""

    method: Annotated[SpecMethod, setting("decode workers: speculative decoding")]
    num_speculative_tokens: Annotated[
        int, setting("tokens proposed per step (1-16)", flag="num-speculative-tokens")
    ] = 3
    model: Annotated[str | None, setting("the draft model (eagle, eagle3, draft_model); none for ngram and mtp")] = None
    prompt_lookup_max: Annotated[int, setting("ngram: longest n-gram matched in the context")] = 4
    prompt_lookup_min: Annotated[int, setting("ngram: shortest n-gram matched in the context")] = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be 1-16, got {self.num_speculative_tokens}")
        needs_draft = self.method in ("eagle", "eagle3", "draft_model")
        if needs_draft and not self.model:
            raise ValueError(f"speculative method {self.method} needs a draft model")
        if not needs_draft and self.model:
            raise ValueError(f"speculative method {self.method} takes no draft model")
        if self.method == "ngram" and not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("ngram needs 1 <= prompt_lookup_min <= prompt_lookup_max")

    def engine_config(self) -> dict[str, Any]:
        config: dict[str, Any] = {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens}
        if self.model:
            config["model"] = self.model
        if self.method == "ngram":
            config |= {"prompt_lookup_max": self.prompt_lookup_max, "prompt_lookup_min": self.prompt_lookup_min}
        return config


class ParallelSettings(ConfigStruct, frozen=True, kw_only=True):
    """How one engine spans devices; vLLM does the work, we check the shape."""

    tensor: Annotated[int, setting("devices one layer is split over", flag="tensor-parallel-size")] = 1
    pipeline: Annotated[int, setting("stages the layers are split into", flag="pipeline-parallel-size")] = 1
    data: Annotated[int, setting("engine replicas behind one worker", flag="data-parallel-size")] = 1
    expert: Annotated[
        bool, setting("shard experts over tensor x data ranks instead of replicating", flag="enable-expert-parallel")
    ] = False

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("tensor", "pipeline", "data"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} parallel size must be at least 1, got {getattr(self, name)}")
        if self.expert and self.tensor * self.data == 1:
            raise ValueError("expert parallelism needs tensor x data parallel size above 1")

    @property
    def devices(self) -> int:
        return self.tensor * self.pipeline * self.data

    def check_devices(self, available: int) -> None:
        """Fail early when this host has fewer accelerators than the engine spans."""
        if available and self.devices > available:
            raise ValueError(
                f"tensor {self.tensor} x pipeline {self.pipeline} x data {self.data} "
                f"= {self.devices} devices, but this host has {available}"
            )

    def engine_args(self) -> dict[str, Any]:
        return {
            "tensor_parallel_size": self.tensor,
            "pipeline_parallel_size": self.pipeline,
            "data_parallel_size": self.data,
            "enable_expert_parallel": self.expert,
        }


class MooncakeSettings(ConfigStruct, frozen=True, kw_only=True):
    """Where the Mooncake Store is: its master and its HTTP metadata server."""

    master: Annotated[str, setting("the Mooncake master (host:port)")] = "127.0.0.1:50051"
    metadata_server: Annotated[str, setting("the Mooncake metadata server's URL")] = "http://127.0.0.1:8080/metadata"
    protocol: Annotated[Literal["tcp", "rdma"], setting("how the Transfer Engine moves KV")] = "tcp"
    device_name: Annotated[str, setting("the RDMA device(s); empty for tcp")] = ""
    local_buffer_bytes: Annotated[int, setting("the engine's own staging buffer", gt=0)] = 256 << 20

    def store_config(self) -> dict[str, Any]:
        """vLLM's Mooncake config file (``MOONCAKE_CONFIG_PATH``): the engine contributes no
        memory; a ``mooncake_client`` process owns the store's segment."""
        return {
            "metadata_server": self.metadata_server,
            "master_server_address": self.master,
            "protocol": self.protocol,
            "device_name": self.device_name,
            "mode": "standalone-store",
            "global_segment_size": 0,
            "local_buffer_size": self.local_buffer_bytes,
        }


class LmcacheSettings(ConfigStruct, frozen=True, kw_only=True):
    """LMCache's tiers below the engine: local memory, then disk, then the Mooncake Store."""

    local_cpu_bytes: Annotated[int, setting("LMCache's local memory tier", gt=0)] = 512 << 20
    disk_dir: Annotated[str, setting("LMCache's disk (NVMe) tier (empty: none)")] = ""
    disk_bytes: Annotated[int, setting("LMCache's disk tier size", gt=0)] = 2 << 30
    remote: Annotated[bool, setting("the Mooncake Store as LMCache's remote tier")] = True


class VllmEngineConfig(ConfigStruct, frozen=True, kw_only=True):
    kv_transfer: Annotated[KvTransfer, setting("vllm: how KV moves from prefill to decode")] = "mooncake-store"
    # The CPU backend takes multiples of 32; the ingress must agree.
    block_size: Annotated[int, setting("the engine's KV block size", gt=0)] = 32
    dtype: Annotated[str, setting("vllm: the weights' dtype")] = "auto"
    max_model_len: Annotated[PositiveInt | None, setting("vllm: the longest sequence (default: the model's)")] = None
    max_num_seqs: Annotated[PositiveInt | None, setting("vllm: sequences in one batch at most")] = None
    kv_cache_bytes: Annotated[PositiveInt | None, setting("vllm: the KV cache size (needed on CPU hosts)")] = None
    gpu_memory_utilization: Annotated[float, setting("vllm: share of GPU memory the engine takes", gt=0, le=1)] = 0.9
    enforce_eager: Annotated[bool, setting("vllm: skip compilation: faster boot, slower steps")] = False
    seed: Annotated[int, setting("vllm: the engine's sampling seed", ge=0)] = 0
    hash_seed: Annotated[str, setting("vllm: the root of the engines' block hashes (an integer, or the default)")] = (
        VLLM_DEFAULT_HASH_SEED
    )
    parallel: Annotated[ParallelSettings, setting("parallelism", prefix="")] = ParallelSettings()
    speculative: Annotated[SpeculativeSettings | None, setting("speculative decoding", prefix="speculative-")] = None
    mooncake: Annotated[MooncakeSettings, setting("the Mooncake Store", prefix="mooncake-")] = MooncakeSettings()
    lmcache: Annotated[LmcacheSettings, setting("LMCache", prefix="lmcache-")] = LmcacheSettings()
    work_dir: Annotated[
        str, setting("vllm: config files and sockets (default: a temporary directory)", flag="vllm-work-dir")
    ] = ""
    handoff_timeout_s: Annotated[
        float, setting("prefill: the longest PrefillDone waits for the KV to be in the store", ge=0)
    ] = 10.0
    nixl_kv_lease_s: Annotated[
        int,
        setting(
            "nixl: seconds a prefill engine keeps a request's KV for a decode that has not pulled it "
            "(vLLM's kv_lease_duration; the decode side renews it while it pulls)",
            gt=0,
        ),
    ] = 30

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.block_size % 16:
            raise ValueError(f"block_size must be a positive multiple of 16, got {self.block_size}")
        if self.hash_seed != VLLM_DEFAULT_HASH_SEED and not self.hash_seed.isdigit():
            # vLLM reads it from PYTHONHASHSEED, which Python accepts only as an integer.
            raise ValueError(f"hash_seed must be an integer (or {VLLM_DEFAULT_HASH_SEED!r}), got {self.hash_seed!r}")

    def kv_role(self, role: str) -> str:
        """A prefill engine saves and also loads what other prefills saved; a decode engine
        only loads; a colocated one does both."""
        return {"prefill": "kv_both", "decode": "kv_consumer", "both": "kv_both"}[role]

    def kv_transfer_config(self, role: str, work_dir: Path) -> dict[str, Any] | None:
        if self.kv_transfer == "none":
            return None
        common = {"kv_role": self.kv_role(role), "kv_load_failure_policy": "recompute"}
        if self.kv_transfer == "mooncake-store":
            return {"kv_connector": "MooncakeStoreConnector", **common}
        if self.kv_transfer == "nixl":
            # A handoff that never comes frees the prefill's blocks when the lease runs out.
            extra = {"kv_lease_duration": self.nixl_kv_lease_s}
            return {"kv_connector": "NixlConnector", "kv_connector_extra_config": extra, **common}
        from switchyard.kvbus import lmcache_transfer_config

        return lmcache_transfer_config(self, role, work_dir)

    def engine_args(self, model: str, role: str, work_dir: Path, kv_events_endpoint: str | None) -> dict[str, Any]:
        """Keyword arguments of vLLM's ``AsyncEngineArgs``."""
        args: dict[str, Any] = {
            "model": model,
            "dtype": self.dtype,
            "seed": self.seed,
            "block_size": self.block_size,
            "enable_prefix_caching": True,
            "prefix_caching_hash_algo": "sha256_cbor",
            "enforce_eager": self.enforce_eager,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            **self.parallel.engine_args(),
        }
        if self.max_model_len is not None:
            args["max_model_len"] = self.max_model_len
        if self.max_num_seqs is not None:
            args["max_num_seqs"] = self.max_num_seqs
        if self.kv_cache_bytes is not None:
            args["kv_cache_memory_bytes"] = self.kv_cache_bytes
        transfer = self.kv_transfer_config(role, work_dir)
        if transfer is not None:
            args["kv_transfer_config"] = transfer
        if self.speculative is not None and role != "prefill":  # prefill emits one token: nothing to speculate
            args["speculative_config"] = self.speculative.engine_config()
        if kv_events_endpoint is not None:
            args["kv_events_config"] = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": kv_events_endpoint,
                "topic": "kv",
            }
        return args

    def environment(self, work_dir: Path) -> dict[str, str | None]:
        """What the engine's processes need in their environment (they inherit ours); None
        removes a variable. vLLM roots its block hashes on ``PYTHONHASHSEED`` when it is set."""
        seed = None if self.hash_seed == VLLM_DEFAULT_HASH_SEED else self.hash_seed
        env: dict[str, str | None] = {"PYTHONHASHSEED": seed, "VLLM_CACHE_ROOT": str(work_dir / "vllm-cache")}
        if self.kv_transfer == "mooncake-store":
            path = work_dir / "mooncake.json"
            path.write_text(json.dumps(self.mooncake.store_config()))
            env["MOONCAKE_CONFIG_PATH"] = str(path)
        elif self.kv_transfer == "lmcache":
            from switchyard.kvbus import lmcache_environment

            env |= lmcache_environment(work_dir)
        return env
