"""``switchyard build-tiny-model``: seeded, reproducible, built once and then kept."""

from __future__ import annotations

import json

from safetensors.numpy import load_file

from switchyard.cli import main
from switchyard.tiny_model import TinyModelSpec, build_tiny_model, is_built


def test_build_is_seeded_and_kept(tmp_path, capsys) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    assert main(["build-tiny-model", str(a)]) == 0
    assert "built in" in capsys.readouterr().out
    build_tiny_model(b)
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys() and all((wa[k] == wb[k]).all() for k in wa)  # same seed, same weights
    config = json.loads((a / "config.json").read_text())
    assert (config["model_type"], config["num_hidden_layers"], config["num_key_value_heads"]) == ("llama", 2, 2)
    assert json.loads((a / "tokenizer_config.json").read_text())["model_max_length"] == 32_768
    assert (a / "tokenizer.json").exists()
    stamp = (a / "model.safetensors").stat().st_mtime_ns
    assert main(["build-tiny-model", str(a)]) == 0
    assert "kept" in capsys.readouterr().out and (a / "model.safetensors").stat().st_mtime_ns == stamp


def test_other_parameters_or_force_rebuild(tmp_path) -> None:
    build_tiny_model(tmp_path / "m")
    assert is_built(tmp_path / "m") and not is_built(tmp_path / "m", TinyModelSpec(seed=1))
    build_tiny_model(tmp_path / "m", TinyModelSpec(seed=1))
    assert is_built(tmp_path / "m", TinyModelSpec(seed=1)) and not is_built(tmp_path / "m")
    assert not is_built(tmp_path / "absent")
