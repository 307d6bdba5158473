"""Admission and placement. The core is pure; ``scheduler.service`` connects it to NATS."""

if __name__ != "switchyard.scheduler":  # one module, one name: the wheel installs only `switchyard`
    raise ImportError(f"import switchyard.scheduler, not {__name__}")

from typing import TYPE_CHECKING

from switchyard.scheduler.config import SchedulerConfig, SchedulerServiceConfig
from switchyard.scheduler.core import Action, BindSession, Dispatch, FailStream, RequestSnapshot, SchedulerCore
from switchyard.scheduler.policies import POLICIES
from switchyard.scheduler.regions import REGION_POLICIES, RegionPolicy, RegionRouter, Route
from switchyard.schemas import lazy_attributes

if TYPE_CHECKING:
    from switchyard.scheduler.service import SchedulerService
    from switchyard.scheduler.session_store import session_key

_LAZY = {"SchedulerService": "switchyard.scheduler.service", "session_key": "switchyard.scheduler.session_store"}

__all__ = [
    "POLICIES",
    "REGION_POLICIES",
    "Action",
    "BindSession",
    "Dispatch",
    "FailStream",
    "RegionPolicy",
    "RegionRouter",
    "RequestSnapshot",
    "Route",
    "SchedulerConfig",
    "SchedulerCore",
    "SchedulerService",
    "SchedulerServiceConfig",
    "session_key",
]


__getattr__ = lazy_attributes(__name__, _LAZY)
