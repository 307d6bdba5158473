"""bench.synth: seeded traces that bench sim reads back, with the structure each shape promises."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from switchyard.bench import synth
from switchyard.bench.traces import TRACE_BLOCK_SIZE, blocks_for, hit_ratio_bound, read_trace


def _write(tmp_path: Path, shape: str, seed: int = 0, duration_s: float = 600.0) -> Path:
    out = tmp_path / f"{shape}-{seed}.jsonl"
    args = argparse.Namespace(shape=shape, out=out, duration_s=duration_s, seed=seed)
    assert synth.run(args) == 0
    return out


@pytest.mark.parametrize("shape", sorted(synth.SHAPES))
def test_each_shape_reads_back_as_a_mooncake_trace(tmp_path: Path, shape: str) -> None:
    path = _write(tmp_path, shape)
    requests = read_trace(path)  # the reader's own checks: one hash id per 512 tokens, positive lengths
    spec = synth.SHAPES[shape]
    rate = len(requests) / 600.0
    assert 0.5 * spec.rate_rps < rate < 1.5 * spec.rate_rps
    assert all(r.arrival_s <= 600.0 for r in requests)
    assert all(blocks_for(r.input_tokens) == len(r.block_ids) <= synth.MAX_BLOCKS for r in requests)
    assert all(r.input_tokens > (len(r.block_ids) - 1) * TRACE_BLOCK_SIZE for r in requests)
    # Every shape shares prefixes across requests: the infinite-cache bound is well above zero.
    assert hit_ratio_bound(requests) > 0.5


def test_same_seed_same_bytes_other_seed_other_trace(tmp_path: Path) -> None:
    a = _write(tmp_path, "toolagent", seed=3).read_bytes()
    b = _write(tmp_path / "again", "toolagent", seed=3).read_bytes()
    c = _write(tmp_path, "toolagent", seed=4).read_bytes()
    assert a == b
    assert a != c


def test_toolagent_steps_extend_their_own_prompt() -> None:
    rows = synth.generate(synth.SHAPES["toolagent"], 300.0, seed=1)
    prompts = {r.hash_ids for r in rows}
    # A step's prompt is an earlier step's prompt plus 1-4 blocks: most prompts have their parent.
    extended = sum(any(r.hash_ids[:-k] in prompts for k in range(1, 5)) for r in rows)
    assert extended > 0.6 * len(rows)


def test_longdoc_questions_share_only_the_document() -> None:
    rows = synth.generate(synth.SHAPES["longdoc"], 1800.0, seed=2)
    by_doc: dict[tuple[int, ...], set[int]] = {}
    for r in rows:
        by_doc.setdefault(r.hash_ids[:-1], set()).add(r.hash_ids[-1])
    assert all(len(r.hash_ids[:-1]) >= 16 for r in rows)
    # Each question is a block of its own; popular documents are asked about many times.
    assert sum(len(q) for q in by_doc.values()) == len(rows)
    assert max(len(q) for q in by_doc.values()) >= 10


def test_bursty_arrivals_are_burstier_than_poisson() -> None:
    rows = synth.generate(synth.SHAPES["bursty"], 3600.0, seed=0)
    per_minute = [0] * 60
    for r in rows:
        per_minute[min(59, int(r.arrival_s // 60))] += 1
    mean = sum(per_minute) / 60
    variance = sum((n - mean) ** 2 for n in per_minute) / 60
    assert variance > 3 * mean  # Poisson counts have variance = mean


def test_duration_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="positive"):
        synth.run(argparse.Namespace(shape="bursty", out=tmp_path / "x.jsonl", duration_s=0.0, seed=0))
