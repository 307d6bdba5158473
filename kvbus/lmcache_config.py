"""LMCache config for CPU vLLM: local CPU -> local disk -> Mooncake Store, and the matching vLLM config.

Why each setting:

* ``pre_caching_hash_algorithm: sha256_cbor`` -- LMCache's default ``builtin`` hash is
  Python ``hash()``, seeded per process unless PYTHONHASHSEED is set, so a producer and a
  consumer process would never compute the same chunk keys. Also pass
  ``prefix_caching_hash_algo="sha256_cbor"`` to vLLM: LMCache re-initialises vLLM's
  ``NONE_HASH`` with this function inside the engine process.
* ``chunk_size`` is a whole number of vLLM blocks so a loaded chunk fills whole blocks.
* Mooncake: the store client contributes no segment (``global_segment_size: 0``); a separate
  ``mooncake_client`` process owns the memory pool. Mooncake's dict ``setup()`` API calls the
  master key ``master_server_addr`` while LMCache forwards ``master_server_address`` (the
  legacy positional name), so both are written (``mooncake_`` prefixed keys are forwarded
  with the prefix stripped). Without ``master_server_addr`` the client retries a default
  master for minutes ("Client not available").
* ``kv_load_failure_policy: recompute`` in the vLLM config: a lost remote tier costs a
  recompute, not a failed request.
* ``MOONCAKE_CONFIG_PATH`` must be unset in the engine's environment: LMCache prefers that
  file over this config.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

KVRole = Literal["kv_producer", "kv_consumer", "kv_both"]

CONNECTOR_CLASS = "LMCacheCPUConnectorV1"
CONNECTOR_MODULE = "switchyard.kvbus.lmcache_cpu"


def _yaml_scalar(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


def write_lmcache_config(
    path: str | Path,
    *,
    role: KVRole,
    block_size: int,
    chunk_blocks: int,
    cpu_gb: float,
    disk_dir: str | Path,
    disk_gb: float,
    mooncake_rpc_port: int,
    mooncake_http_port: int,
    host: str = "127.0.0.1",
    local_buffer_bytes: int = 64 << 20,
) -> tuple[dict[str, str], dict[str, Any]]:
    """Write the LMCache YAML at ``path``; return ``(env, kv_transfer_config)``.

    ``env`` must be in the environment of the process that creates ``vllm.LLM`` (vLLM's
    spawned engine core inherits it). ``kv_transfer_config`` is passed to ``LLM(...)`` as is.
    """
    if block_size <= 0 or chunk_blocks <= 0:
        raise ValueError("block_size and chunk_blocks must be positive")
    if role not in ("kv_producer", "kv_consumer", "kv_both"):
        raise ValueError(f"unknown kv role {role!r}")
    disk = Path(disk_dir).resolve()
    disk.mkdir(parents=True, exist_ok=True)
    top: dict[str, Any] = {
        "chunk_size": block_size * chunk_blocks,
        "local_cpu": True,
        "max_local_cpu_size": float(cpu_gb),
        "local_disk": f"file://{disk}/",
        "max_local_disk_size": float(disk_gb),
        "remote_url": f"mooncakestore://{host}:{mooncake_rpc_port}/",
        "remote_serde": "naive",
        "pre_caching_hash_algorithm": "sha256_cbor",
        "save_unfull_chunk": False,
    }
    extra: dict[str, Any] = {
        "local_hostname": host,
        "metadata_server": f"http://{host}:{mooncake_http_port}/metadata",
        "master_server_address": f"{host}:{mooncake_rpc_port}",
        "mooncake_master_server_addr": f"{host}:{mooncake_rpc_port}",
        "protocol": "tcp",
        "global_segment_size": 0,
        "local_buffer_size": local_buffer_bytes,
        "save_chunk_meta": True,
    }
    lines = [f"{k}: {_yaml_scalar(v)}" for k, v in top.items()]
    lines.append("extra_config:")
    lines += [f"  {k}: {_yaml_scalar(v)}" for k, v in extra.items()]
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    env = {"LMCACHE_CONFIG_FILE": str(out.resolve())}
    kv_transfer_config = {
        "kv_connector": CONNECTOR_CLASS,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": role,
        # vLLM's default "fail" ends a request whose KV load came back short (e.g. the
        # Mooncake segment died after lookup); recompute the missing blocks instead.
        "kv_load_failure_policy": "recompute",
    }
    return env, kv_transfer_config


def lmcache_transfer_config(config: Any, role: str, work_dir: Path) -> dict[str, Any]:
    """The vllm engine's LMCache settings (``workers.vllm_config.VllmEngineConfig``) as an
    LMCache config file in ``work_dir`` plus vLLM's ``kv_transfer_config``; the file's path
    is what ``lmcache_environment`` puts in the engine's environment."""
    from urllib.parse import urlsplit

    host, _, rpc = config.mooncake.master.rpartition(":")
    metadata = urlsplit(config.mooncake.metadata_server)
    if not rpc.isdigit() or metadata.port is None:
        raise ValueError(
            f"LMCache needs host:port for the Mooncake master and a metadata URL with a port, "
            f"got {config.mooncake.master!r} and {config.mooncake.metadata_server!r}"
        )
    lm = config.lmcache
    # One disk folder per engine: LMCache names files by content, and two engines sharing a
    # folder would each index only their own writes.
    disk = Path(lm.disk_dir) / work_dir.name if lm.disk_dir else work_dir / "lmcache-disk"
    _env, transfer = write_lmcache_config(
        work_dir / "lmcache.yaml",
        role=config.kv_role(role),
        block_size=config.block_size,
        chunk_blocks=1,
        cpu_gb=lm.local_cpu_bytes / (1 << 30),
        disk_dir=disk,
        disk_gb=lm.disk_bytes / (1 << 30),
        mooncake_rpc_port=int(rpc),
        mooncake_http_port=metadata.port,
        host=host or "127.0.0.1",
        local_buffer_bytes=config.mooncake.local_buffer_bytes,
    )
    return transfer


def lmcache_environment(work_dir: Path) -> dict[str, str | None]:
    """LMCache reads its file from ``LMCACHE_CONFIG_FILE`` and would prefer vLLM's Mooncake
    file if ``MOONCAKE_CONFIG_PATH`` were set: that one is removed."""
    return {"LMCACHE_CONFIG_FILE": str((work_dir / "lmcache.yaml").resolve()), "MOONCAKE_CONFIG_PATH": None}
