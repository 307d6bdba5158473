"""The scheduler's hot loops in C (``_native.c``, built by the install), or None where they
did not build (no C compiler) or ``SWITCHYARD_NATIVE=0`` turns them off (to compare, in
``bench scheduler`` or ``bench sim``): then the Python they stand in for runs, with the very
same answers (``tests/unit/test_native.py``)."""

import os

try:
    from switchyard.scheduler import _native as native
except ImportError:  # pragma: no cover - a build without a C compiler
    native = None  # type: ignore[assignment]

if os.environ.get("SWITCHYARD_NATIVE", "1") == "0":
    native = None  # type: ignore[assignment]

__all__ = ["native"]
