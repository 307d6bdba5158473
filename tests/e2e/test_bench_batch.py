"""`switchyard bench batch` runs end to end and writes what it promises: both runs, the batch
completed with every line, the ratios, and the two plots. It asserts no speed."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from switchyard import procs

TRACE = Path(__file__).resolve().parents[3] / "shared" / "data" / "traces" / "mooncake_conversation_trace.jsonl"


def test_bench_batch_small_run_writes_table_json_and_plots(tmp_path):
    trace = TRACE
    if not trace.exists():  # a checkout without the shared traces: a two-request trace of our own
        trace = tmp_path / "trace.jsonl"
        rows = [
            {"timestamp": 0, "input_length": 600, "output_length": 40, "hash_ids": [1, 2]},
            {"timestamp": 200, "input_length": 900, "output_length": 40, "hash_ids": [1, 3]},
        ]
        trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "batch"
    command = ["bench", "batch", "--trace", str(trace), "--limit", "12", "--prefill", "1", "--decode", "1"]
    run = subprocess.run(
        procs.service_command(*command, "--batch-lines", "40", "--out", str(out)),
        capture_output=True,
        text=True,
        timeout=300,
        env=procs.child_env(),
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "with the batch / alone" in run.stdout
    results = json.loads((out / "results.json").read_text())
    alone, mixed = results["runs"]
    assert (alone["run"], mixed["run"]) == ("alone", "with batch")
    assert alone["interactive"]["completed"] == mixed["interactive"]["completed"] > 0
    assert mixed["batch"]["status"] == "completed" and mixed["batch"]["completed"] == 40
    assert results["summary"]["ttft_p90_ratio"] > 0
    assert (out / "ttft.png").stat().st_size > 0 and (out / "batch_progress.png").stat().st_size > 0
