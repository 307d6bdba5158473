"""The API's OpenAPI 3.1 document, served at ``GET /openapi.json``.

It is built from the app's own routes, so every endpoint is in it: each route's path and
methods, a summary (the table below, else the endpoint's docstring), its request body as the
JSON Schema of the very Struct the endpoint decodes (``msgspec.json.schema_components``, the
same bounds the decoder enforces), the headers it reads, and the statuses it answers with an
OpenAI error body. A property-based fuzzer pointed at it (tests/e2e/test_api_fuzz.py) checks
that no body, valid or not, gets a 5xx or a hang.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
from starlette.routing import BaseRoute, Route

from switchyard.ingress.extras import DetokenizeRequest, TokenizeRequest
from switchyard.ingress.openai_types import (
    MAX_CHOICES,
    MAX_STOPS,
    ROLES,
    SEED_MAX,
    SEED_MIN,
    ChatCompletionRequest,
    CompletionRequest,
)

_REF = "#/components/schemas/{name}"

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}

# Statuses every route may answer whatever its handler does: the edge's (ingress.edge) and
# the API keys' (ingress.auth).
_EDGE_ERRORS = {
    "401": "no API key, or not a live one (with --auth keys)",
    "403": "a right the key lacks",
    "408": "the request head or body arrived too slowly",
    "429": "over a limit: the key's, or this ingress's streams (Retry-After says when to retry)",
    "431": "too many header bytes or fields",
    "503": "the ingress is at its connection limit, or no scheduler or workers are up",
}
_GENERATION_ERRORS = {
    "400": "invalid: a field's type or range, JSON nested too deep, the context exceeded",
    "404": "the model is not served here",
    "413": "the body is larger than --max-body-bytes",
    "502": "the request failed after admission (a worker was lost)",
    "504": "queued past its x-switchyard-deadline-s",
}
_HEADERS = [  # what ingress.app reads besides the body
    {
        "name": "x-request-id",
        "in": "header",
        "description": "the client's id for the request, echoed on the response (another is made if absent or unsafe)",
        "schema": {"type": "string", "pattern": "^[\\x21-\\x7e]{1,128}$"},
    },
    {
        "name": "x-session-affinity",
        "in": "header",
        "description": "a session id: requests with the same one go where its prefix is cached",
        # printable ASCII; no space at either end, which HTTP would strip
        "schema": {"type": "string", "maxLength": 256, "pattern": "^[\\x21-\\x7e]([\\x20-\\x7e]*[\\x21-\\x7e])?$"},
    },
    {
        "name": "x-switchyard-priority",
        "in": "header",
        "description": "interactive (default) or batch, or 0-9 (lower first)",
        "schema": {"type": "string", "pattern": "^(interactive|batch|[0-9])$"},
    },
    {
        "name": "x-switchyard-deadline-s",
        "in": "header",
        "description": "the first token is due within this many seconds, else 429 up front or 504",
        "schema": {"type": "string", "pattern": "^[1-9][0-9]{0,3}(\\.[0-9]{1,3})?$"},  # within (0, 86400)
    },
    {
        "name": "x-switchyard-region",
        "in": "header",
        "description": "a federated ingress runs the request in this region only (400 if unknown, 503 while it is dark)",
        "schema": {"type": "string", "pattern": "^[a-z][a-z0-9-]{0,31}$"},
    },
]


@dataclass(frozen=True)
class _Endpoint:
    summary: str
    body: type | None = None
    content: dict[str, Any] = field(default_factory=lambda: {"application/json": {"schema": {"type": "object"}}})
    errors: dict[str, str] = field(default_factory=dict)
    headers: bool = False


_GENERATED = {
    "application/json": {"schema": {"type": "object"}},
    "text/event-stream": {"schema": {"type": "string"}},  # with "stream": true
}
_ENDPOINTS = {
    "/v1/chat/completions": _Endpoint(
        "A chat completion", ChatCompletionRequest, _GENERATED, _GENERATION_ERRORS, headers=True
    ),
    "/v1/completions": _Endpoint("A text completion", CompletionRequest, _GENERATED, _GENERATION_ERRORS, headers=True),
    "/v1/models": _Endpoint("The served model"),
    "/v1/models/{model}": _Endpoint("The served model, by its id", errors={"404": "the model is not served here"}),
    "/tokenize": _Endpoint(
        "The token ids a completion (prompt) or chat completion (messages) would prefill",
        TokenizeRequest,
        errors={"400": "neither or both of prompt and messages; the context exceeded", "404": "not this model"},
    ),
    "/detokenize": _Endpoint(
        "The text of token ids", DetokenizeRequest, errors={"400": "a token id out of range", "404": "not this model"}
    ),
    "/health": _Endpoint("Whether a scheduler and workers of both roles are up", errors={"503": "not ready"}),
    "/metrics": _Endpoint("Prometheus metrics", content={"text/plain": {"schema": {"type": "string"}}}),
    "/openapi.json": _Endpoint("This document"),
}


_T = TypeVar("_T")


def described(**operation: Any) -> Callable[[_T], _T]:
    """A route handler that says its own OpenAPI operation (summary, parameters, requestBody,
    content, errors), read by ``openapi_document``."""

    def describe(handler: _T) -> _T:
        setattr(handler, "openapi", {"errors": {}, **operation})  # noqa: B010 (a function's attribute)
        return handler

    return describe


def openapi_document(routes: Sequence[BaseRoute], model: str) -> bytes:
    bodies = [e.body for e in _ENDPOINTS.values() if e.body is not None]  # each once: no duplicates
    bodies = list(dict.fromkeys(bodies))
    (_, schemas) = msgspec.json.schema_components(bodies, ref_template=_REF)
    _tighten(schemas, model)
    schemas["Error"] = _ERROR
    paths: dict[str, dict[str, Any]] = {}
    for route in routes:
        if isinstance(route, Route):
            path = route.path.replace("{model:path}", "{model}")  # OpenAPI names no converters
            endpoint = _ENDPOINTS.get(path) or _Endpoint(_summary_of(route))
            methods = sorted(m.lower() for m in route.methods or () if m != "HEAD")
            described = getattr(route.endpoint, "openapi", None)  # a route that says it itself
            operations = {m: _described(described) if described else _operation(endpoint, path) for m in methods}
            paths.setdefault(path, {}).update(operations)
    document = {
        "openapi": "3.1.0",
        "info": {"title": "Switchyard", "version": "1", "description": "An OpenAI-compatible API over NATS."},
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{}, {"bearer": []}],  # keys are optional: --auth keys asks for one
    }
    return msgspec.json.encode(document)


def _tighten(schemas: dict[str, Any], model: str) -> None:
    """What the checks after decoding (openai_types, app) enforce and the field types cannot
    say, so that a generator of valid requests makes valid ones."""
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        fields = schemas[name]["properties"]
        fields["model"] = {"type": "string", "enum": [model]}  # any other is a 404
        fields["n"] = {"type": "integer", "enum": [1], "default": 1}
        fields["seed"] = {"anyOf": [{"type": "integer", "minimum": SEED_MIN, "maximum": SEED_MAX}, {"type": "null"}]}
        stop = {"type": "string", "minLength": 1}
        fields["stop"] = {"anyOf": [stop, {"type": "array", "items": stop, "maxItems": MAX_STOPS}, {"type": "null"}]}
    schemas["ChatCompletionRequest"]["properties"]["messages"]["minItems"] = 1
    schemas["ChatMessage"]["properties"]["role"] = {"type": "string", "enum": list(ROLES)}
    schemas["ContentPart"]["properties"] = {"type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}}
    schemas["ContentPart"]["required"] = ["type", "text"]
    completion = schemas["CompletionRequest"]["properties"]
    completion["echo"] = {"type": "boolean", "enum": [False], "default": False}
    token_ids = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
    completion["prompt"] = {
        "anyOf": [
            {"type": "string", "minLength": 1},
            token_ids,
            # Several prompts (ingress.prompts): texts, or token-id lists; prompts x n <= MAX_CHOICES.
            {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": MAX_CHOICES},
            {"type": "array", "items": token_ids, "minItems": 1, "maxItems": MAX_CHOICES},
        ]
    }


def _operation(endpoint: _Endpoint, path: str) -> dict[str, Any]:
    responses: dict[str, Any] = {"200": {"description": "OK", "content": endpoint.content}}
    for status, why in {**_EDGE_ERRORS, **endpoint.errors}.items():
        responses[status] = {
            "description": why,
            "content": {"application/json": {"schema": {"$ref": _REF.format(name="Error")}}},
        }
    operation: dict[str, Any] = {"summary": endpoint.summary, "responses": responses}
    if endpoint.body is not None:
        ref = {"$ref": _REF.format(name=endpoint.body.__name__)}
        operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": ref}}}
    parameters: list[dict[str, Any]] = list(_HEADERS) if endpoint.headers else []
    if "{model}" in path:
        parameters.append({"name": "model", "in": "path", "required": True, "schema": {"type": "string"}})
    if parameters:
        operation["parameters"] = parameters
    return operation


def _described(described: dict[str, Any]) -> dict[str, Any]:
    """The operation of a route that describes itself (``ingress.files``): its ``summary`` and
    optional ``parameters`` and ``requestBody`` as OpenAPI has them, ``content`` (its 200's,
    JSON by default) and ``errors`` ({status: why}, answered with an OpenAI error body)."""
    content = described.get("content", {"application/json": {"schema": {"type": "object"}}})
    responses: dict[str, Any] = {"200": {"description": "OK", "content": content}}
    for status, why in {**_EDGE_ERRORS, **described.get("errors", {})}.items():
        responses[status] = {
            "description": why,
            "content": {"application/json": {"schema": {"$ref": _REF.format(name="Error")}}},
        }
    operation = {"summary": described["summary"], "responses": responses}
    return operation | {k: described[k] for k in ("parameters", "requestBody") if k in described}


def _summary_of(route: Route) -> str:
    doc = (route.endpoint.__doc__ or "").strip()
    return doc.splitlines()[0] if doc else route.path
