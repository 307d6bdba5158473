"""One error root: every exception class the package defines descends from ``SwitchyardError``."""

from __future__ import annotations

import importlib
import inspect
import math
import pkgutil

import pytest

from switchyard.ingress.errors import ApiError, IngressError, InvalidRequest
from switchyard.schemas import SwitchyardError

PARTS = ("schemas", "observability", "scheduler", "kvbus", "workers", "ingress", "bench")

# Not errors, or not ours to re-parent yet; each says why.
EXEMPT = {
    "switchyard.up._Stop": "a signal unwinding `switchyard up` to exit 0, caught where it is raised",
}


def _modules():
    names = [m.name for m in pkgutil.iter_modules(importlib.import_module("switchyard").__path__, "switchyard.")]
    for part in PARTS:
        package = importlib.import_module(f"switchyard.{part}")
        names += [package.__name__]
        names += [m.name for m in pkgutil.walk_packages(package.__path__, f"{package.__name__}.")]
    return [importlib.import_module(name) for name in names if name != "switchyard.__main__"]


def _exception_classes():
    for module in _modules():
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if issubclass(obj, BaseException) and obj.__module__ == module.__name__:
                yield obj


def test_every_exception_class_descends_from_the_root():
    found = {f"{cls.__module__}.{cls.__qualname__}": cls for cls in _exception_classes()}
    assert "switchyard.ingress.errors.ApiError" in found  # the walk reached the parts
    strays = sorted(name for name, cls in found.items() if not issubclass(cls, SwitchyardError) and name not in EXEMPT)
    assert strays == []
    assert set(EXEMPT) <= set(found)  # an exemption whose class is gone or re-parented goes too


def test_the_root_is_exported_where_every_part_may_import_it():
    import switchyard.schemas

    assert "SwitchyardError" in switchyard.schemas.__all__
    assert SwitchyardError.__module__ == "switchyard.schemas.errors"


@pytest.mark.parametrize("cls", [InvalidRequest, ApiError])
def test_ingress_errors_are_caught_by_their_subtree_and_the_root(cls):
    with pytest.raises(IngressError):
        raise cls("x")
    with pytest.raises(SwitchyardError):
        raise cls("x")


@pytest.mark.parametrize(
    ("code", "status"), [("overloaded", 429), ("deadline_exceeded", 504), ("worker_lost", 502), ("internal", 502)]
)
def test_a_failed_stream_becomes_the_http_error_its_code_means(code, status):
    from switchyard.ingress.errors import generation_error

    error = generation_error(code, "why")
    assert (error.status, error.code, error.message) == (status, code, "why")


@pytest.mark.parametrize(
    ("seconds", "header"),
    [(0.0, "1"), (0.2, "1"), (1.0, "1"), (1.01, "2"), (-5.0, "1"), (7200.0, "3600"), (math.inf, "3600"),
     (-math.inf, "1"), (math.nan, "1")],
)  # fmt: skip
def test_a_retry_after_is_whole_seconds_from_one_to_an_hour_whatever_the_wait_said(seconds, header):
    error = ApiError("busy", retry_after_s=seconds)
    assert error.headers() == {"retry-after": header}
