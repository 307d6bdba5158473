"""Admission and placement. The core is pure; ``scheduler.service`` connects it to NATS."""

from scheduler.config import SchedulerConfig
from scheduler.core import Action, BindSession, Dispatch, FailStream, RequestSnapshot, SchedulerCore
from scheduler.policies import POLICIES

__all__ = ["Action", "BindSession", "Dispatch", "FailStream", "POLICIES", "RequestSnapshot", "SchedulerConfig",
           "SchedulerCore"]
