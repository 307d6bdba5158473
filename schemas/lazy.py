"""Module attributes that load on first use (PEP 562), for a part's public API.

A part's ``__init__`` names its whole API, but its heavy modules (the HTTP service, the
scheduler's loop, the worker runtime, the vLLM engine) load only when one of their names
is first read, so importing a config (every process's CLI does) pulls no web server or
engine:

    __getattr__ = lazy_attributes(__name__, {"IngressService": "switchyard.ingress.service"})
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from importlib import import_module
from typing import Any

__all__ = ["lazy_attributes"]


def lazy_attributes(module: str, where: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that imports ``where[name]`` and returns its ``name``."""

    def __getattr__(name: str) -> Any:
        if name in where:
            return getattr(import_module(where[name]), name)
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__
