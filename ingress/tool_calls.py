"""A chat request's tools: how its output becomes ``tool_calls``.

``tool_choice`` decides (``ToolPlan.of``):

- ``none`` (or no tools): no plan; the output is text, and the template is not shown the tools.
- ``auto`` (the default with tools): the model may call; the ingress's ``--tool-call-parser``
  (``ingress.tool_parsers``) finds the calls in the text as it streams. No parser configured:
  a 400, since calls would come back as text.
- a named function: the output is constrained to that function's ``parameters`` schema
  (``StructuredOutput``), so even a weak model writes valid arguments; they stream as they come.
- ``required``: the output is constrained to a JSON array of ``{"name", "parameters"}``, one
  item per call (at most one when ``parallel_tool_calls`` is false), with each name one of the
  tools and its parameters that tool's schema: the shape vLLM uses. The calls are sent when the
  array is complete.

Either way a finished output that holds calls ends with ``finish_reason: "tool_calls"``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from switchyard.ingress.errors import InvalidRequest
from switchyard.ingress.openai_types import ChatCompletionRequest, NamedToolChoice
from switchyard.ingress.sampling import schema_text
from switchyard.ingress.tool_parsers import (
    Event,
    StreamingParser,
    ToolCallDelta,
    ToolParser,
    new_call_id,
    parser_for,
)
from switchyard.schemas import StructuredOutput

Mode = Literal["auto", "named", "required"]
_ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class ToolPlan:
    mode: Mode
    parameters: dict[str, dict[str, Any]]  # each tool's name -> its parameters schema
    parser: ToolParser | None = None  # auto
    name: str | None = None  # named
    parallel: bool = True

    @classmethod
    def of(cls, body: ChatCompletionRequest, parser_name: str) -> ToolPlan | None:
        if not body.tools or body.tool_choice == "none":
            return None
        parameters = {tool.function.name: tool.function.parameters or _ANY_OBJECT for tool in body.tools}
        choice = body.tool_choice
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in parameters:
                raise InvalidRequest(
                    f"`tool_choice` names {choice.function.name!r}, which is not in `tools`.", param="tool_choice"
                )
            return cls("named", parameters, name=choice.function.name)
        if choice == "required":
            return cls("required", parameters, parallel=body.parallel_tool_calls)
        if not parser_name:
            raise InvalidRequest(
                "`tool_choice: auto` needs a tool-call parser, and this server has none (--tool-call-parser); "
                "a named `tool_choice` or `required` works without one.",
                param="tool_choice",
            )
        return cls("auto", parameters, parser=parser_for(parser_name), parallel=body.parallel_tool_calls)

    @property
    def keeps_special_tokens(self) -> bool:
        """Whether the text must keep special tokens: the parser's markers may be some."""
        return self.parser is not None and self.parser.keeps_special_tokens

    def constraint(self) -> StructuredOutput | None:
        """What the output is held to, for a forced call."""
        if self.mode == "named":
            assert self.name is not None
            return StructuredOutput(json_schema=schema_text(self.parameters[self.name], "tools"))
        if self.mode == "required":
            items = [
                {
                    "type": "object",
                    "properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
                    "required": ["name", "parameters"],
                }
                for name, schema in self.parameters.items()
            ]
            array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
            if not self.parallel:
                array["maxItems"] = 1
            return StructuredOutput(json_schema=schema_text(array, "tools"))
        return None

    def stream(self) -> StreamingParser:
        """A fresh reader of one output's text, giving content and call deltas."""
        if self.mode == "auto":
            assert self.parser is not None
            return _OnlyParallel(self.parser.stream()) if not self.parallel else self.parser.stream()
        if self.mode == "named":
            assert self.name is not None
            return _NamedCall(self.name)
        return _RequiredCalls()


@dataclass
class _NamedCall:
    """The whole output is the arguments of one call to ``name``."""

    name: str
    _started: bool = False

    def push(self, text: str) -> list[Event]:
        if not text:
            return []
        if self._started:
            return [ToolCallDelta(index=0, arguments=text)]
        self._started = True
        return [ToolCallDelta(index=0, id=new_call_id(), name=self.name, arguments=text)]

    def finish(self) -> list[Event]:
        return [] if self._started else self.push("{}")  # an empty output: no arguments


@dataclass
class _RequiredCalls:
    """The output is a JSON array of calls, sent once complete (an array cut short is text)."""

    _text: list[str] = field(default_factory=list)

    def push(self, text: str) -> list[Event]:
        self._text.append(text)
        return []

    def finish(self) -> list[Event]:
        text = "".join(self._text)
        try:
            calls = json.loads(text)
        except ValueError:
            return [text] if text else []
        if not isinstance(calls, list) or not all(_is_call(c) for c in calls):
            return [text]
        events: list[Event] = []
        for i, call in enumerate(calls):
            arguments = json.dumps(call["parameters"], ensure_ascii=False, separators=(",", ":"))
            events.append(ToolCallDelta(index=i, id=new_call_id(), name=call["name"], arguments=arguments))
        return events


def _is_call(value: object) -> bool:
    return isinstance(value, dict) and isinstance(value.get("name"), str) and isinstance(value.get("parameters"), dict)


@dataclass
class _OnlyParallel:
    """``parallel_tool_calls: false`` with a parser: the first call is kept, later ones dropped."""

    inner: StreamingParser

    def push(self, text: str) -> list[Event]:
        return self._first(self.inner.push(text))

    def finish(self) -> list[Event]:
        return self._first(self.inner.finish())

    @staticmethod
    def _first(events: list[Event]) -> list[Event]:
        return [e for e in events if isinstance(e, str) or e.index == 0]
