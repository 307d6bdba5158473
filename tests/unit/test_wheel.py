"""The wheel installs one import package, ``switchyard``, holding every part."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PARTS = ("schemas", "scheduler", "workers", "ingress", "kvbus", "observability", "bench")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    build = tmp_path_factory.mktemp("build")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(ROOT)],
        check=True,
        timeout=300,
        cwd=build,
    )
    (path,) = out.glob("switchyard-*.whl")
    return zipfile.ZipFile(path)


def test_the_wheel_has_one_top_level_package(wheel) -> None:
    tops = {name.split("/", 1)[0] for name in wheel.namelist()}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"switchyard"}
    (info,) = (t for t in tops if t.endswith(".dist-info"))
    assert wheel.read(f"{info}/top_level.txt").decode().split() == ["switchyard"]


def test_every_part_is_inside_it(wheel) -> None:
    names = set(wheel.namelist())
    for part in PARTS:
        assert f"switchyard/{part}/__init__.py" in names, part
    assert "switchyard/models/sim-tiny/tokenizer.json" in names
    assert not any(name.startswith("switchyard/tests") for name in names)


def test_a_part_cannot_be_imported_under_a_second_name() -> None:
    # The repository root is on sys.path here (cwd), as in a checkout: `schemas` is findable.
    proc = subprocess.run(
        [sys.executable, "-c", "import schemas"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode != 0 and "import switchyard.schemas, not schemas" in proc.stderr
