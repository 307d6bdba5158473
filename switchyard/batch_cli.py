"""``switchyard batch``: the Batch API from a shell, through the ingress's HTTP API.

    switchyard batch submit FILE --endpoint /v1/chat/completions [--wait] [--out PATH]
    switchyard batch list [--limit N]
    switchyard batch status BATCH_ID
    switchyard batch cancel BATCH_ID

``--url`` (default ``http://127.0.0.1:8000``, or ``SWITCHYARD_URL``) and ``--api-key`` (or
``OPENAI_API_KEY``) say where and as whom. ``submit --wait`` shows a progress bar until the
batch ends, then downloads the output file (and the error file, if any) and prints their paths.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from switchyard.schemas import SwitchyardError

_TERMINAL = ("completed", "failed", "expired", "cancelled")
_BAR = 30


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=os.environ.get("SWITCHYARD_URL", "http://127.0.0.1:8000"), help="the ingress")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", ""), help="an API key (--auth keys)")
    sub = parser.add_subparsers(dest="batch_command", required=True, metavar="ACTION")
    submit = sub.add_parser("submit", help="upload a JSONL file of requests and run it as a batch")
    submit.add_argument("file", type=Path)
    submit.add_argument("--endpoint", required=True, choices=["/v1/chat/completions", "/v1/completions"])
    submit.add_argument("--metadata", action="append", default=[], metavar="KEY=VALUE")
    submit.add_argument("--wait", action="store_true", help="show progress until it ends, then download its files")
    submit.add_argument(
        "--out", type=Path, default=None, help="where the output file goes (default: ./<id>_output.jsonl)"
    )
    listing = sub.add_parser("list", help="your batches, newest first")
    listing.add_argument("--limit", type=int, default=20)
    for name, help_ in (("status", "one batch, as JSON"), ("cancel", "cancel a batch")):
        sub.add_parser(name, help=help_).add_argument("batch_id")


def run(args: argparse.Namespace) -> int:
    headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    with httpx.Client(base_url=args.url.rstrip("/") + "/v1", headers=headers, timeout=60) as http:
        try:
            return _ACTIONS[args.batch_command](http, args)
        except httpx.HTTPError as exc:
            print(f"switchyard batch: {args.url}: {exc}", file=sys.stderr)
            return 1
        except _Refused as exc:
            print(f"switchyard batch: {exc}", file=sys.stderr)
            return 1


class _Refused(SwitchyardError):
    """The API answered with an error (its message is ours to print)."""


def _json(response: httpx.Response) -> dict[str, Any]:
    body: dict[str, Any] = response.json()
    if response.status_code >= 400:
        raise _Refused(f"{response.status_code}: {body.get('error', {}).get('message', body)}")
    return body


def _submit(http: httpx.Client, args: argparse.Namespace) -> int:
    with args.file.open("rb") as f:
        file = _json(http.post("/files", files={"file": (args.file.name, f)}, data={"purpose": "batch"}))
    metadata = dict(m.split("=", 1) for m in args.metadata) or None
    request = {"input_file_id": file["id"], "endpoint": args.endpoint, "completion_window": "24h", "metadata": metadata}
    batch = _json(http.post("/batches", json=request))
    print(batch["id"])
    if batch["status"] == "failed":
        return _failed(batch)
    if not args.wait:
        return 0
    while batch["status"] not in _TERMINAL:
        time.sleep(0.5)
        batch = _json(http.get(f"/batches/{batch['id']}"))
        print("\r" + progress(batch), end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    if batch["status"] == "failed":
        return _failed(batch)
    for key, default in (
        ("output_file_id", f"{batch['id']}_output.jsonl"),
        ("error_file_id", f"{batch['id']}_errors.jsonl"),
    ):
        if batch.get(key):
            path = args.out if key == "output_file_id" and args.out else Path(default)
            path.write_bytes(http.get(f"/files/{batch[key]}/content").content)
            print(f"{key.removesuffix('_file_id')}: {path}")
    return 0 if batch["status"] == "completed" else 1


def progress(batch: dict[str, Any]) -> str:
    """``[#####.....] 50/100 done (2 failed) in_progress``"""
    counts = batch["request_counts"]
    total, done = counts["total"], counts["completed"] + counts["failed"]
    filled = _BAR * done // total if total else 0
    return f"[{'#' * filled}{'.' * (_BAR - filled)}] {done}/{total} done ({counts['failed']} failed) {batch['status']}"


def _failed(batch: dict[str, Any]) -> int:
    for error in (batch.get("errors") or {}).get("data", []):
        print(f"line {error.get('line')}: {error['code']}: {error['message']}", file=sys.stderr)
    return 1


def _list(http: httpx.Client, args: argparse.Namespace) -> int:
    for b in _json(http.get("/batches", params={"limit": args.limit}))["data"]:
        c = b["request_counts"]
        print(f"{b['id']}  {b['status']:<11} {c['completed']:>6} ok {c['failed']:>6} failed of {c['total']:>6}")
    return 0


def _status(http: httpx.Client, args: argparse.Namespace) -> int:
    print(json.dumps(_json(http.get(f"/batches/{args.batch_id}")), indent=2))
    return 0


def _cancel(http: httpx.Client, args: argparse.Namespace) -> int:
    print(_json(http.post(f"/batches/{args.batch_id}/cancel"))["status"])
    return 0


_ACTIONS = {"submit": _submit, "list": _list, "status": _status, "cancel": _cancel}
