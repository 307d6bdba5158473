"""Admission and placement. The core is pure; ``scheduler.service`` connects it to NATS."""

from scheduler.config import SchedulerConfig
from scheduler.core import Action, Dispatch, FailStream, RequestSnapshot, SchedulerCore

__all__ = ["Action", "Dispatch", "FailStream", "RequestSnapshot", "SchedulerConfig", "SchedulerCore"]
