"""Admission and placement. The core is pure; ``scheduler.service`` connects it to NATS."""

from scheduler.config import SchedulerConfig
from scheduler.core import Action, Dispatch, FailStream, SchedulerCore

__all__ = ["Action", "Dispatch", "FailStream", "SchedulerConfig", "SchedulerCore"]
