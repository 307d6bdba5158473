"""Tool-call parsers: generated text in, OpenAI ``tool_calls`` out. Pure logic, no I/O.

Three formats, one class each, chosen by name from ``PARSERS`` (``parser_for``):

``hermes`` (Hermes, Qwen 2.5, Qwen 3)
    ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``, any number of them, with
    text around them.
``llama3_json`` (Llama 3.1 to 3.3)
    Only when the output *begins* with a call (after whitespace and an optional
    ``<|python_tag|>``): one or more ``{"name": "f", "parameters": {...}}`` objects
    (``"arguments"`` is accepted too) separated by ``;`` or whitespace. Text after the last call
    is content. An output that begins otherwise is all content, braces or not: vLLM's stream
    decides so too, while its whole-text parse takes any call-shaped JSON anywhere.
``kimi_k2``
    ``<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>
    {...}<|tool_call_end|>...<|tool_calls_section_end|>``. The header ``functions.f:0`` is the
    call's id as the model will see it again, so it is kept as the OpenAI id; the name is the
    header before its last ``:``, less the ``functions.`` prefix. The markers are special tokens,
    hence ``keeps_special_tokens``: the ingress must detokenize with them kept.

One state machine per format does the work; ``parse(text)`` is that machine fed the whole text,
so a stream and a whole-text parse of the same output cannot disagree, however the text is cut.

A call is released only once it is complete and valid: its end marker has arrived (or the
output ended right after a complete JSON object), its JSON decodes, the name is a non-empty
string and the arguments an object (or a string holding one, as some models write). Its
first delta then carries index, id and name, the next one the whole arguments. Why not
stream the arguments piece by piece: a call that turns out malformed could not be taken back,
and the arguments could not be normalised; tool calls are short, so the wait is short too.

Malformed calls (bad JSON, no name, arguments that are no object, cut off by max_tokens) are
not dropped: their text, markers included, is returned as content where it stood. vLLM's
Hermes and Llama parsers return the *whole* output as content then (here the valid calls
around it stay calls); its Kimi K2 parser passes broken arguments on as the call's.

Content is the text outside calls, verbatim, with two rules:
- it never carries part of a marker: a tail that might begin one (``"<tool_"``) is held back,
  and released as soon as it cannot;
- whitespace alone between the output's start or a call and the next call or the output's
  end is dropped (``"\\n<tool_call>..."`` has no content), as vLLM does for Kimi K2.

Arguments are normalised to compact JSON (``json.dumps(value, ensure_ascii=False,
separators=(",", ":"))``); vLLM keeps its default ``", "``/``": "`` spacing (Hermes, Llama) or
the model's own text (Kimi K2): the same JSON value, other bytes. NaN and infinities are
refused (``allow_nan=False``): no OpenAI client could decode them.
"""

from __future__ import annotations

import json
import re
import secrets
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import Enum
from typing import ClassVar, Protocol

from switchyard.ingress.errors import IngressError

__all__ = [
    "PARSERS",
    "Event",
    "HermesParser",
    "KimiK2Parser",
    "Llama3JsonParser",
    "ParsedOutput",
    "StreamingParser",
    "ToolCall",
    "ToolCallDelta",
    "ToolParser",
    "UnknownToolParser",
    "collect",
    "new_call_id",
    "parser_for",
]


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of an object, as OpenAI sends it


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None  # the text outside calls; None when there is none
    tool_calls: list[ToolCall]


@dataclass(frozen=True)
class ToolCallDelta:
    """One ``delta.tool_calls[i]`` of a streamed chunk: the first of a call carries id and name,
    the following ones argument fragments, to be concatenated per index."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


Event = str | ToolCallDelta  # content text, or a piece of a call


class StreamingParser(Protocol):
    def push(self, text: str) -> list[Event]: ...

    def finish(self) -> list[Event]: ...


class UnknownToolParser(IngressError):
    """A tool-call parser name that ``PARSERS`` does not know."""


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def collect(events: Iterable[Event]) -> ParsedOutput:
    """What a client assembles from a stream: content concatenated, arguments per index."""
    content: list[str] = []
    heads: dict[int, ToolCallDelta] = {}
    arguments: dict[int, list[str]] = {}
    for event in events:
        if isinstance(event, str):
            content.append(event)
            continue
        if event.index not in heads:
            heads[event.index] = event
        arguments.setdefault(event.index, []).append(event.arguments)
    calls = [ToolCall(id=h.id or "", name=h.name or "", arguments="".join(arguments[i])) for i, h in heads.items()]
    return ParsedOutput(content="".join(content) or None, tool_calls=calls)


class ToolParser(ABC):
    name: ClassVar[str]
    keeps_special_tokens: ClassVar[bool] = False

    def __init__(self, *, new_id: Callable[[], str] = new_call_id) -> None:
        self._new_id = new_id

    @abstractmethod
    def stream(self) -> StreamingParser:
        """A fresh parser for one streamed output."""

    def parse(self, text: str) -> ParsedOutput:
        stream = self.stream()
        return collect([*stream.push(text), *stream.finish()])


# --- what every format shares: validation, and the events it sends ---------------------------


def _arguments_json(value: object) -> str | None:
    """The compact JSON text of an arguments object, or None if it is no object."""
    if isinstance(value, str):  # some models encode the arguments a second time, as OpenAI's wire does
        value = _loads(value)
    if not isinstance(value, dict):
        return None
    try:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except ValueError:  # NaN or an infinity: valid Python, no valid JSON
        return None


def _loads(text: str) -> object:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # not JSON, or nested past Python's stack
        return None


def _named_call(text: str, arguments_keys: tuple[str, ...]) -> tuple[str, str] | None:
    """(name, arguments JSON) of a ``{"name": ..., "<arguments key>": {...}}`` text, or None."""
    obj = _loads(text.strip())
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    key = next((k for k in arguments_keys if k in obj), None)
    if not isinstance(name, str) or not name or key is None:
        return None
    arguments = _arguments_json(obj[key])
    return None if arguments is None else (name, arguments)


class _Output:
    """The events of one stream: content under the whitespace rule, and numbered calls.

    ``_at_border`` is true at the output's start and after each call: whitespace there is held
    until real text follows (then sent with it) or a call or the end comes (then dropped)."""

    def __init__(self, new_id: Callable[[], str]) -> None:
        self._new_id = new_id
        self._events: list[Event] = []
        self._calls = 0
        self._held = ""
        self._at_border = True

    def text(self, text: str) -> None:
        if self._at_border:
            stripped = text.lstrip()
            self._held += text[: len(text) - len(stripped)]
            if not stripped:
                return
            text, self._held, self._at_border = self._held + stripped, "", False
        if text:
            self._events.append(text)

    def call(self, name: str, arguments: str, call_id: str | None = None) -> None:
        index = self._calls
        self._events.append(ToolCallDelta(index=index, id=call_id or self._new_id(), name=name))
        self._events.append(ToolCallDelta(index=index, arguments=arguments))
        self._calls += 1
        self._held, self._at_border = "", True

    def end(self) -> None:
        if self._calls == 0 and self._held:  # an output of whitespace only, no call: keep it
            self._events.append(self._held)
        self._held = ""

    def take(self) -> list[Event]:
        events, self._events = self._events, []
        return events


def _partial_marker(text: str, markers: Iterable[str]) -> int:
    """The length of the longest tail of ``text`` that is a proper prefix of a marker."""
    best = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:size]):
                best = size
                break
    return best


def _first(text: str, markers: Iterable[str], start: int = 0) -> tuple[int, str] | None:
    """The earliest (position, marker) of any of ``markers`` in ``text`` from ``start``."""
    found = [(i, m) for m in markers if (i := text.find(m, start)) >= 0]
    return min(found) if found else None


# --- marker formats: hermes and kimi_k2 -------------------------------------------------------


@dataclass(frozen=True)
class _Markers:
    opens: str  # a call's first marker
    closes: tuple[str, ...]  # what ends a call
    dropped: tuple[str, ...] = ()  # markers outside calls that carry no content (Kimi's section)


_Call = tuple[str, str, str | None]  # name, arguments JSON, the model's own id if it has one
_MakeCall = Callable[[str], _Call | None]  # a call's body -> the call, or None if malformed


class _MarkerStream:
    """Content until ``opens``, a call body until one of ``closes``, and so on.

    ``_pending`` holds what is not decided yet: a tail that may begin a marker in content, or
    the body of an open call. ``_scanned`` is how far a call body was already searched for a
    closing marker, so a long body is not searched again from its start on every push."""

    def __init__(self, markers: _Markers, make_call: _MakeCall, new_id: Callable[[], str]) -> None:
        self._markers = markers
        self._make_call = make_call
        self._out = _Output(new_id)
        self._pending = ""
        self._in_call = False
        self._scanned = 0

    def push(self, text: str) -> list[Event]:
        self._pending += text
        while self._step():
            pass
        return self._out.take()

    def finish(self) -> list[Event]:
        if self._in_call:
            self._end_call(self._pending, closing="")
        else:
            self._out.text(self._pending)
        self._pending = ""
        self._out.end()
        return self._out.take()

    def _step(self) -> bool:
        """One decision on ``_pending``; False when it needs more text."""
        return self._step_call() if self._in_call else self._step_content()

    def _step_content(self) -> bool:
        markers = (self._markers.opens, *self._markers.dropped)
        found = _first(self._pending, markers)
        if found is None:
            keep = _partial_marker(self._pending, markers)
            self._out.text(self._pending[: len(self._pending) - keep])
            self._pending = self._pending[len(self._pending) - keep :]
            return False
        at, marker = found
        self._out.text(self._pending[:at])
        self._pending = self._pending[at + len(marker) :]
        if marker == self._markers.opens:
            self._in_call, self._scanned = True, 0
        return True

    def _step_call(self) -> bool:
        closes = self._markers.closes
        found = _first(self._pending, closes, start=self._scanned)
        if found is None:
            self._scanned = max(0, len(self._pending) - max(map(len, closes)) + 1)
            return False
        at, marker = found
        self._end_call(self._pending[:at], closing=marker)
        self._pending = self._pending[at + len(marker) :]
        return True

    def _end_call(self, body: str, closing: str) -> None:
        self._in_call = False
        call = self._make_call(body)
        if call is None:  # malformed: its text goes back to content, as it stood
            self._out.text(self._markers.opens + body + closing)
        else:
            self._out.call(*call)


class HermesParser(ToolParser):
    name = "hermes"
    # As vLLM: some Hermes-format models make <tool_call> a special token; Qwen's are not.
    keeps_special_tokens = True
    _MARKERS = _Markers(opens="<tool_call>", closes=("</tool_call>",))

    def stream(self) -> StreamingParser:
        return _MarkerStream(self._MARKERS, self._call, self._new_id)

    @staticmethod
    def _call(body: str) -> _Call | None:
        call = _named_call(body, ("arguments",))
        return None if call is None else (*call, None)


_KIMI_HEADER = re.compile(r"(?P<name>.+):\d+")


class KimiK2Parser(ToolParser):
    name = "kimi_k2"
    keeps_special_tokens = True
    _ARGUMENTS = "<|tool_call_argument_begin|>"
    _SECTION_END = "<|tool_calls_section_end|>"
    _MARKERS = _Markers(
        opens="<|tool_call_begin|>",
        closes=("<|tool_call_end|>", _SECTION_END),
        dropped=("<|tool_calls_section_begin|>", _SECTION_END),
    )

    def stream(self) -> StreamingParser:
        return _MarkerStream(self._MARKERS, self._call, self._new_id)

    @classmethod
    def _call(cls, body: str) -> _Call | None:
        header, found, raw_arguments = body.partition(cls._ARGUMENTS)
        header = header.strip()
        match = _KIMI_HEADER.fullmatch(header)
        if not found or match is None:
            return None
        name = match["name"].removeprefix("functions.")
        arguments = _arguments_json(_loads(raw_arguments) if raw_arguments.strip() else {})
        if not name or arguments is None:
            return None
        return name, arguments, header


# --- llama3_json: JSON objects at the output's start ------------------------------------------


class _JsonObjectEnd:
    """Finds where a JSON object that starts at ``{`` ends, text pushed piece by piece: brace
    depth, outside strings. It does not validate; ``json.loads`` does, once the braces close."""

    def __init__(self) -> None:
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def feed(self, text: str) -> int | None:
        """The index in ``text`` just past the object's closing brace, or None if still open."""
        for i, char in enumerate(text):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char == "{":
                self._depth += 1
            elif char == "}":
                self._depth -= 1
                if self._depth == 0:
                    return i + 1
        return None


class _Llama3State(Enum):
    START = "start"  # whitespace and the python tag, until ``{`` or anything else
    OBJECT = "object"  # a call's JSON, until its braces close
    BETWEEN = "between"  # separators after a call
    CONTENT = "content"  # everything else, to the end


class _Llama3Stream:
    """``_pending`` is the text not decided yet. In ``OBJECT`` it holds the object from
    ``_object_at``, preceded (for the first call) by the whitespace and tag, which come back
    as content if the object is no call."""

    _TAG = "<|python_tag|>"
    _SEPARATORS = " \t\r\n;"

    def __init__(self, new_id: Callable[[], str]) -> None:
        self._out = _Output(new_id)
        self._state = _Llama3State.START
        self._pending = ""
        self._object_at = 0  # where the object begins in _pending
        self._scanned = 0  # how much of _pending the brace scanner has seen
        self._object = _JsonObjectEnd()

    def push(self, text: str) -> list[Event]:
        self._pending += text
        while self._step():
            pass
        return self._out.take()

    def finish(self) -> list[Event]:
        if self._state is not _Llama3State.BETWEEN:  # an unclosed object is no call
            self._out.text(self._pending)
        self._pending = ""
        self._out.end()
        return self._out.take()

    def _step(self) -> bool:
        if not self._pending:
            return False
        match self._state:
            case _Llama3State.START:
                return self._step_start()
            case _Llama3State.OBJECT:
                return self._step_object()
            case _Llama3State.BETWEEN:
                return self._step_between()
            case _Llama3State.CONTENT:
                self._out.text(self._pending)
                self._pending = ""
                return False

    def _step_start(self) -> bool:
        rest = self._pending.lstrip()
        if rest.startswith(self._TAG):
            rest = rest[len(self._TAG) :].lstrip()
        elif self._TAG.startswith(rest):  # empty, or a tag still arriving
            return False
        if not rest:
            return False
        self._open(rest, at=len(self._pending) - len(rest))
        return True

    def _step_between(self) -> bool:
        rest = self._pending.lstrip(self._SEPARATORS)
        if not rest:
            self._pending = ""
            return False
        self._pending = rest
        self._open(rest, at=0)
        return True

    def _open(self, rest: str, at: int) -> None:
        """``rest``, the undecided text from ``at`` in ``_pending``, opens an object or content."""
        if not rest.startswith("{"):
            self._state = _Llama3State.CONTENT
            return
        self._state = _Llama3State.OBJECT
        self._object_at, self._scanned, self._object = at, at, _JsonObjectEnd()

    def _step_object(self) -> bool:
        end = self._object.feed(self._pending[self._scanned :])
        if end is None:
            self._scanned = len(self._pending)
            return False
        end += self._scanned
        call = _named_call(self._pending[self._object_at : end], ("arguments", "parameters"))
        if call is None:  # not a call: this and all that follows is content
            self._state = _Llama3State.CONTENT
            return True
        self._out.call(*call)
        self._pending = self._pending[end:]
        self._state = _Llama3State.BETWEEN
        return True


class Llama3JsonParser(ToolParser):
    name = "llama3_json"

    def stream(self) -> StreamingParser:
        return _Llama3Stream(self._new_id)


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser, KimiK2Parser)}


def parser_for(name: str, *, new_id: Callable[[], str] = new_call_id) -> ToolParser:
    try:
        return PARSERS[name](new_id=new_id)
    except KeyError:
        known = ", ".join(sorted(PARSERS))
        raise UnknownToolParser(f"unknown tool-call parser {name!r}; known: {known}") from None
