"""``switchyard bench kv``: time to first token with the prompt's KV loaded from the
cluster cache against recomputing it, on real vLLM engines, beside raw Mooncake Store
put/get throughput measured in the same run.

For each KV path (``mooncake-store``: vLLM's MooncakeStoreConnector; ``lmcache``:
LMCacheConnectorV1 over the Mooncake Store) two engines run, as Switchyard's workers
run them (``workers.vllm_engine.VllmEngine``): a prefill engine that computes a prompt
and saves its KV, and a decode-side engine (``kv_consumer``) that then serves the same
prompt. For each prompt length, repeated with a fresh tenant each time (so nothing is in
any engine's own prefix cache):
- ``load``: the consumer's first token for a prompt the prefill engine just stored (once
  the store reports it written, as the prefill worker waits before handing over);
- ``recompute``: the consumer's first token for the same tokens under another tenant,
  which nothing has stored: it computes the whole prompt.
Loaded tokens come from the engine's own count (``num_cached_tokens``), so a silent
recompute shows as 0 loaded, never as a fast load. KV bytes moved per second is the
loaded tokens' KV size over the load's time to first token (a lower bound: that time
also computes the prompt's tail and samples).

The raw Mooncake figures put and get values of one KV block and of 4 MiB through the
store's Python client, into a registered buffer, against the same master and segment.

Run: ``switchyard bench kv --model DIR --out bench/results/kv`` (``make bench-kv``
builds the tiny model first). It prints a table and writes results.json and PNGs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from switchyard import procs
from switchyard.bench import plots
from switchyard.bench.stats import percentile

if TYPE_CHECKING:
    from switchyard.workers import KvTransfer


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, default=Path(".cache/tiny-llama"), help="a local model directory")
    p.add_argument("--out", type=Path, default=Path("bench/results/kv"), help="results folder")
    p.add_argument("--lengths", default="1024,4096,16384", help="prompt lengths, comma-separated")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--paths", default="mooncake-store,lmcache", help="KV paths to measure, comma-separated")
    p.add_argument("--raw-seconds", type=float, default=3.0, help="length of each raw Mooncake run")


def run(args: argparse.Namespace) -> int:
    from switchyard.tiny_model import build_tiny_model

    if args.model == Path(".cache/tiny-llama"):
        build_tiny_model(args.model)
    lengths = [int(x) for x in args.lengths.split(",")]
    paths = _kv_paths(args.paths)
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict = {
        "settings": {
            "lengths": lengths,
            "repeats": args.repeats,
            "paths": paths,
            "model": str(args.model),
            "cpus": os.cpu_count(),
        },
        "ttft": [],
        "raw": [],
    }
    with ExitStack() as stack:
        store = stack.enter_context(procs.mooncake_store(segment_bytes=2 << 30))
        print(f"Mooncake master {store.ports.master_address}, segment of 2 GiB", flush=True)
        results["raw"] = raw_mooncake(store.ports, args.raw_seconds)
        for path in paths:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=f"bench-kv-{path}-")))
            results["ttft"] += asyncio.run(ttft_rows(args.model, path, store.ports, lengths, args.repeats, work))
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    print_table(results)
    plot(results, args.out)
    print(f"results: {args.out}/results.json, ttft.png, throughput.png", flush=True)
    return 0


def _kv_paths(arg: str) -> list[KvTransfer]:
    """``--paths``, each one checked before any process starts."""
    from switchyard.workers import KvTransfer

    try:
        return msgspec.convert([p for p in arg.split(",") if p], list[KvTransfer])
    except msgspec.ValidationError as exc:
        raise SystemExit(f"--paths {arg!r}: {exc}") from None


# --- TTFT: load against recompute ----------------------------------------------------


def _engine_config(path: KvTransfer, ports: procs.MooncakePorts, work: Path, role: str, max_len: int):
    from switchyard.workers import LmcacheSettings, MooncakeSettings, VllmEngineConfig

    return VllmEngineConfig(
        kv_transfer=path,
        dtype="float32",
        enforce_eager=True,
        kv_cache_bytes=96 << 20,
        max_model_len=max_len,
        work_dir=str(work / role),
        mooncake=MooncakeSettings(master=ports.master_address, metadata_server=ports.metadata_server),
        lmcache=LmcacheSettings(disk_dir=str(work / "lmcache-disk")),
    )


async def ttft_rows(model: Path, path: KvTransfer, ports, lengths: list[int], repeats: int, work: Path) -> list[dict]:
    from switchyard.workers import VllmEngine

    max_len = max(lengths) + 64
    producer = VllmEngine(_engine_config(path, ports, work, "prefill", max_len), str(model), "prefill", "bench-p")
    consumer = VllmEngine(_engine_config(path, ports, work, "decode", max_len), str(model), "decode", "bench-d")
    print(f"[{path}] booting two engines", flush=True)
    async with producer.serving(), consumer.serving():
        print(f"[{path}] engines ready in {producer.boot_s:.0f} s and {consumer.boot_s:.0f} s", flush=True)
        return await _measure(producer, consumer, path, lengths, repeats, _kv_bytes_per_token(model))


async def _measure(producer, consumer, path: KvTransfer, lengths: list[int], repeats: int, kv_bytes_per_token: int):
    """Per length and repeat: TTFT with the prefix loaded through the connector, and recomputed."""
    rows = []
    await consumer.prefill([_task([5, 6, 7] * 20, "warm-up")])  # first-call costs out of the figures
    for length in lengths:
        prompt = [256 + (i * 7919) % 3800 for i in range(length)]
        for r in range(repeats):
            tenant = f"{path}-{length}-{r}-{time.time_ns()}"
            stored = _task(prompt, tenant)
            await producer.wait_handoff([stored], await producer.prefill([stored]))  # as a prefill worker does
            (loaded,) = await consumer.prefill([_task(prompt, tenant)])
            (computed,) = await consumer.prefill([_task(prompt, tenant + "-cold")])
            kv_bytes = loaded.cached_tokens * kv_bytes_per_token
            rows.append(
                {
                    "path": path,
                    "length": length,
                    "repeat": r,
                    "load_ttft_s": loaded.prefill_s,
                    "loaded_tokens": loaded.cached_tokens,
                    "recompute_ttft_s": computed.prefill_s,
                    "recompute_cached_tokens": computed.cached_tokens,
                    "kv_bytes": kv_bytes,
                    "kv_gib_per_s": kv_bytes / loaded.prefill_s / (1 << 30),
                }
            )
            print(
                f"[{path}] {length:>6} tokens #{r}: load {loaded.prefill_s * 1000:8.1f} ms "
                f"({loaded.cached_tokens} loaded), recompute {computed.prefill_s * 1000:8.1f} ms",
                flush=True,
            )
    return rows


def _task(prompt: list[int], tenant: str):
    from switchyard.schemas import PrefillTask, RequestSpec, SamplingParams

    spec = RequestSpec(
        request_id=f"bench-{time.time_ns()}",
        ingress_id="bench",
        model="bench",
        prompt_tokens=prompt,
        block_size=32,
        block_keys=[],
        sampling=SamplingParams(max_tokens=1, temperature=0.0),
        tenant=tenant,
    )
    return PrefillTask(spec=spec, queued_s=0.0)


def _kv_bytes_per_token(model: Path) -> int:
    config = json.loads((model / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    dtype_bytes = 4 if config.get("dtype", config.get("torch_dtype")) == "float32" else 2
    return config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * head_dim * dtype_bytes


# --- raw Mooncake Store throughput ---------------------------------------------------------


def raw_mooncake(ports: procs.MooncakePorts, seconds: float) -> list[dict]:
    """put_from / get_into of one KV block's size and of 4 MiB, through a registered buffer."""
    import ctypes

    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    if store.setup("127.0.0.1", ports.metadata_server, 0, 256 << 20, "tcp", "", ports.master_address) != 0:
        raise RuntimeError("Mooncake client setup failed")
    rows = []
    try:
        for size in (32 << 10, 4 << 20):
            buffer = ctypes.create_string_buffer(os.urandom(size), size)
            address = ctypes.addressof(buffer)
            if store.register_buffer(address, size) != 0:
                raise RuntimeError("register_buffer failed")
            keys: list[str] = []
            start = time.perf_counter()
            while time.perf_counter() - start < seconds:
                key = f"bench-raw-{size}-{len(keys)}"
                code = store.put_from(key, address, size)
                if code != 0:
                    break  # a full store (-200) ends the run early
                keys.append(key)
            put_s = time.perf_counter() - start
            start = time.perf_counter()
            got = 0
            for key in keys:
                if store.get_into(key, address, size) == size:
                    got += 1
            get_s = time.perf_counter() - start
            for key in keys:
                store.remove(key)
            store.unregister_buffer(address)
            rows.append(
                {
                    "value_bytes": size,
                    "values": len(keys),
                    "read_back": got,
                    "put_mib_per_s": len(keys) * size / put_s / (1 << 20),
                    "get_mib_per_s": got * size / get_s / (1 << 20) if get_s else 0.0,
                }
            )
            print(
                f"raw Mooncake {size >> 10:>5} KiB values: put {rows[-1]['put_mib_per_s']:7.1f} MiB/s, "
                f"get {rows[-1]['get_mib_per_s']:7.1f} MiB/s ({len(keys)} values)",
                flush=True,
            )
    finally:
        store.close()
    return rows


# --- report ----------------------------------------------------------------------------------


def summary(results: dict) -> list[dict]:
    rows = []
    for path in results["settings"]["paths"]:
        for length in results["settings"]["lengths"]:
            mine = [r for r in results["ttft"] if r["path"] == path and r["length"] == length]
            if not mine:
                continue
            load = _median(r["load_ttft_s"] for r in mine)
            recompute = _median(r["recompute_ttft_s"] for r in mine)
            rows.append(
                {
                    "path": path,
                    "length": length,
                    "load_ms": load * 1000,
                    "recompute_ms": recompute * 1000,
                    "speedup": recompute / load,
                    "loaded_tokens": min(r["loaded_tokens"] for r in mine),
                    "kv_gib_per_s": _median(r["kv_gib_per_s"] for r in mine),
                }
            )
    return rows


def _median(values) -> float:
    """p50 by the benchmarks' one definition (the same as ``statistics.median``)."""
    median = percentile(values, 50)
    assert median is not None, "summary() only asks for cells that have runs"
    return median


def print_table(results: dict) -> None:
    print()
    print(
        "| path | prompt tokens | TTFT loaded (median ms) | TTFT recomputed (median ms) | recompute / load "
        "| tokens loaded (min) | KV GiB/s moved |"
    )
    print("|---|---|---|---|---|---|---|")
    for row in summary(results):
        print(
            f"| {row['path']} | {row['length']} | {row['load_ms']:.1f} | {row['recompute_ms']:.1f} | "
            f"{row['speedup']:.2f}x | {row['loaded_tokens']} | {row['kv_gib_per_s']:.2f} |"
        )
    print()
    print("| raw Mooncake value | put MiB/s | get MiB/s | values |")
    print("|---|---|---|---|")
    for row in results["raw"]:
        print(
            f"| {row['value_bytes'] >> 10} KiB | {row['put_mib_per_s']:.1f} | {row['get_mib_per_s']:.1f} | "
            f"{row['values']} |"
        )


def plot(results: dict, out: Path) -> None:
    rows = summary(results)
    fig, ax = plots.figure()
    for path in results["settings"]["paths"]:
        mine = [r for r in rows if r["path"] == path]
        lengths = [r["length"] for r in mine]
        ax.plot(lengths, [r["load_ms"] for r in mine], "o-", label=f"{path}: loaded")
        ax.plot(lengths, [r["recompute_ms"] for r in mine], "x--", label=f"{path}: recomputed")
    plots.save(
        fig,
        ax,
        out / "ttft.png",
        title="Time to first token: KV loaded vs recomputed (median)",
        xlabel="prompt tokens",
        ylabel="TTFT (ms)",
        log_x=True,
        log_y=True,
    )
    fig, ax = plots.figure()
    labels, values = [], []
    for row in rows:
        labels.append(f"{row['path']}\n{row['length']}")
        values.append(row["kv_gib_per_s"])
    for row in results["raw"]:
        labels += [f"raw put\n{row['value_bytes'] >> 10} KiB", f"raw get\n{row['value_bytes'] >> 10} KiB"]
        values += [row["put_mib_per_s"] / 1024, row["get_mib_per_s"] / 1024]
    ax.bar(range(len(values)), values, label="GiB/s")
    ax.set_xticks(range(len(values)), labels, fontsize=6)
    plots.save(
        fig, ax, out / "throughput.png", title="KV moved by the engines vs raw Mooncake", xlabel="", ylabel="GiB/s"
    )
