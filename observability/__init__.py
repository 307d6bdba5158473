"""Tracing across bus hops, metrics, and the instrumented bus connection. A leaf package."""

if __name__ != "switchyard.observability":  # one module, one name: the wheel installs only `switchyard`
    raise ImportError(f"import switchyard.observability, not {__name__}")
