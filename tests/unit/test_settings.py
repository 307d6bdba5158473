"""Configuration: every setting declared once on the config trees; flag > environment > file >
default; a bad value from any source is one error naming the setting and its source."""

from __future__ import annotations

import subprocess
import sys

import msgspec
import pytest

from switchyard import cli, settings, up
from switchyard.ingress.config import IngressConfig
from switchyard.scheduler.config import SchedulerServiceConfig
from switchyard.settings import ConfigError, Sources
from switchyard.workers.config import WorkerConfig


def _sources(argv: list[str], env: dict[str, str] | None = None, toml: str | None = None, tmp_path=None) -> Sources:
    if toml is not None:
        path = tmp_path / "switchyard.toml"
        path.write_text(toml)
        argv = [*argv, "--config", str(path)]
    return cli.sources_of(cli.build_parser().parse_args(argv), env=env or {})


def _budget(sources: Sources) -> settings.Value:
    resolved = settings.resolve(WorkerConfig, sources, "worker", fixed={"role": "prefill"})
    return settings.Value(resolved.config.token_budget, resolved.origin["token-budget"].source)


def test_flag_beats_environment_beats_file_beats_default(tmp_path) -> None:
    toml = "token-budget = 100\n[worker]\ntoken_budget = 200\n"
    env = {"SWITCHYARD_TOKEN_BUDGET": "300"}
    flag = ["worker", "--token-budget", "400"]
    assert _budget(_sources(flag, env, toml, tmp_path)) == settings.Value(400, "flag --token-budget")
    assert _budget(_sources(["worker"], env, toml, tmp_path)) == settings.Value(
        300, "environment SWITCHYARD_TOKEN_BUDGET"
    )
    from_file = _budget(_sources(["worker"], {}, toml, tmp_path))
    assert from_file.value == 200 and "[worker] token_budget" in from_file.source  # the service's table wins
    top = _budget(_sources(["worker"], {}, "token-budget = 100\n", tmp_path))
    assert top.value == 100 and "(top level)" in top.source
    assert _budget(_sources(["worker"])) == settings.Value(65_536, "default")


def test_the_config_file_can_come_from_the_environment(tmp_path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("[scheduler]\npolicy = 'prefix'\n")
    sources = _sources(["scheduler"], {"SWITCHYARD_CONFIG": str(path)})
    assert settings.resolve(SchedulerServiceConfig, sources, "scheduler").config.core.policy == "prefix"


@pytest.mark.parametrize(
    ("argv", "env", "toml", "message"),
    [
        (
            ["worker", "--token-budget", "0"],
            {},
            None,
            r"token-budget: '0' from flag --token-budget: Expected `int` >= 1",
        ),
        (
            ["worker"],
            {"SWITCHYARD_TOKEN_BUDGET": "lots"},
            None,
            "token-budget: 'lots' from environment SWITCHYARD_TOKEN_BUDGET",
        ),
        (["worker"], {}, "[worker]\ntoken-budget = -5\n", r"token-budget: -5 from file .*\[worker\] token-budget"),
        (["worker"], {}, 'token-budget = "5"\n', r"token-budget: '5' from file .*\(top level\)"),
        (["worker", "--kv-transfer", "carrier-pigeon"], {}, None, "choose one of mooncake-store, lmcache, nixl, none"),
        (["worker", "--report-interval-s", "soon"], {}, None, "report-interval-s: 'soon' from flag"),
    ],
)
def test_a_bad_value_names_the_setting_and_its_source(tmp_path, argv, env, toml, message) -> None:
    with pytest.raises(ConfigError, match=message):
        _budget(_sources(argv, env, toml, tmp_path))


def test_names_that_no_setting_has_are_errors_not_ignored(tmp_path) -> None:
    with pytest.raises(ConfigError, match="environment SWITCHYARD_TOKEN_BUGDET: no such setting"):
        _sources(["worker"], {"SWITCHYARD_TOKEN_BUGDET": "1"})
    with pytest.raises(ConfigError, match=r"\[worker\]: no such setting 'tokens'"):
        _sources(["worker"], {}, "[worker]\ntokens = 1\n", tmp_path)
    with pytest.raises(ConfigError, match=r"unknown table \[workers\]"):
        _sources(["worker"], {}, "[workers]\ntoken-budget = 1\n", tmp_path)
    with pytest.raises(ConfigError, match=r"config file .*: Invalid value"):
        _sources(["worker"], {}, "token-budget = = 1\n", tmp_path)
    with pytest.raises(ConfigError, match=r"config file /nonexistent\.toml"):
        cli.sources_of(cli.build_parser().parse_args(["worker", "--config", "/nonexistent.toml"]), env={})
    assert _sources(["worker"], {"SWITCHYARD_GPU": "1"}).env == {}  # not a setting, and not refused


def test_a_missing_required_setting_says_how_to_give_it() -> None:
    with pytest.raises(ConfigError, match=r"role: required \(--role, SWITCHYARD_ROLE or role in \[worker\]"):
        settings.resolve(WorkerConfig, _sources(["worker"]), "worker")


def test_every_setting_is_declared_with_help_and_each_name_means_one_thing() -> None:
    by_name: dict[str, set[object]] = {}
    for trees in settings.COMMAND_TREES.values():
        for tree in trees:
            for s in settings.settings_of(tree):
                assert s.help, f"{tree.__name__}.{'.'.join(s.path)} has no help text"
                by_name.setdefault(s.name, set()).add(settings._strip(s.hint))
    # A name shared by several trees (block-size, hash-seed, model, nats...) is one setting: one type.
    mixed = {name: types for name, types in by_name.items() if len(types) > 1}
    assert mixed == {}


def test_up_checks_every_child_before_anything_starts() -> None:
    with pytest.raises(ConfigError, match="key-scheme: 'blake2b' from flag --key-scheme: the vllm engine needs"):
        up.plan(_sources(["up", "--engine", "vllm", "--model", str(settings.BUNDLED_MODEL), "--key-scheme", "blake2b"]))
    with pytest.raises(ConfigError, match="block_size must be a positive multiple of 16"):
        up.plan(_sources(["up", "--block-size", "20"]))


def test_up_hands_each_child_its_whole_config_as_data(tmp_path) -> None:
    toml = "[worker]\ntoken-budget = 4096\n[scheduler]\npolicy = 'least_tokens'\n"
    plan = up.plan(
        _sources(["up", "--prefill", "2", "--port", "9123"], {"SWITCHYARD_LOG_LEVEL": "debug"}, toml, tmp_path)
    )
    names = ["scheduler", "prefill-0", "prefill-1", "decode-0", "ingress", "batch-runner"]
    assert [c.name for c in plan.children] == names
    trees = {}
    for child in plan.children:
        command, env = up.child_spec(child, "nats://127.0.0.1:5555")
        assert command[-3:] == [child.command, "--child", child.name]
        process, trees[child.name] = settings.decode_child(
            env[settings.CONFIG_DATA_ENV], settings.COMMAND_TREES[child.command][1]
        )
        assert process.log_level == "debug" and trees[child.name].nats_url == "nats://127.0.0.1:5555"
    assert trees["prefill-1"].role == "prefill" and trees["decode-0"].role == "decode"
    assert trees["decode-0"].token_budget == 4096 and trees["decode-0"].model == "switchyard-sim"
    assert trees["scheduler"].core.policy == "least_tokens" and trees["ingress"].port == 9123


def test_a_child_refuses_flags_beside_its_data_and_data_it_cannot_read(monkeypatch, capsys) -> None:
    assert cli.main(["worker", "--child", "prefill-0"]) == 2
    assert "no SWITCHYARD_CONFIG_DATA" in capsys.readouterr().err
    monkeypatch.setenv(settings.CONFIG_DATA_ENV, '{"process": {}, "config": {"role": "nonsense"}}')
    assert cli.main(["worker", "--child", "prefill-0"]) == 2
    assert "SWITCHYARD_CONFIG_DATA" in capsys.readouterr().err
    assert cli.main(["worker", "--child", "prefill-0", "--token-budget", "5"]) == 2
    assert "not as flags" in capsys.readouterr().err


def test_config_show_prints_every_service_with_sources(capsys) -> None:
    assert cli.main(["config", "show", "--decode", "2", "--policy", "prefix"]) == 0
    out = capsys.readouterr().out
    for table in ("[up]", "[scheduler]", "[worker: prefill (x1)]", "[worker: decode (x2)]", "[ingress]"):
        assert table in out
    assert any(line.startswith('policy = "prefix"') and line.endswith("# flag --policy") for line in out.splitlines())
    assert any(
        line.startswith('served-model-name = "switchyard-sim"') and "tokenizer" in line for line in out.splitlines()
    )
    assert cli.main(["config", "show", "--json"]) == 0
    trees = msgspec.json.decode(capsys.readouterr().out)
    assert trees["decode-0"]["role"] == "decode" and trees["ingress"]["block_size"] == 16


def test_a_bad_value_stops_the_cli_before_any_process_starts() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "switchyard", "up", "--token-budget", "-1"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2
    assert "token-budget: '-1' from flag --token-budget" in proc.stderr
    assert "nats" not in proc.stdout.lower()  # nothing was started


def test_engine_dependent_defaults() -> None:
    plan = up.plan(_sources(["up"]))
    ingress = next(c.config for c in plan.children if isinstance(c.config, IngressConfig))
    assert (ingress.block_size, ingress.key_scheme, plan.up.ready_timeout_s) == (16, "blake2b", 60.0)
    ingress = settings.resolve(
        IngressConfig, _sources(["ingress"]), "ingress", defaults=settings.engine_defaults("vllm")
    )
    assert (ingress.config.block_size, ingress.config.key_scheme) == (32, "vllm-sha256-cbor")
