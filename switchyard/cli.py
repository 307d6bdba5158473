"""The ``switchyard`` command: the composition root, where sources become config trees.

    switchyard up            the whole stack on this machine (private nats-server)
    switchyard ingress       the HTTP API
    switchyard scheduler     admission and placement
    switchyard worker        a prefill, decode or colocated worker (--role, --engine)
    switchyard batch-runner  runs batch lines while the fleet has headroom
    switchyard config show   the effective configuration of every service, and its sources
    switchyard keys ...      API keys for --auth keys: create, list, revoke
    switchyard nats-auth     NATS users, one per role, and their permissions (--out DIR)
    switchyard nats-config   a region's nats-server configuration (supercluster, leaf node)
    switchyard wan-relay     an emulated WAN before a region's gateway (per-pair round trips)
    switchyard usage         the usage records on JetStream, summarised by tenant
    switchyard batch ...     the Batch API: submit FILE [--wait], list, status, cancel
    switchyard bench ...     benchmarks

Every setting's flag is derived from its declaration on the config trees
(``switchyard.settings``); the same setting can come from ``SWITCHYARD_*`` variables or a
TOML file (``--config FILE``). Nothing below this module reads flags or the environment.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import msgspec

from switchyard import settings
from switchyard.ingress import BatchRunnerConfig, IngressConfig
from switchyard.scheduler import SchedulerServiceConfig
from switchyard.schemas import SwitchyardError
from switchyard.settings import ConfigError, ProcessConfig, Sources
from switchyard.workers import WorkerConfig

BUNDLED_MODEL = settings.BUNDLED_MODEL


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="switchyard", description="Disaggregated LLM serving over NATS.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, help_ in (
        ("up", "run the whole stack on this machine"),
        ("ingress", "the OpenAI-compatible HTTP API"),
        ("scheduler", "admission and placement"),
        ("worker", "a prefill, decode or colocated worker"),
        ("batch-runner", "runs batch lines (the Batch API, JobSubmit) while the fleet has headroom"),
    ):
        add_command_flags(sub.add_parser(name, help=help_), name)

    config = sub.add_parser("config", help="the effective configuration")
    config_sub = config.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    show = config_sub.add_parser("show", help="print every service's configuration as `up` would start it")
    add_command_flags(show, "up")
    show.add_argument("--json", action="store_true", help="the whole config trees, as JSON")

    from switchyard import keys

    keys.add_arguments(sub.add_parser("keys", help="API keys for --auth keys: create, list, revoke"))
    from switchyard import nats_auth

    nats_auth.add_arguments(
        sub.add_parser("nats-auth", help="NATS users and permissions for a deployment: server config, credentials")
    )

    from switchyard import nats_config, wan

    nats_config.add_arguments(
        sub.add_parser("nats-config", help="a region's nats-server configuration: gateways, accounts, leaf nodes")
    )
    wan.add_arguments(sub.add_parser("wan-relay", help="relay a region's gateway port with per-pair round trips"))

    from switchyard import batch_cli

    batch_cli.add_arguments(sub.add_parser("batch", help="the Batch API: submit a file (--wait), list, status, cancel"))
    from switchyard import usage

    usage.add_arguments(sub.add_parser("usage", help="the usage records on JetStream, by tenant (cached share too)"))

    tiny = sub.add_parser("build-tiny-model", help="build the tiny Llama (seeded weights) that vLLM serves in tests")
    tiny.add_argument("directory", type=Path)
    tiny.add_argument("--force", action="store_true", help="rebuild even if the directory holds it already")

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
    from switchyard.bench import (
        batch,
        bound,
        chaos,
        federation,
        kv,
        live,
        matrix,
        overhead,
        scheduler_bench,
        sim,
        synth,
    )

    for name, module, help_ in (
        ("overhead", overhead, "what the fabric adds: TTFT, stream throughput, memory"),
        ("sim", sim, "replay a trace through the scheduler core over a simulated fleet"),
        ("matrix", matrix, "bench sim --sweep on every trace, fleet shape and cache; switchyard vs the best peer"),
        ("synth", synth, "write a seeded Mooncake-format trace of a shape we have no real trace of"),
        ("bound", bound, "the most goodput a trace's decode workers can give, whatever the placement (cost model)"),
        ("live", live, "replay a trace, time-scaled, through the running system and beside its simulation"),
        ("kv", kv, "vllm: TTFT with the prefix loaded from LMCache/Mooncake vs recomputed, and raw Mooncake"),
        ("chaos", chaos, "kill workers, the active scheduler and nats-server under load; compare every output"),
        ("batch", batch, "an interactive trace alone, then beside a large batch: does the batch fill only troughs?"),
        ("federation", federation, "region policies side by side, one region killed halfway; simulated and live"),
        ("scheduler", scheduler_bench, "the decision core alone at 1,000 workers: decisions/s, p99, index bytes"),
    ):
        module.add_arguments(bench_sub.add_parser(name, help=help_))
    return parser


def add_command_flags(parser: argparse.ArgumentParser, command: str) -> None:
    settings.add_command_flags(parser, command)
    if command in ("ingress", "scheduler", "worker", "batch-runner"):
        parser.add_argument("--child", metavar="NAME", default=None, help=argparse.SUPPRESS)


def sources_of(args: argparse.Namespace, env: Any = None) -> Sources:
    """What this command was told, checked for names no service knows."""
    sources = Sources.load(settings.flags_given(args), settings.environ() if env is None else env, args.config)
    sources.check_known(settings.known_names())
    return sources


# --- resolving a service's tree ----------------------------------------------------------------


def service_config(command: str, sources: Sources) -> tuple[ProcessConfig, Any]:
    """The process and service trees of ``switchyard <command>`` run on its own."""
    process = settings.resolve(ProcessConfig, sources, command).config
    tree = settings.COMMAND_TREES[command][1]
    defaults = settings.engine_defaults(*settings.engine_hints(tree, sources, command))
    config = settings.resolve(tree, sources, command, defaults=defaults).config
    if isinstance(config, WorkerConfig):
        from switchyard.up import finish_worker

        config = finish_worker(config)
    return process, config


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
    except (SwitchyardError, ValueError) as exc:
        print(f"switchyard {args.command}: error: {exc}", file=sys.stderr, flush=True)
        return 2


def _setup_process(command: str, name: str, process: ProcessConfig) -> None:
    logging.basicConfig(
        level=process.log_level.upper(), format=f"%(asctime)s {name:<9} %(levelname)-7s %(name)s: %(message)s"
    )
    from switchyard.observability import tracing

    tracing.configure(f"switchyard-{command}", process.trace_exporter)


def _main(args: argparse.Namespace) -> int:
    match args.command:
        case "up":
            from switchyard import up

            plan = up.plan(sources_of(args))
            _setup_process("up", "up", plan.process)
            return up.up(plan)
        case "ingress" | "scheduler" | "worker" | "batch-runner":
            return _serve(args)
        case "config":
            from switchyard import up

            print(show(up.plan(sources_of(args)), as_json=args.json), end="")
            return 0
        case "keys":
            from switchyard import keys

            return keys.run(args)
        case "nats-auth":
            from switchyard import nats_auth

            return nats_auth.run(args)
        case "nats-config":
            from switchyard import nats_config

            return nats_config.run(args)
        case "wan-relay":
            from switchyard import wan

            return wan.run(args)
        case "usage":
            from switchyard import usage

            return usage.run(args)
        case "batch":
            from switchyard import batch_cli

            return batch_cli.run(args)
        case "build-tiny-model":
            from switchyard.tiny_model import main as build

            return build(str(args.directory), force=args.force)
        case "bench":
            from importlib import import_module

            result: int = import_module(f"switchyard.bench.{args.bench}").run(args)
            return result
    return 0


def _serve(args: argparse.Namespace) -> int:
    command: str = args.command
    data = settings.environ().get(settings.CONFIG_DATA_ENV) if args.child else None
    if args.child and data is None:
        raise ConfigError(f"--child {args.child}: no {settings.CONFIG_DATA_ENV} in the environment")
    if data is not None:
        if settings.flags_given(args) or args.config:
            raise ConfigError(f"--child {args.child}: a child takes its configuration as data, not as flags")
        process, config = settings.decode_child(data, settings.COMMAND_TREES[command][1])
    else:
        process, config = service_config(command, sources_of(args))
    _setup_process(command, args.child or command, process)
    match config:
        case IngressConfig():
            from switchyard.ingress import IngressService

            run_service(IngressService(config).run)
        case SchedulerServiceConfig():
            from switchyard.scheduler import SchedulerService

            run_service(SchedulerService(config).run)
        case WorkerConfig():
            from switchyard.workers import build_worker

            run_service(build_worker(config).run)
        case BatchRunnerConfig():
            from switchyard.ingress import BatchRunner

            run_service(BatchRunner(config).run)
    return 0


# --- config show --------------------------------------------------------------------------------


def show(plan: Any, as_json: bool = False) -> str:
    """Every service's settings as ``up`` would start them, each with its source."""
    if as_json:
        trees = {"up": plan.up, "process": plan.process} | {c.name: c.config for c in plan.children}
        return msgspec.json.format(msgspec.json.encode(trees)).decode() + "\n"
    out = [_table("up", plan.origin)]
    seen_worker_roles: set[str] = set()
    for child in plan.children:
        if child.command == "worker":
            role = child.name.rsplit("-", 1)[0]
            if role in seen_worker_roles:
                continue
            seen_worker_roles.add(role)
            count = sum(1 for c in plan.children if c.name.startswith(role + "-"))
            out.append(_table(f"worker: {role} (x{count})", child.origin))
        else:
            out.append(_table(child.name, child.origin))
    return "\n".join(out)


def _table(title: str, origin: dict[str, settings.Value]) -> str:
    lines = [f"[{title}]"]
    for name, value in origin.items():
        text = msgspec.json.encode(value.value).decode() if value.value is not None else "(unset)"
        lines.append(f"{name} = {text}".ljust(60) + f" # {value.source}")
    return "\n".join(lines) + "\n"
