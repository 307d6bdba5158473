"""A batch's lines, in and out: the input file checked as OpenAI's service checks it, and the
output and error files written in OpenAI's format. Pure functions, no I/O.

Input: one JSON object per line, ``{"custom_id", "method": "POST", "url", "body"}``; every
``custom_id`` unique, ``url`` the batch's endpoint, ``body`` one the interactive endpoint
accepts (decoded by the same ``decode_body``, so a refused field is refused here too) for the
served model. Every bad line is reported (up to ``MAX_ERRORS``) with its 1-based line number,
and one bad line fails the whole batch before any work starts.

Output: one line per input line, ordered by input line; a 200 goes to the output file, any
other response or a line that has none (cancelled, expired, out of deliveries) to the
error file.
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec

from switchyard.ingress.errors import IngressError, InvalidRequest
from switchyard.ingress.openai_types import ChatCompletionRequest, CompletionRequest, decode_body
from switchyard.schemas import batch as schema

MAX_ERRORS = 100  # a file of a million bad lines is reported by its first hundred
_BODIES: dict[str, type[ChatCompletionRequest] | type[CompletionRequest]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
}
assert set(_BODIES) == set(schema.ENDPOINTS)


class _InputLine(msgspec.Struct, frozen=True, kw_only=True):
    custom_id: str
    method: str
    url: str
    body: msgspec.Raw


class Line(msgspec.Struct, frozen=True, kw_only=True):
    """One valid input line: what becomes a work item."""

    line: int
    custom_id: str
    body: str  # JSON text, as the file had it


class Checked(msgspec.Struct, frozen=True, kw_only=True):
    lines: list[Line]
    errors: list[schema.BatchError]


def check_input(data: bytes, endpoint: str, model: str, *, max_lines: int) -> Checked:
    """Every line of an input file, checked; ``errors`` empty means the batch may run."""
    lines: list[Line] = []
    errors: list[schema.BatchError] = []
    seen: set[str] = set()
    raw_lines = data.splitlines()
    for number, raw in enumerate(raw_lines, start=1):
        if not raw.strip():
            continue  # a trailing newline, or a blank line: no request
        try:
            line = check_line(raw, number, endpoint, model)
        except _LineError as exc:
            errors.append(exc.error)
        else:
            if line.custom_id in seen:
                errors.append(_error("duplicate_custom_id", f"custom_id {line.custom_id!r} is used twice.", number))
            seen.add(line.custom_id)
            lines.append(line)
        if len(errors) >= MAX_ERRORS:
            break
    if not errors and not lines:
        errors.append(schema.BatchError(code="empty_file", message="The input file holds no requests."))
    if len(lines) > max_lines:
        errors.append(
            schema.BatchError(
                code="too_many_requests", message=f"The file holds {len(lines)} requests; at most {max_lines}."
            )
        )
    return Checked(lines=lines if not errors else [], errors=errors)


class _LineError(IngressError):  # local control flow: it never leaves this module
    def __init__(self, error: schema.BatchError) -> None:
        self.error = error


def check_line(raw: bytes, number: int, endpoint: str, model: str) -> Line:
    try:
        line = msgspec.json.decode(raw, type=_InputLine)
    except msgspec.ValidationError as exc:
        raise _LineError(_error("invalid_request", f"Line {number}: {exc}", number)) from None
    except msgspec.DecodeError:
        raise _LineError(_error("invalid_json_line", f"Line {number} is not a JSON object.", number)) from None
    if line.method != "POST":
        raise _LineError(_error("invalid_method", f"method must be POST, got {line.method!r}.", number, "method"))
    if line.url != endpoint:
        message = f"url {line.url!r} does not match the batch's endpoint {endpoint!r}."
        raise _LineError(_error("invalid_url", message, number, "url"))
    body = bytes(line.body)
    try:
        decoded = decode_body(body, _BODIES[endpoint])
    except InvalidRequest as exc:
        param = f"body.{exc.param}" if exc.param else "body"
        raise _LineError(_error(exc.code or "invalid_request", exc.message, number, param)) from None
    if decoded.model != model:
        raise _LineError(
            _error("model_not_found", f"The model {decoded.model!r} is not served here.", number, "body.model")
        )
    if decoded.stream:
        raise _LineError(_error("invalid_request", "A batch request cannot stream.", number, "body.stream"))
    return Line(line=number, custom_id=line.custom_id, body=body.decode())


def _error(code: str, message: str, line: int, param: str | None = None) -> schema.BatchError:
    return schema.BatchError(code=code, message=message, param=param, line=line)


# --- output --------------------------------------------------------------------------------------


def output_line(result: schema.LineResult) -> dict[str, Any]:
    """OpenAI's output (or error) file line of one result."""
    response = None
    if result.status_code is not None:
        body = msgspec.json.decode(result.body) if result.body else None
        response = {"status_code": result.status_code, "request_id": result.request_id or "", "body": body}
    error = None if result.error is None else {"code": result.error.code, "message": result.error.message}
    return {"id": _request_id(result), "custom_id": result.custom_id, "response": response, "error": error}


def _request_id(result: schema.LineResult) -> str:
    digest = hashlib.blake2b(f"{result.batch_id}/{result.custom_id}".encode(), digest_size=12).hexdigest()
    return f"batch_req_{digest}"


def output_files(results: list[schema.LineResult]) -> tuple[bytes, bytes]:
    """The output file (200s) and the error file (the rest), each ordered by input line."""
    ordered = sorted(results, key=lambda r: r.line)
    encode = msgspec.json.encode
    ok = b"".join(encode(output_line(r)) + b"\n" for r in ordered if r.ok)
    failed = b"".join(encode(output_line(r)) + b"\n" for r in ordered if not r.ok)
    return ok, failed
