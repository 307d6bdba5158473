"""OpenAI request bodies as msgspec Structs, and their checks.

Every top-level field is accounted for in ``ingress.fields``: one the ingress cannot honour
is a 400 naming it, one it does not know is logged once and ignored. A known field of the
wrong type, or a number out of its range, is a 400 that names the field. Ranges are
``msgspec.Meta`` bounds on the field where msgspec can express them; ``seed`` is
checked by hand (the bus carries [-2^63, 2^64 - 1], past int64 where Meta stops), so
no number reaches the msgpack encoder that it cannot carry. Responses are built as
plain dicts and encoded by msgspec: they are written once per token and need no
validation.

Nesting is bounded before decoding: msgspec recurses once per level of arrays and objects,
even to skip an unknown field, so 100,000 brackets would end in a RecursionError. A body
with no more openers than the limit cannot nest deeper (two ``bytes.count`` calls); any
other is measured exactly with its strings cut out, in C-speed passes (``depth_exceeds``).
"""

from __future__ import annotations

import re
from array import array
from itertools import accumulate
from typing import Annotated, TypeVar

import msgspec

from switchyard.ingress.errors import InvalidRequest
from switchyard.ingress.fields import Endpoint, check_fields

_T = TypeVar("_T")

Temperature = Annotated[float, msgspec.Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
TokenCount = Annotated[int, msgspec.Meta(ge=1)]  # the context bounds it from above (ingress.app)
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # msgpack's integers: int64 and uint64


class StreamOptions(msgspec.Struct, frozen=True, kw_only=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage so far on every chunk (with include_usage)


class ContentPart(msgspec.Struct, frozen=True, kw_only=True):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, frozen=True, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class _Sampling(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    max_tokens: TokenCount | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    n: int = 1  # typed here for the schema; ingress.fields refuses any but 1
    temperature: Temperature | None = None
    top_p: TopP | None = None
    seed: int | None = None
    user: str | None = None


class ChatCompletionRequest(_Sampling, frozen=True, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: TokenCount | None = None


class CompletionRequest(_Sampling, frozen=True, kw_only=True):
    prompt: str | list[str | int]  # text, one text in a list, or token ids
    echo: bool = False  # likewise: ingress.fields refuses true


_ENDPOINTS: dict[type, Endpoint] = {ChatCompletionRequest: "chat", CompletionRequest: "completion"}
ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOPS = 4
MAX_JSON_DEPTH = 64

# A JSON string, or an unterminated one up to the end; possessive, so that no input makes the
# search backtrack (an unterminated string of escaped quotes would otherwise be quadratic).
_JSON_STRING = re.compile(rb'"[^"\\]*+(?:\\.[^"\\]*+)*+(?:"|\\?\Z)', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_DEPTH_STEPS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")  # +1 and -1 as signed bytes


def depth_exceeds(body: bytes, limit: int) -> bool:
    """Whether arrays and objects in ``body`` nest more than ``limit`` deep (outside strings)."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return False
    steps = _JSON_STRING.sub(b"", body).translate(None, _NOT_BRACKETS).translate(_DEPTH_STEPS)
    return max(accumulate(array("b", steps)), default=0) > limit


def decode_body(body: bytes, type_: type[_T], *, max_depth: int = MAX_JSON_DEPTH) -> _T:
    if not body.strip():
        raise InvalidRequest("The request body is empty; expected a JSON object.")
    if depth_exceeds(body, max_depth):
        raise InvalidRequest(
            f"The request body nests arrays and objects more than {max_depth} deep.", code="json_too_deep"
        )
    try:
        decoded = msgspec.json.decode(body, type=type_)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"Invalid request: {exc}", param=_param_of(str(exc))) from None
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"The request body is not valid JSON: {exc}") from None
    endpoint = _ENDPOINTS.get(type_)
    if endpoint is not None:
        check_fields(body, endpoint)
    return decoded


def _param_of(message: str) -> str | None:
    """The field a msgspec error names: "... - at `$.messages[0]`", and for a missing
    field "Object missing required field `role` - at `$.messages[0]`"."""
    path = message.split("at `$.", 1)[1].rstrip("`") if "at `$." in message else None
    marker = "missing required field `"
    if marker in message:
        field = message.split(marker, 1)[1].split("`", 1)[0]
        return f"{path}.{field}" if path else field
    return path


def chat_messages(request: ChatCompletionRequest) -> list[dict[str, str]]:
    """Messages with their content flattened to text; non-text parts are refused."""
    if not request.messages:
        raise InvalidRequest("`messages` must hold at least one message.", param="messages")
    out = []
    for i, message in enumerate(request.messages):
        if message.role not in ROLES:
            raise InvalidRequest(
                f"Unknown role {message.role!r}; expected one of {', '.join(ROLES)}.", param=f"messages[{i}].role"
            )
        out.append(
            {"role": "system" if message.role == "developer" else message.role, "content": _text_of(message.content, i)}
        )
    return out


def _text_of(content: str | list[ContentPart] | None, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        param = f"messages[{index}].content[{j}]"
        if part.type != "text":
            raise InvalidRequest(f"Content part of type {part.type!r} is not supported; only text is.", param=param)
        if part.text is None:
            raise InvalidRequest("A content part of type 'text' needs its `text` field.", param=f"{param}.text")
        texts.append(part.text)
    return "".join(texts)


def stop_strings(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOPS:
        raise InvalidRequest(f"At most {MAX_STOPS} stop sequences are allowed.", param="stop")
    if any(s == "" for s in stops):
        raise InvalidRequest("Stop sequences must not be empty.", param="stop")
    return stops


def check_sampling(request: _Sampling) -> None:
    """What the field types cannot say (temperature, top_p, token counts: see above); `n` and
    the other fields we cannot honour are refused by ``ingress.fields``."""
    if request.seed is not None and not SEED_MIN <= request.seed <= SEED_MAX:
        raise InvalidRequest("`seed` must be an integer in [-2^63, 2^64 - 1].", param="seed")
    if request.stream_options is not None and not request.stream:
        raise InvalidRequest("`stream_options` is only allowed when `stream` is true.", param="stream_options")
