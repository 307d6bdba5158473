"""Trace readers and the infinite-cache bound, on tiny synthetic traces (never the real ones)."""

from __future__ import annotations

import json

import pytest

from switchyard.bench.traces import (
    TraceError,
    TraceRequest,
    block_keys,
    detect_format,
    hit_ratio_bound,
    read_trace,
    tenant_salt,
)


def write_mooncake(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def mooncake_row(ms, inp, out, ids):
    return {"timestamp": ms, "input_length": inp, "output_length": out, "hash_ids": ids}


AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


def test_mooncake_rows_become_requests_in_seconds(tmp_path):
    path = write_mooncake(tmp_path / "t.jsonl", [mooncake_row(0, 1000, 5, [0, 1]), mooncake_row(1500, 513, 1, [0, 7])])
    requests = read_trace(path)
    assert requests == [TraceRequest(0.0, 1000, 5, (0, 1)), TraceRequest(1.5, 513, 1, (0, 7))]


def test_arrivals_are_relative_to_the_first_and_sorted_stably(tmp_path):
    rows = [mooncake_row(2000, 10, 2, [5]), mooncake_row(1000, 20, 2, [6]), mooncake_row(2000, 30, 2, [7])]
    requests = read_trace(write_mooncake(tmp_path / "t.jsonl", rows))
    assert [(r.arrival_s, r.input_tokens) for r in requests] == [(0.0, 20), (1.0, 10), (1.0, 30)]


def test_limit_keeps_the_first_lines(tmp_path):
    rows = [mooncake_row(i * 100, 10, 2, [i]) for i in range(5)]
    assert [r.block_ids for r in read_trace(write_mooncake(tmp_path / "t.jsonl", rows), limit=2)] == [(0,), (1,)]


def test_azure_rows_get_fresh_block_ids_and_relative_seconds(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text(AZURE_HEADER + "2023-11-16 18:15:46.5000000,374,44\n2023-11-16 18:15:48.0000000,1025,9\n")
    first, second = read_trace(path)
    assert (first.arrival_s, first.input_tokens, first.output_tokens) == (0.0, 374, 44)
    assert second.arrival_s == pytest.approx(1.5)
    assert len(first.block_ids) == 1 and len(second.block_ids) == 3  # ceil(1025 / 512)
    assert not set(first.block_ids) & set(second.block_ids)  # no prefix information: nothing shared


@pytest.mark.parametrize(
    "line, complaint",
    [
        ("{not json", "not JSON"),
        (json.dumps({"timestamp": 0, "input_length": 10, "hash_ids": [1]}), "output_length"),
        (json.dumps(mooncake_row(0, 1025, 3, [1, 2])), "2 hash_ids for 1025 input tokens"),
        (json.dumps(mooncake_row(0, 10, 3, ["a"])), "hash_ids must be a list of integers"),
        (json.dumps(mooncake_row(-5, 10, 3, [1])), "timestamp"),
    ],
)
def test_a_malformed_mooncake_line_is_named(tmp_path, line, complaint):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(mooncake_row(0, 10, 2, [1])) + "\n" + line + "\n")
    with pytest.raises(TraceError, match=f"bad.jsonl:2: .*{complaint}"):
        read_trace(path)


@pytest.mark.parametrize(
    "row, complaint",
    [
        ("2023-11-16 18:15:47,ten,4", "ContextTokens 'ten' is not an integer"),
        ("yesterday,10,4", "TIMESTAMP 'yesterday'"),
        ("2023-11-16 18:15:47,10", "expected 3 fields"),
        ("2023-11-16 18:15:47,10,0", "GeneratedTokens must be a positive integer"),
    ],
)
def test_a_malformed_azure_row_is_named(tmp_path, row, complaint):
    path = tmp_path / "bad.csv"
    path.write_text(AZURE_HEADER + "2023-11-16 18:15:46,10,4\n" + row + "\n")
    with pytest.raises(TraceError, match=f"bad.csv:3: {complaint}"):
        read_trace(path)


def test_a_csv_without_the_azure_header_is_refused(tmp_path):
    path = tmp_path / "other.csv"
    path.write_text("a,b,c\n1,2,3\n")
    with pytest.raises(TraceError, match=r"other\.csv:1: expected the header"):
        read_trace(path)


def test_format_is_told_by_suffix_then_content(tmp_path):
    assert detect_format(tmp_path / "x.jsonl") == "mooncake"
    assert detect_format(tmp_path / "x.csv") == "azure"
    plain = tmp_path / "trace"
    plain.write_text(json.dumps(mooncake_row(0, 10, 2, [1])) + "\n")
    assert detect_format(plain) == "mooncake"


def test_hit_ratio_bound_by_hand():
    requests = [
        TraceRequest(0, 1000, 1, (1, 2)),  # all new: 0
        TraceRequest(1, 1500, 1, (1, 2, 3)),  # 1, 2 seen: 1024 tokens
        TraceRequest(2, 600, 1, (1, 9)),  # 1 seen: 512
        TraceRequest(3, 700, 1, (5, 2)),  # first block new: 0, though 2 was seen
        TraceRequest(4, 1000, 1, (1, 2)),  # both seen: 1024, capped at its 1000 tokens
    ]
    assert hit_ratio_bound(requests) == pytest.approx((1024 + 512 + 1000) / (1000 + 1500 + 600 + 700 + 1000))


def test_block_keys_keep_sharing_within_a_tenant_and_separate_tenants():
    salt, other = tenant_salt("a"), tenant_salt("b")
    assert block_keys((1, 2), salt)[0] == block_keys((1, 3), salt)[0]
    assert block_keys((1, 2), salt)[1] != block_keys((1, 3), salt)[1]
    assert not set(block_keys((1, 2), salt)) & set(block_keys((1, 2), other))
    assert all(0 <= key < 2**64 for key in block_keys(tuple(range(100)), salt))


def test_lru_hit_ratio_is_bounded_by_the_infinite_cache_and_shrinks_with_the_cache():
    from switchyard.bench.traces import TraceRequest, hit_ratio_bound, lru_hit_ratio

    a, b = (1, 2, 3), (4, 5, 6)
    requests = [TraceRequest(float(i), 1536, 1, ids) for i, ids in enumerate([a, b, a, b])]
    assert hit_ratio_bound(requests) == pytest.approx(0.5)
    assert lru_hit_ratio(requests, 100) == pytest.approx(0.5)  # room for all: the bound
    assert lru_hit_ratio(requests, 3) == 0.0  # a and b keep evicting each other
    assert lru_hit_ratio(requests, 6) == pytest.approx(0.5)


@pytest.mark.parametrize("name", ["missing.jsonl", "missing", "folder.jsonl"])
def test_a_trace_that_cannot_be_read_is_a_trace_error_naming_it(tmp_path, name):
    path = tmp_path / name
    if name.startswith("folder"):
        path.mkdir()
    with pytest.raises(TraceError, match=f"{path}: cannot read it"):
        read_trace(path)
