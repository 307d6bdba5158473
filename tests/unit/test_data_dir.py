"""Where ``switchyard up`` keeps JetStream: ``--data-dir``, else the user's data folder (XDG),
one ``up`` per folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from switchyard import procs
from switchyard.up import data_dir, data_store


def test_the_setting_wins_then_xdg_then_home():
    assert data_dir("/srv/sy", {"XDG_DATA_HOME": "/x"}) == Path("/srv/sy")
    assert data_dir("", {"XDG_DATA_HOME": "/x"}) == Path("/x/switchyard")
    home = Path.home() / ".local" / "share" / "switchyard"
    assert data_dir("", {}) == home
    assert data_dir("", {"XDG_DATA_HOME": "relative"}) == home  # XDG: a relative path is ignored


def test_one_up_per_folder(tmp_path):
    with data_store(tmp_path / "data") as store:
        assert store == tmp_path / "data" / "nats"
        with pytest.raises(procs.ProcessError, match="in use by another"), data_store(tmp_path / "data"):
            pass
    with data_store(tmp_path / "data"):  # released when the first stopped
        pass
