"""The root of every error Switchyard raises, in the innermost part so that every part
may import it without breaking the layering (``schemas`` imports nothing of ours).

Each part keeps its own subtree next to its code; this is the whole tree:

SwitchyardError
├── IngressError                      switchyard.ingress.errors
│   ├── ApiError                      an HTTP answer: status, OpenAI type, code, param
│   │   ├── InvalidRequest            400
│   │   │   └── ContextLengthExceeded 400 code=context_length_exceeded
│   │   ├── Unauthorized              401 code=invalid_api_key
│   │   ├── PermissionDenied          403 code=permission_denied
│   │   ├── ModelNotFound             404
│   │   ├── RequestTooLarge           413
│   │   ├── RateLimited               429 with Retry-After
│   │   ├── Unavailable               503
│   │   └── GenerationFailed          502
│   │       └── DeadlineExceeded      504
│   ├── StreamFailed                  switchyard.ingress.streams: a token stream ended in an error chunk
│   ├── TokenizerError                switchyard.ingress.tokenizer: a model folder or chat template we cannot use
│   ├── ServiceError                  switchyard.ingress.service: the ingress cannot start as configured
│   └── KeyStoreError                 switchyard.ingress.auth: a keys file we cannot read or write
├── WorkerError                       switchyard.workers.errors
│   └── EngineError                   an engine failed a request, or one of its own tasks died
├── TracingError                      switchyard.observability.tracing: an exporter this install lacks
├── BusClosedError                    switchyard.observability.bus: the NATS server closed a connection for good
├── BusAuthError                      switchyard.observability.bus: credentials or a subscription the server refuses
├── LeaseLostError                    switchyard.scheduler.lease: an active scheduler's lease lapsed or was taken
├── ConfigError (+ ValueError)        switchyard.settings: a setting that cannot be used (name, source, why)
├── ProcessError                      switchyard.procs: a child process did not start or get ready
├── TraceError (+ ValueError)         switchyard.bench.traces: a benchmark trace that cannot be read
└── DocError (+ ValueError)           switchyard.bench.simdoc: doc markers without results

Beyond a lost lease, the scheduler and kvbus raise no error of their own: their argument checks are
``ValueError``s, as Python's are. Expected outcomes ("no capacity", "rejected") are
message variants on the bus, never exceptions. Where callers already catch a builtin
(``ValueError``), a class keeps it as a second base.
"""

from __future__ import annotations

__all__ = ["SwitchyardError"]


class SwitchyardError(Exception):
    """Anything Switchyard itself raises on purpose; ``except SwitchyardError`` catches it all."""
