"""Benchmarks, run through ``switchyard bench``; each prints a table and writes PNG plots."""

if __name__ != "switchyard.bench":  # one module, one name: the wheel installs only `switchyard`
    raise ImportError(f"import switchyard.bench, not {__name__}")
