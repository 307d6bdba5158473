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
from collections.abc import Iterable
from itertools import accumulate
from typing import Annotated, Any, Literal, TypeVar

import msgspec

from switchyard.ingress.errors import InvalidRequest
from switchyard.ingress.fields import Endpoint, check_fields

_T = TypeVar("_T")

Temperature = Annotated[float, msgspec.Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
TokenCount = Annotated[int, msgspec.Meta(ge=1)]  # the context bounds it from above (ingress.app)
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # msgpack's integers: int64 and uint64
MAX_LOGPROBS = 20  # vLLM's default max_logprobs
MAX_CHOICES = 128  # OpenAI's limit on n


class StreamOptions(msgspec.Struct, frozen=True, kw_only=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage so far on every chunk (with include_usage)


class ContentPart(msgspec.Struct, frozen=True, kw_only=True):
    type: str
    text: str | None = None


class FunctionCall(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCall(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(msgspec.Struct, frozen=True, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    # An assistant's earlier thinking (vLLM's ``reasoning``; ``reasoning_content`` its older
    # name), for templates that render it back (interleaved thinking between tool calls).
    reasoning: str | None = None
    reasoning_content: str | None = None


class FunctionDefinition(msgspec.Struct, frozen=True, kw_only=True):
    name: Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema of the arguments
    strict: bool | None = None


class Tool(msgspec.Struct, frozen=True, kw_only=True):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(msgspec.Struct, frozen=True, kw_only=True):
    name: str


class NamedToolChoice(msgspec.Struct, frozen=True, kw_only=True):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(msgspec.Struct, frozen=True, kw_only=True):
    name: str = "response"
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, frozen=True, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(msgspec.Struct, frozen=True, kw_only=True):
    """vLLM's ``structured_outputs`` extension: one of these."""

    json: dict[str, Any] | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


Penalty = Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)]
TopLogprobs = Annotated[int, msgspec.Meta(ge=0, le=MAX_LOGPROBS)]


class _Sampling(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    max_tokens: TokenCount | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    n: Annotated[int, msgspec.Meta(ge=1, le=MAX_CHOICES)] = 1
    temperature: Temperature | None = None
    top_p: TopP | None = None
    seed: int | None = None
    user: str | None = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    logit_bias: dict[str, Annotated[float, msgspec.Meta(ge=-100.0, le=100.0)]] | None = None
    response_format: ResponseFormat | None = None
    # vLLM's extensions
    top_k: int | None = None  # -1 or 0: every token
    min_p: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, msgspec.Meta(gt=0.0, le=2.0)] | None = None
    min_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class ChatCompletionRequest(_Sampling, frozen=True, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: TokenCount | None = None
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # vLLM's extension: more variables for the chat template (``enable_thinking`` for Qwen3's,
    # ``thinking`` for DeepSeek's and Kimi's); ``template_kwargs`` checks them.
    chat_template_kwargs: dict[str, Any] | None = None
    # For reasoning models, as vLLM passes it: the template's ``reasoning_effort`` variable, and
    # ``enable_thinking`` (false for "none") unless ``chat_template_kwargs`` sets that.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    include_reasoning: bool = True  # vLLM's: false drops the reasoning a reasoning parser splits off


class CompletionRequest(_Sampling, frozen=True, kw_only=True):
    # Text, token ids, or several prompts: a list of texts or of token-id lists (each a request
    # of its own; ``ingress.prompts``).
    prompt: str | list[str | int | list[int]]
    echo: bool = False  # likewise: ingress.fields refuses true
    logprobs: TopLogprobs | None = None  # the sampled token's, and this many alternatives


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


def chat_messages(request: ChatCompletionRequest) -> list[dict[str, Any]]:
    """Messages as chat templates read them (transformers' and vLLM's convention): content
    flattened to text (non-text parts are refused), an assistant's ``tool_calls`` with their
    arguments as objects, a tool message's ``tool_call_id``, and ``name``."""
    if not request.messages:
        raise InvalidRequest("`messages` must hold at least one message.", param="messages")
    out = []
    for i, message in enumerate(request.messages):
        if message.role not in ROLES:
            raise InvalidRequest(
                f"Unknown role {message.role!r}; expected one of {', '.join(ROLES)}.", param=f"messages[{i}].role"
            )
        rendered: dict[str, Any] = {
            "role": "system" if message.role == "developer" else message.role,
            "content": _text_of(message.content, i),
        }
        if message.name is not None:
            rendered["name"] = message.name
        if message.tool_calls:
            if message.role != "assistant":
                raise InvalidRequest("Only assistant messages carry `tool_calls`.", param=f"messages[{i}].tool_calls")
            rendered["tool_calls"] = [_call_of(call, i, j) for j, call in enumerate(message.tool_calls)]
        reasoning = message.reasoning if message.reasoning is not None else message.reasoning_content
        if reasoning is not None and message.role == "assistant":  # under both names, as vLLM gives it
            rendered["reasoning"] = rendered["reasoning_content"] = reasoning
        if message.role == "tool":
            if message.tool_call_id is None:
                raise InvalidRequest("A tool message needs its `tool_call_id`.", param=f"messages[{i}].tool_call_id")
            rendered["tool_call_id"] = message.tool_call_id
        out.append(rendered)
    return out


def _call_of(call: ToolCall, index: int, j: int) -> dict[str, Any]:
    try:
        arguments = msgspec.json.decode(call.function.arguments) if call.function.arguments.strip() else {}
    except msgspec.DecodeError:
        raise InvalidRequest(
            "A tool call's `arguments` must be JSON text.",
            param=f"messages[{index}].tool_calls[{j}].function.arguments",
        ) from None
    return {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": arguments}}


# Template variables the ingress sets itself (``ModelTokenizer.render_chat``): not a request's to
# set through ``chat_template_kwargs``; each has its own field, or none (the tokenizer's tokens).
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"messages", "tools", "documents", "add_generation_prompt", "continue_final_message", "chat_template", "tokenize"}
)
_TEMPLATE_KWARG = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")


def template_kwargs(
    kwargs: dict[str, Any] | None, special_tokens: Iterable[str] = (), reasoning_effort: str | None = None
) -> dict[str, Any]:
    """``chat_template_kwargs`` as the template gets them: names of template variables, none
    that the ingress sets itself (400 naming it). A variable the template does not read changes
    nothing, as in vLLM (which drops it). ``reasoning_effort`` joins them as vLLM passes it."""
    kwargs = kwargs or {}
    reserved = RESERVED_TEMPLATE_KWARGS | set(special_tokens)
    for name in kwargs:
        if not _TEMPLATE_KWARG.fullmatch(name):
            raise InvalidRequest(
                f"`chat_template_kwargs` names a template variable; {name[:64]!r} is not one.",
                param="chat_template_kwargs",
            )
        if name in reserved:
            raise InvalidRequest(
                f"`chat_template_kwargs` may not set {name!r}: the ingress sets it (from the request's own "
                "fields, or the model's tokenizer).",
                param="chat_template_kwargs",
            )
    merged = dict(kwargs)
    if reasoning_effort is not None:  # its enable_thinking unless the kwargs set one
        merged.setdefault("enable_thinking", reasoning_effort != "none")
        merged["reasoning_effort"] = reasoning_effort
    return merged


def chat_tools(request: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The tools as the chat template reads them (None: no tools, or ``tool_choice: none``)."""
    if not request.tools or request.tool_choice == "none":
        return None
    names = [tool.function.name for tool in request.tools]
    if len(set(names)) != len(names):
        raise InvalidRequest("Each tool needs a name of its own.", param="tools")
    return [msgspec.to_builtins(tool) for tool in request.tools]


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
