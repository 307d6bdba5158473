"""The workers' errors (the subtree of ``SwitchyardError`` drawn in ``switchyard.schemas.errors``).

WorkerError
└── EngineError     an engine failed a request, or one of its own tasks died

A failed prefill or decode fails its requests, not the worker (the roles catch it and
report ``PrefillFailed`` or an aborted sequence); an engine task that dies takes the
worker down with this error.
"""

from __future__ import annotations

from switchyard.schemas import SwitchyardError


class WorkerError(SwitchyardError):
    """Anything a worker raises on purpose."""


class EngineError(WorkerError):
    """An engine could not serve: no output for a request, or a task of its own failed."""
