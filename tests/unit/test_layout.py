"""The package's shape: dependencies point inward, callers outside a part use its public API,
and each part's ``__all__`` names what it really exports."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PARTS = ("schemas", "observability", "scheduler", "kvbus", "workers", "ingress", "bench", "switchyard")
# What each part may import of ours: inward only. The composition root (switchyard/: CLI,
# settings, up) sits on top; the benchmarks may use it, but not the CLI itself.
ALLOWED = {
    "schemas": set(),
    "observability": {"schemas"},
    "scheduler": {"schemas", "observability"},
    "kvbus": {"schemas", "observability"},
    "workers": {"schemas", "observability", "kvbus"},
    # The ingress routes among regions with the scheduler's pure region router (scheduler.regions)
    # and keys sessions as the scheduler does: pure code, no service of the scheduler.
    "ingress": {"schemas", "observability", "scheduler", "kvbus"},
    "bench": {"schemas", "observability", "scheduler", "kvbus", "workers", "ingress", "switchyard"},
    "switchyard": set(PARTS) - {"switchyard"},
}


def _imports(part: str) -> list[tuple[str, int, str]]:
    """(file, line, module) of every `switchyard.*` import in a part, lazy ones included."""
    found = []
    for path in sorted((ROOT / part).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            modules = []
            if isinstance(node, ast.ImportFrom) and node.module:
                modules = [node.module]
            elif isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            found += [(str(path.relative_to(ROOT)), node.lineno, m) for m in modules if m.startswith("switchyard.")]
    return found


def _target(module: str) -> tuple[str, bool]:
    """The part a module belongs to, and whether it names a module inside that part."""
    bits = module.split(".")
    if len(bits) > 1 and bits[1] in PARTS:
        return bits[1], len(bits) > 2
    return "switchyard", True


@pytest.mark.parametrize("part", PARTS)
def test_dependencies_point_inward(part) -> None:
    wrong = [
        f"{f}:{line} {m}" for f, line, m in _imports(part) if (t := _target(m)[0]) != part and t not in ALLOWED[part]
    ]
    assert wrong == []


@pytest.mark.parametrize("part", PARTS)
def test_other_parts_are_used_through_their_public_api(part) -> None:
    inner = [
        f"{f}:{line} {m}"
        for f, line, m in _imports(part)
        if (target := _target(m))[0] != part and target[0] != "switchyard" and target[1]
    ]
    assert inner == []


def test_the_benchmarks_do_not_import_the_cli() -> None:
    assert [m for _, _, m in _imports("bench") if m == "switchyard.cli"] == []


@pytest.mark.parametrize("part", [p for p in PARTS if p not in ("bench", "switchyard")])
def test_every_public_name_exists(part) -> None:
    module = importlib.import_module(f"switchyard.{part}")
    names = module.__all__
    assert names, f"switchyard.{part} names no public API"
    assert sorted(set(names)) == sorted(names), "duplicates in __all__"
    missing = [n for n in names if not hasattr(module, n)]
    assert missing == []
