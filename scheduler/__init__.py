"""Admission and placement. The core is pure; ``scheduler.service`` connects it to NATS."""

if __name__ != "switchyard.scheduler":  # one module, one name: the wheel installs only `switchyard`
    raise ImportError(f"import switchyard.scheduler, not {__name__}")

from switchyard.scheduler.config import SchedulerConfig
from switchyard.scheduler.core import Action, BindSession, Dispatch, FailStream, RequestSnapshot, SchedulerCore
from switchyard.scheduler.policies import POLICIES

__all__ = [
    "POLICIES",
    "Action",
    "BindSession",
    "Dispatch",
    "FailStream",
    "RequestSnapshot",
    "SchedulerConfig",
    "SchedulerCore",
]
