"""The vllm engine's settings: what reaches vLLM's engine arguments, and what is refused
before an engine ever boots. Pure: vLLM is not imported."""

from __future__ import annotations

import json

import pytest

from switchyard import settings
from switchyard.ingress.config import IngressConfig
from switchyard.workers.config import WorkerConfig
from switchyard.workers.vllm_config import (
    MooncakeSettings,
    ParallelSettings,
    SpeculativeSettings,
    VllmEngineConfig,
)


def test_mooncake_store_is_the_default_transfer_with_recompute_on_failed_loads(tmp_path) -> None:
    config = VllmEngineConfig()
    prefill = config.engine_args("m", "prefill", tmp_path, "ipc:///x")
    decode = config.engine_args("m", "decode", tmp_path, None)
    assert prefill["kv_transfer_config"] == {
        "kv_connector": "MooncakeStoreConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
    }
    assert decode["kv_transfer_config"]["kv_role"] == "kv_consumer"
    assert prefill["prefix_caching_hash_algo"] == "sha256_cbor" and prefill["enable_prefix_caching"]
    assert prefill["kv_events_config"] == {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "ipc:///x",
        "topic": "kv",
    }
    assert "kv_events_config" not in decode


def test_nixl_and_none(tmp_path) -> None:
    nixl = VllmEngineConfig(kv_transfer="nixl").engine_args("m", "decode", tmp_path, None)
    assert nixl["kv_transfer_config"]["kv_connector"] == "NixlConnector"
    # A handoff that never comes: the prefill's blocks are freed when vLLM's lease runs out.
    assert nixl["kv_transfer_config"]["kv_connector_extra_config"] == {"kv_lease_duration": 30}
    leased = VllmEngineConfig(kv_transfer="nixl", nixl_kv_lease_s=5).engine_args("m", "prefill", tmp_path, None)
    from vllm.config import KVTransferConfig

    config = KVTransferConfig(**leased["kv_transfer_config"])
    assert config.get_from_extra_config("kv_lease_duration", 30) == 5
    assert "kv_transfer_config" not in VllmEngineConfig(kv_transfer="none").engine_args("m", "decode", tmp_path, None)


def test_sizes_and_parallelism_pass_through(tmp_path) -> None:
    config = VllmEngineConfig(
        block_size=64,
        dtype="float32",
        max_model_len=8192,
        max_num_seqs=8,
        kv_cache_bytes=1 << 26,
        enforce_eager=True,
        seed=3,
        parallel=ParallelSettings(tensor=2, pipeline=2, data=2, expert=True),
    )
    args = config.engine_args("/models/k2", "decode", tmp_path, None)
    assert args | {} == args  # a plain dict
    expected = {
        "model": "/models/k2",
        "block_size": 64,
        "dtype": "float32",
        "max_model_len": 8192,
        "max_num_seqs": 8,
        "kv_cache_memory_bytes": 1 << 26,
        "enforce_eager": True,
        "seed": 3,
        "tensor_parallel_size": 2,
        "pipeline_parallel_size": 2,
        "data_parallel_size": 2,
        "enable_expert_parallel": True,
    }
    assert {k: args[k] for k in expected} == expected


def test_speculation_goes_to_decode_engines_only(tmp_path) -> None:
    spec = SpeculativeSettings(method="ngram", num_speculative_tokens=4, prompt_lookup_max=3)
    config = VllmEngineConfig(speculative=spec)
    assert config.engine_args("m", "decode", tmp_path, None)["speculative_config"] == {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "prompt_lookup_max": 3,
        "prompt_lookup_min": 1,
    }
    assert "speculative_config" not in config.engine_args("m", "prefill", tmp_path, None)
    eagle = SpeculativeSettings(method="eagle3", model="/drafts/eagle3", num_speculative_tokens=2)
    assert eagle.engine_config() == {"method": "eagle3", "num_speculative_tokens": 2, "model": "/drafts/eagle3"}


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: VllmEngineConfig(block_size=20), "multiple of 16"),
        (lambda: VllmEngineConfig(hash_seed="not-a-number"), "hash_seed"),
        (lambda: VllmEngineConfig(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
        (lambda: VllmEngineConfig(kv_cache_bytes=0), "kv_cache_bytes"),
        (lambda: ParallelSettings(tensor=0), "tensor parallel size"),
        (lambda: ParallelSettings(expert=True), "expert parallelism"),
        (lambda: SpeculativeSettings(method="eagle3"), "needs a draft model"),
        (lambda: SpeculativeSettings(method="ngram", model="/d"), "takes no draft model"),
        (lambda: SpeculativeSettings(method="ngram", num_speculative_tokens=0), "num_speculative_tokens"),
        (lambda: SpeculativeSettings(method="ngram", prompt_lookup_min=5, prompt_lookup_max=2), "prompt_lookup"),
    ],
)
def test_bad_settings_are_refused_with_their_name(build, message) -> None:
    with pytest.raises(ValueError, match=message):
        build()


def test_an_engine_spanning_more_devices_than_the_host_has_is_refused() -> None:
    parallel = ParallelSettings(tensor=4, pipeline=2)
    parallel.check_devices(8)
    parallel.check_devices(0)  # a CPU host: vLLM's CPU backend decides
    with pytest.raises(ValueError, match="8 devices, but this host has 4"):
        parallel.check_devices(4)


def test_environment_roots_the_hashes_and_names_the_mooncake_store(tmp_path) -> None:
    config = VllmEngineConfig(
        mooncake=MooncakeSettings(master="10.0.0.5:50051", metadata_server="http://10.0.0.5:8080/metadata")
    )
    env = config.environment(tmp_path)
    assert env["PYTHONHASHSEED"] is None  # vLLM's fixed default root; an inherited seed must not leak in
    store = json.loads((tmp_path / "mooncake.json").read_text())
    assert env["MOONCAKE_CONFIG_PATH"] == str(tmp_path / "mooncake.json")
    assert store["master_server_address"] == "10.0.0.5:50051" and store["mode"] == "standalone-store"
    assert store["global_segment_size"] == 0 and store["protocol"] == "tcp"
    assert VllmEngineConfig(hash_seed="42").environment(tmp_path)["PYTHONHASHSEED"] == "42"
    assert "MOONCAKE_CONFIG_PATH" not in VllmEngineConfig(kv_transfer="nixl").environment(tmp_path)


def test_worker_config_checks_the_engine_and_ingress_agree_on_blocks() -> None:
    with pytest.raises(ValueError, match="model_path"):
        WorkerConfig(nats_url="nats://x", role="prefill", model="m", engine="vllm")
    with pytest.raises(ValueError, match="block_size 16 differs"):
        WorkerConfig(nats_url="nats://x", role="prefill", model="m", engine="vllm", model_path="/m", block_size=16)


def _worker_from_flags(*flags: str) -> WorkerConfig:
    from switchyard import cli

    args = cli.build_parser().parse_args(["worker", *flags])
    defaults = settings.engine_defaults("vllm")
    return settings.resolve(WorkerConfig, cli.sources_of(args, env={}), "worker", defaults=defaults).config


def test_cli_flags_build_the_engine_config() -> None:
    config = _worker_from_flags(
        *("--role", "decode", "--engine", "vllm", "--model", "/m", "--block-size", "64"),
        *("--kv-transfer", "lmcache", "--tensor-parallel-size", "2", "--enable-expert-parallel"),
        *("--speculative-method", "ngram", "--num-speculative-tokens", "5", "--kv-cache-bytes", "1048576"),
        *("--mooncake-master", "h:1", "--lmcache-disk-dir", "/nvme/lmcache"),
    ).vllm
    assert config.kv_transfer == "lmcache" and config.block_size == 64 and config.kv_cache_bytes == 1 << 20
    assert config.parallel == ParallelSettings(tensor=2, expert=True)
    assert config.speculative == SpeculativeSettings(method="ngram", num_speculative_tokens=5)
    assert config.mooncake.master == "h:1" and config.lmcache.disk_dir == "/nvme/lmcache"


def test_a_speculation_setting_without_its_method_is_an_error_not_ignored() -> None:
    with pytest.raises(settings.ConfigError, match="num-speculative-tokens need --speculative-method"):
        _worker_from_flags("--role", "decode", "--engine", "vllm", "--model", "/m", "--num-speculative-tokens", "5")
    assert _worker_from_flags("--role", "decode", "--engine", "vllm", "--model", "/m").vllm.speculative is None


def test_up_passes_the_engine_settings_to_every_worker(tmp_path) -> None:
    from switchyard.bench.stack import up_plan
    from switchyard.up import child_spec

    model = tiny_tokenizer_dir(tmp_path)
    plan = up_plan(
        *("--engine", "vllm", "--model", str(model), "--kv-transfer", "lmcache", "--speculative-method", "ngram"),
        *("--enforce-eager", "--kv-cache-bytes", "1048576", "--dtype", "float32", "--block-size", "32"),
    )
    children = {c.name: c for c in plan.children}
    for name in ("prefill-0", "decode-0"):
        command, env = child_spec(children[name], "nats://127.0.0.1:4222")
        assert command[-2:] == ["--child", name]  # its configuration travels as data, not as flags
        _, worker = settings.decode_child(env[settings.CONFIG_DATA_ENV], WorkerConfig)
        assert (worker.engine, worker.vllm.kv_transfer, worker.vllm.speculative.method) == ("vllm", "lmcache", "ngram")
        assert worker.vllm.enforce_eager and worker.vllm.kv_cache_bytes == 1 << 20 and worker.vllm.dtype == "float32"
        assert worker.block_size == worker.vllm.block_size == 32 and worker.nats_url == "nats://127.0.0.1:4222"
    _, ingress = settings.decode_child(
        child_spec(children["ingress"], "nats://x:1")[1][settings.CONFIG_DATA_ENV], IngressConfig
    )
    assert ingress.key_scheme == "vllm-sha256-cbor" and ingress.block_size == 32


def tiny_tokenizer_dir(tmp_path):
    """A model directory holding only the bundled tokenizer: enough for the settings."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(settings.BUNDLED_MODEL, model)
    return model


def test_the_vllm_engine_without_a_model_directory_is_a_clear_error(capsys) -> None:
    from switchyard.cli import main

    assert main(["up", "--engine", "vllm"]) == 2
    assert "build-tiny-model" in capsys.readouterr().err
