"""Admission and placement. The core is pure; ``scheduler.service`` connects it to NATS."""

if __name__ != "switchyard.scheduler":  # one module, one name: the wheel installs only `switchyard`
    raise ImportError(f"import switchyard.scheduler, not {__name__}")

from typing import TYPE_CHECKING, Any

from switchyard.scheduler.config import SchedulerConfig, SchedulerServiceConfig
from switchyard.scheduler.core import Action, BindSession, Dispatch, FailStream, RequestSnapshot, SchedulerCore
from switchyard.scheduler.policies import POLICIES

if TYPE_CHECKING:
    from switchyard.scheduler.service import SchedulerService

_LAZY = {"SchedulerService": "switchyard.scheduler.service"}

__all__ = [
    "POLICIES",
    "Action",
    "BindSession",
    "Dispatch",
    "FailStream",
    "RequestSnapshot",
    "SchedulerConfig",
    "SchedulerCore",
    "SchedulerService",
    "SchedulerServiceConfig",
]


def __getattr__(name: str) -> Any:
    """The heavy parts (the bus loop) load on first use, so that importing the
    light ones (configs, in every process's CLI) pulls no web server, engine or bus client."""
    if name in _LAZY:
        from importlib import import_module

        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
