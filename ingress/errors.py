"""The ingress's error tree (under ``SwitchyardError``, see ``switchyard.schemas.errors``):
each ``ApiError`` knows its HTTP status and OpenAI error body.

IngressError
├── StreamFailed                  (ingress.streams) a token stream ended in an error chunk
├── TokenizerError                (ingress.tokenizer) a model folder or template we cannot use
├── ServiceError                  (ingress.service) the ingress cannot start as configured
├── KeyStoreError                 (ingress.auth) a keys file we cannot read or write
└── ApiError                      status, type, code, param, message
    ├── InvalidRequest            400 invalid_request_error
    │   └── ContextLengthExceeded 400 code=context_length_exceeded
    ├── Unauthorized              401 code=invalid_api_key (ingress.auth: no key, or not a live one)
    ├── PermissionDenied          403 code=permission_denied (a right the key lacks)
    ├── ModelNotFound             404 code=model_not_found
    ├── RequestTimeout            408 (ingress.edge: a head or body that arrives too slowly)
    ├── RequestTooLarge           413
    ├── RateLimited               429 with Retry-After
    ├── HeadersTooLarge           431 (ingress.edge: too many header bytes or fields)
    ├── Unavailable               503 (no scheduler / no workers)
    └── GenerationFailed          502 (a worker was lost mid-request)
        ├── DeadlineExceeded      504 (queued past its x-switchyard-deadline-s)
        └── Shed                  429 rate_limit_error (given up under overload)

A stream that fails before its first token is answered with these as a request that does not
stream is (its response has not started: ``ingress.generation``); after it, as an SSE error
event with the same body.

A bare ``ApiError`` is a 500 ``server_error``: what the catch-all handler answers for
an exception nobody expected (``ingress.app``).
"""

from __future__ import annotations

import math

import msgspec

from switchyard.schemas import SwitchyardError


class IngressError(SwitchyardError):
    """Anything the ingress raises on purpose."""


class ApiError(IngressError):
    status = 500
    type = "server_error"

    def __init__(
        self, message: str, *, code: str | None = None, param: str | None = None, retry_after_s: float | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.param = param
        self.retry_after_s = retry_after_s

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def encoded(self) -> bytes:
        return msgspec.json.encode(self.body())

    def headers(self) -> dict[str, str]:
        if self.retry_after_s is None:
            return {}
        return {"retry-after": str(retry_after_header(self.retry_after_s))}


_MAX_RETRY_AFTER_S = 3600


def retry_after_header(seconds: float) -> int:
    """Whole seconds for a Retry-After header: at least 1, at most an hour. A wait that is
    not a number (a bad figure from the bus) says 1, an infinite one the hour: a header must
    be sent, whatever the scheduler computed."""
    if math.isnan(seconds):
        return 1
    return math.ceil(min(max(seconds, 1.0), _MAX_RETRY_AFTER_S))


class InvalidRequest(ApiError):
    status = 400
    type = "invalid_request_error"


class ContextLengthExceeded(InvalidRequest):
    def __init__(self, message: str, param: str = "messages") -> None:
        super().__init__(message, code="context_length_exceeded", param=param)


class Unauthorized(ApiError):
    status = 401
    type = "invalid_request_error"

    def __init__(self, message: str) -> None:
        super().__init__(message, code="invalid_api_key")

    def headers(self) -> dict[str, str]:
        return {"www-authenticate": 'Bearer realm="switchyard"'}


class PermissionDenied(ApiError):
    status = 403
    type = "invalid_request_error"

    def __init__(self, message: str) -> None:
        super().__init__(message, code="permission_denied")


class ModelNotFound(ApiError):
    status = 404
    type = "invalid_request_error"

    def __init__(self, model: str) -> None:
        super().__init__(f"The model `{model}` does not exist.", code="model_not_found", param="model")


class RequestTooLarge(ApiError):
    status = 413
    type = "invalid_request_error"


class RequestTimeout(ApiError):
    status = 408
    type = "invalid_request_error"

    def __init__(self, message: str) -> None:
        super().__init__(message, code="request_timeout")


class RateLimited(ApiError):
    status = 429
    type = "rate_limit_error"


class HeadersTooLarge(ApiError):
    status = 431
    type = "invalid_request_error"

    def __init__(self, message: str) -> None:
        super().__init__(message, code="request_header_fields_too_large")


class Unavailable(ApiError):
    status = 503
    type = "server_error"


class GenerationFailed(ApiError):
    status = 502
    type = "server_error"


class DeadlineExceeded(GenerationFailed):
    status = 504


class Shed(GenerationFailed):
    """The scheduler gave the request up under overload (it could not meet the TTFT SLO
    and no capacity came free for it): retrying later, or elsewhere, may succeed."""

    status = 429
    type = "rate_limit_error"


class EngineRefused(GenerationFailed):
    """The engine would not take the request (``StreamError`` code ``invalid_request``): a
    JSON schema its grammar backend cannot compile, a parameter it refuses. vLLM's own
    server answers these 400; so does this one, with the engine's reason."""

    status = 400
    type = "invalid_request_error"


_BY_CODE: dict[str, type[GenerationFailed]] = {
    "deadline_exceeded": DeadlineExceeded,
    "overloaded": Shed,
    "invalid_request": EngineRefused,
}


def generation_error(code: str, message: str, retry_after_s: float | None = None) -> GenerationFailed:
    """The HTTP error for a stream that failed with ``code`` (``retry_after_s``: its
    Retry-After, where the scheduler named one)."""
    return _BY_CODE.get(code, GenerationFailed)(message, code=code, retry_after_s=retry_after_s)


def internal_error() -> ApiError:
    """What the client hears of an exception nobody expected: a 500 that tells nothing of
    our insides (the log has the traceback, the span the exception)."""
    return ApiError("The server had an error while processing your request.", code="internal_error")
