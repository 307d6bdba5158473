"""The ``switchyard`` command: the composition root, where flags become config trees.

    switchyard up          the whole stack on this machine (private nats-server)
    switchyard ingress     the HTTP API
    switchyard scheduler   admission and placement
    switchyard worker      a prefill or decode worker (--role, --engine)
    switchyard bench ...   benchmarks

Each service takes ``--nats URL`` so it can run as its own process against any NATS
cluster. Nothing below this module reads flags or the environment.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio

DEFAULT_NATS = "nats://127.0.0.1:4222"
BUNDLED_MODEL = Path(__file__).parent / "models" / "sim-tiny"
VLLM_DEFAULT_HASH_SEED = "vllm-none-hash"  # kvbus.keys's; not imported here to keep start-up light


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="switchyard", description="Disaggregated LLM serving over NATS.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    up = sub.add_parser("up", help="run the whole stack on this machine")
    _add_common(up, nats_default=None)
    up.add_argument("--engine", choices=["sim", "vllm"], default="sim")
    up.add_argument("--prefill", type=_positive_int, default=1, help="prefill workers")
    up.add_argument("--decode", type=_positive_int, default=1, help="decode workers")
    up.add_argument(
        "--ready-timeout-s",
        type=float,
        default=None,
        help="default: 60 s, or 600 s for the vllm engine (engines boot in 30-90 s on a CPU host)",
    )
    up.add_argument(
        "--mooncake-segment-bytes",
        type=_positive_int,
        default=1 << 30,
        help="vllm: memory the Mooncake Store's segment process lends the store",
    )
    up.add_argument(
        "--mooncake-external",
        action="store_true",
        help="vllm: use the Mooncake Store named by --mooncake-master instead of starting one",
    )
    up.add_argument(
        "--max-restarts",
        type=int,
        default=5,
        help="restarts of a crashed child before the stack stops (0: stop at the first crash)",
    )
    _add_ingress_options(up)
    _add_scheduler_options(up)
    _add_worker_options(up)

    ingress = sub.add_parser("ingress", help="the OpenAI-compatible HTTP API")
    _add_common(ingress)
    _add_ingress_options(ingress)

    scheduler = sub.add_parser("scheduler", help="admission and placement")
    _add_common(scheduler)
    _add_scheduler_options(scheduler)

    worker = sub.add_parser("worker", help="a prefill or decode worker")
    _add_common(worker)
    worker.add_argument("--role", choices=["prefill", "decode"], required=True)
    worker.add_argument("--engine", choices=["sim", "vllm"], default="sim")
    worker.add_argument("--worker-id", default="")
    worker.add_argument("--model", type=Path, default=BUNDLED_MODEL, help="model directory")
    worker.add_argument("--block-size", type=_positive_int, default=None, help="default: 16 (sim), 32 (vllm)")
    worker.add_argument(
        "--served-model-name", default="", help="the model's name on the bus (default: its directory's)"
    )
    _add_worker_options(worker)

    tiny = sub.add_parser("build-tiny-model", help="build the tiny Llama (seeded weights) that vLLM serves in tests")
    tiny.add_argument("directory", type=Path)
    tiny.add_argument("--force", action="store_true", help="rebuild even if the directory holds it already")

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
    from switchyard.bench import kv, live, overhead, sim

    for name, module, help_ in (
        ("overhead", overhead, "what the fabric adds: TTFT, stream throughput, memory"),
        ("sim", sim, "replay a trace through the scheduler core over a simulated fleet"),
        ("live", live, "replay a trace, time-scaled, through the running system and beside its simulation"),
        ("kv", kv, "vllm: TTFT with the prefix loaded from LMCache/Mooncake vs recomputed, and raw Mooncake"),
    ):
        module.add_arguments(bench_sub.add_parser(name, help=help_))
    return parser


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def _add_common(p: argparse.ArgumentParser, nats_default: str | None = DEFAULT_NATS) -> None:
    help_ = "NATS server URL" + ("" if nats_default else " (default: start a private nats-server)")
    p.add_argument("--nats", default=nats_default, help=help_)
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--trace-exporter", default="none", choices=["none", "console", "otlp"])


def _add_ingress_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("ingress")
    if not any(a.dest == "model" for a in p._actions):
        g.add_argument("--model", type=Path, default=BUNDLED_MODEL, help="model directory")
    g.add_argument("--served-model-name", default="")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    if not any(a.dest == "block_size" for a in p._actions):
        g.add_argument(
            "--block-size",
            type=_positive_int,
            default=None,
            help="the engine's KV block size; default: 16 (sim), 32 (vllm)",
        )
    g.add_argument("--max-body-bytes", type=_positive_int, default=8 * 1024 * 1024)
    g.add_argument("--default-max-tokens", type=_positive_int, default=1024)
    g.add_argument("--stream-idle-timeout-s", type=float, default=60.0)
    g.add_argument(
        "--key-scheme",
        default="blake2b",
        choices=["blake2b", "vllm-sha256-cbor"],
        help="block-key hashing: the sim engine's, or a vLLM engine's",
    )
    if not any(a.dest == "hash_seed" for a in p._actions):
        g.add_argument(
            "--hash-seed",
            default=VLLM_DEFAULT_HASH_SEED,
            help="vllm: the root of the engine's block hashes (an integer, or the default)",
        )


def _add_scheduler_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("scheduler")
    g.add_argument("--max-queued-tokens", type=_positive_int, default=262_144)
    g.add_argument("--worker-expiry-s", type=float, default=2.0)
    g.add_argument(
        "--policy",
        default="switchyard",
        choices=["round_robin", "least_requests", "least_tokens", "prefix", "switchyard"],
        help="prefill placement policy",
    )
    g.add_argument(
        "--local-prefill-max-tokens",
        type=int,
        default=0,
        help="prompts with at most this many uncached tokens prefill on their decode worker",
    )
    g.add_argument("--session-ttl-s", type=float, default=600.0)
    g.add_argument(
        "--session-max-load",
        type=float,
        default=0.8,
        help="a session follows its worker only below this share of the worker's budget",
    )


def _add_worker_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("worker")
    g.add_argument("--token-budget", type=_positive_int, default=65_536)
    g.add_argument("--report-interval-s", type=float, default=0.5)
    g.add_argument(
        "--min-publish-interval-s",
        type=float,
        default=0.001,
        help="decode: steps faster than this share one bus message",
    )
    g.add_argument("--sim-prefill-base-s", type=float, default=0.0)
    g.add_argument("--sim-prefill-per-token-s", type=float, default=0.0)
    g.add_argument("--sim-decode-step-base-s", type=float, default=0.0)
    g.add_argument("--sim-decode-step-per-seq-s", type=float, default=0.0)
    g.add_argument("--sim-cache-blocks", type=_positive_int, default=4096)
    g.add_argument(
        "--sim-host-cache-blocks",
        type=int,
        default=0,
        help="a host-memory tier below the device prefix cache (0: none)",
    )
    g.add_argument("--sim-host-fetch-per-token-s", type=float, default=0.0)
    v = p.add_argument_group("vllm engine")
    v.add_argument(
        "--kv-transfer",
        default="mooncake-store",
        choices=["mooncake-store", "lmcache", "nixl", "none"],
        help="how KV moves from prefill to decode",
    )
    v.add_argument("--dtype", default="auto")
    v.add_argument("--max-model-len", type=_positive_int, default=None)
    v.add_argument("--max-num-seqs", type=_positive_int, default=None)
    v.add_argument(
        "--kv-cache-bytes", type=_positive_int, default=None, help="the engine's KV cache size (needed on CPU hosts)"
    )
    v.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    v.add_argument("--enforce-eager", action="store_true", help="skip compilation: faster boot, slower steps")
    v.add_argument("--seed", type=int, default=0)
    if not any(a.dest == "hash_seed" for a in p._actions):
        v.add_argument("--hash-seed", default=VLLM_DEFAULT_HASH_SEED)
    v.add_argument("--tensor-parallel-size", type=_positive_int, default=1)
    v.add_argument("--pipeline-parallel-size", type=_positive_int, default=1)
    v.add_argument("--data-parallel-size", type=_positive_int, default=1)
    v.add_argument("--enable-expert-parallel", action="store_true")
    v.add_argument(
        "--speculative-method",
        default=None,
        choices=["ngram", "eagle", "eagle3", "draft_model", "mtp"],
        help="decode workers: speculative decoding",
    )
    v.add_argument("--speculative-model", default=None, help="the draft model (eagle, eagle3, draft_model)")
    v.add_argument("--num-speculative-tokens", type=_positive_int, default=3)
    v.add_argument("--mooncake-master", default="127.0.0.1:50051")
    v.add_argument("--mooncake-metadata-server", default="http://127.0.0.1:8080/metadata")
    v.add_argument("--lmcache-local-cpu-bytes", type=_positive_int, default=512 << 20)
    v.add_argument("--lmcache-disk-dir", default="", help="LMCache's disk tier (empty: none)")
    v.add_argument("--lmcache-disk-bytes", type=_positive_int, default=2 << 30)
    v.add_argument(
        "--handoff-timeout-s",
        type=float,
        default=10.0,
        help="prefill: the longest PrefillDone waits for the KV to be in the store",
    )
    v.add_argument("--vllm-work-dir", default="", help="config files and sockets (default: a temporary directory)")


# --- config trees -------------------------------------------------------------------------


def ingress_config(args: argparse.Namespace, nats_url: str):
    from switchyard.ingress.config import IngressConfig

    return IngressConfig(
        nats_url=nats_url,
        model_dir=str(args.model),
        served_model_name=args.served_model_name,
        host=args.host,
        port=args.port,
        block_size=args.block_size,
        key_scheme=args.key_scheme,
        hash_seed=args.hash_seed,
        max_body_bytes=args.max_body_bytes,
        default_max_tokens=args.default_max_tokens,
        stream_idle_timeout_s=args.stream_idle_timeout_s,
        trace_exporter=args.trace_exporter,
    )


def scheduler_config(args: argparse.Namespace, nats_url: str):
    from switchyard.scheduler.config import SchedulerConfig
    from switchyard.scheduler.service import SchedulerServiceConfig

    core = SchedulerConfig(
        max_queued_tokens=args.max_queued_tokens,
        worker_expiry_s=args.worker_expiry_s,
        policy=args.policy,
        local_prefill_max_tokens=args.local_prefill_max_tokens,
        session_ttl_s=args.session_ttl_s,
        session_max_load=args.session_max_load,
    )
    return SchedulerServiceConfig(nats_url=nats_url, core=core)


def worker_config(args: argparse.Namespace, nats_url: str):
    from switchyard.ingress.tokenizer import ModelTokenizer
    from switchyard.workers.config import WorkerConfig
    from switchyard.workers.sim import SimCostModel, SimEngineConfig

    tokenizer = ModelTokenizer.load(args.model)
    ordinary = tokenizer.sample_token_ids()
    # Single-byte tokens decode to broken UTF-8 on their own; draw from merged ones.
    low = 256 if len(ordinary) > 512 else ordinary.start
    cost = SimCostModel(
        prefill_base_s=args.sim_prefill_base_s,
        prefill_per_token_s=args.sim_prefill_per_token_s,
        decode_step_base_s=args.sim_decode_step_base_s,
        decode_step_per_seq_s=args.sim_decode_step_per_seq_s,
        host_fetch_per_token_s=args.sim_host_fetch_per_token_s,
    )
    sim = SimEngineConfig(
        cost=cost,
        cache_blocks=args.sim_cache_blocks,
        host_cache_blocks=args.sim_host_cache_blocks,
        token_low=low,
        token_high=ordinary.stop,
    )
    return WorkerConfig(
        nats_url=nats_url,
        role=args.role,
        model=args.served_model_name or tokenizer.info.name,
        engine=args.engine,
        model_path=str(args.model),
        worker_id=args.worker_id,
        block_size=args.block_size,
        token_budget=args.token_budget,
        report_interval_s=args.report_interval_s,
        min_publish_interval_s=args.min_publish_interval_s,
        sim=sim,
        vllm=vllm_config(args),
    )


def vllm_config(args: argparse.Namespace):
    from switchyard.workers.vllm_config import (
        LmcacheSettings,
        MooncakeSettings,
        ParallelSettings,
        SpeculativeSettings,
        VllmEngineConfig,
    )

    speculative = None
    if args.speculative_method:
        speculative = SpeculativeSettings(
            method=args.speculative_method,
            model=args.speculative_model,
            num_speculative_tokens=args.num_speculative_tokens,
        )
    return VllmEngineConfig(
        kv_transfer=args.kv_transfer,
        block_size=args.block_size,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        kv_cache_bytes=args.kv_cache_bytes,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=args.enforce_eager,
        seed=args.seed,
        hash_seed=args.hash_seed,
        speculative=speculative,
        work_dir=args.vllm_work_dir,
        handoff_timeout_s=args.handoff_timeout_s,
        parallel=ParallelSettings(
            tensor=args.tensor_parallel_size,
            pipeline=args.pipeline_parallel_size,
            data=args.data_parallel_size,
            expert=args.enable_expert_parallel,
        ),
        mooncake=MooncakeSettings(master=args.mooncake_master, metadata_server=args.mooncake_metadata_server),
        lmcache=LmcacheSettings(
            local_cpu_bytes=args.lmcache_local_cpu_bytes,
            disk_dir=args.lmcache_disk_dir,
            disk_bytes=args.lmcache_disk_bytes,
        ),
    )


# --- running a service ------------------------------------------------------------------------


def run_service(run: Callable[..., Awaitable[None]]) -> None:
    """Run one service until it ends or SIGTERM/SIGINT arrives; then stop it cleanly."""

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_cancel_on_signal, tg.cancel_scope)
            await run()
            tg.cancel_scope.cancel()

    # uvloop where installed (a declared dependency on Linux): about half the per-hop cost.
    anyio.run(main, backend_options={"use_uvloop": _has_uvloop()})


def _has_uvloop() -> bool:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True


async def _cancel_on_signal(scope: anyio.CancelScope) -> None:
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            logging.getLogger("switchyard").info("received %s, stopping", signal.Signals(signum).name)
            scope.cancel()
            return


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _main(args)
    except _STARTUP_ERRORS as exc:
        print(f"switchyard {args.command}: error: {exc}", file=sys.stderr, flush=True)
        return 2


def _startup_errors() -> tuple[type[Exception], ...]:
    from switchyard.ingress.service import ServiceError
    from switchyard.ingress.tokenizer import TokenizerError
    from switchyard.observability.tracing import TracingError

    return (ServiceError, TokenizerError, TracingError, ValueError)


_STARTUP_ERRORS = _startup_errors()


def resolve_defaults(args: argparse.Namespace) -> None:
    """Defaults that depend on the engine: vLLM's CPU backend takes blocks of 32 and up."""
    vllm = getattr(args, "engine", "sim") == "vllm" or getattr(args, "key_scheme", "") == "vllm-sha256-cbor"
    if getattr(args, "block_size", 0) is None:
        args.block_size = 32 if vllm else 16
    if getattr(args, "ready_timeout_s", 0) is None:
        args.ready_timeout_s = 600.0 if vllm else 60.0
    if getattr(args, "engine", "sim") == "vllm" and Path(args.model) == BUNDLED_MODEL:
        raise ValueError(
            "the vllm engine needs a model directory (--model DIR); `switchyard build-tiny-model DIR` builds a tiny one"
        )


def _main(args: argparse.Namespace) -> int:
    resolve_defaults(args)
    logging.basicConfig(
        level=getattr(args, "log_level", "warning").upper(),
        format=f"%(asctime)s {args.command:<9} %(levelname)-7s %(name)s: %(message)s",
    )
    from switchyard.observability import tracing

    tracing.configure(f"switchyard-{args.command}", getattr(args, "trace_exporter", "none"))
    match args.command:
        case "up":
            from switchyard.up import up

            return up(args, sys.argv[0])
        case "ingress":
            from switchyard.ingress.service import IngressService

            run_service(IngressService(ingress_config(args, args.nats)).run)
        case "scheduler":
            from switchyard.scheduler.service import SchedulerService

            run_service(SchedulerService(scheduler_config(args, args.nats)).run)
        case "worker":
            from switchyard.workers import build_worker

            run_service(build_worker(worker_config(args, args.nats)).run)
        case "build-tiny-model":
            from switchyard.tiny_model import main as build

            return build(str(args.directory), force=args.force)
        case "bench":
            from importlib import import_module

            return import_module(f"switchyard.bench.{args.bench}").run(args)
    return 0
