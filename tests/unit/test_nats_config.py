"""switchyard nats-config: what it renders, what it refuses, and that nats-server takes every
file it writes (``nats-server -t``: parsed and checked, nothing started)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from switchyard import nats_config
from switchyard.cli import main
from switchyard.nats_config import Address, ConfigError, LeafSpec
from switchyard.procs import nats_server_binary
from switchyard.schemas import subjects

THREE = "us=nats-us.example.net:7222,eu=nats-eu.example.net:7222,ap=10.0.3.1:7300"


def _nats_check(path: Path) -> None:
    """nats-server's own verdict on a config file; its message on failure."""
    done = subprocess.run(
        [str(nats_server_binary()), "-t", "-c", str(path)], capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stdout + done.stderr


def _render(text: str, name: str, **overrides) -> str:
    regions = nats_config.parse_regions(text)
    return nats_config.render(nats_config.own(regions, name, **overrides), regions)


def _accounts(config: str) -> str:
    return config[config.index("accounts {") : config.index("system_account")]


# --- rendering ---------------------------------------------------------------------------------


def test_every_region_gets_the_same_accounts_and_its_own_server():
    configs = {name: _render(THREE, name) for name in ("us", "eu", "ap")}
    assert len({_accounts(c) for c in configs.values()}) == 1
    for name, config in configs.items():
        assert f'server_name: "{name}-0"' in config
        assert f'no_auth_user: "{name}"' in config
        assert f'name: "{name}"' in config  # cluster and gateway
    assert 'advertise: "10.0.3.1:7300"' in configs["ap"]
    assert 'listen: "0.0.0.0:7300"' in configs["ap"]  # the gateway listens on its advertised port by default


def test_a_region_exports_its_federation_subjects_and_imports_the_others():
    accounts = _accounts(_render(THREE, "us"))
    us = accounts[accounts.index("  US: {") : accounts.index("  EU: {")]
    for subject in (subjects.fed_root("us"), subjects.every_stream(), *subjects.FED_SERVICES.values()):
        assert f'"{subject}"' in us.split("imports")[0]
    for other in ("eu", "ap"):
        source = f'account: "{other.upper()}"'
        assert f'{{ stream: {{ {source}, subject: "{subjects.fed_root(other)}" }} }}' in us
        assert f'{{ stream: {{ {source}, subject: "{subjects.region_streams("us")}" }} }}' in us
        for name, subject in subjects.FED_SERVICES.items():
            to = subjects.to_region(other, name)
            assert f'{{ service: {{ {source}, subject: "{subject}" }}, to: "{to}" }}' in us


def test_flags_override_the_own_regions_ports_and_store():
    config = _render(
        THREE, "eu", client_port=4300, cluster_port=6300, gateway_port=7999, leafnode_port=7422, http_port=8222,
        store_dir="/data/js", host="10.0.2.1",
    )  # fmt: skip
    for line in (
        'listen: "10.0.2.1:4300"',
        'http: "10.0.2.1:8222"',
        'store_dir: "/data/js"',
        'routes: ["nats://10.0.2.1:6300"]',
        'listen: "10.0.2.1:7999"',
        'advertise: "nats-eu.example.net:7222"',
        '{ user: "leaf-eu", account: "EU" }',
    ):
        assert line in config


def test_leaf_binds_its_clients_to_the_regions_leaf_user_and_has_no_jetstream():
    config = nats_config.render_leaf(LeafSpec(region="eu", hub=Address("hub.example.net", 7422), client_port=4333))
    assert 'url: "nats://leaf-eu@hub.example.net:7422"' in config
    assert "jetstream" not in config
    assert 'server_name: "eu-leaf-4333"' in config


# --- nats-server takes them ---------------------------------------------------------------------


@pytest.mark.parametrize("regions", [THREE, "us=127.0.0.1:17001,eu=127.0.0.1:17002"])
def test_every_generated_config_passes_nats_server_t(tmp_path, regions):
    names = [item.split("=")[0] for item in regions.split(",")]
    for name in names:
        out = tmp_path / f"{name}.conf"
        assert main(["nats-config", "--region", name, "--regions", regions, "--leafnode-port", "7422",
                     "--http-port", "8222", "--store-dir", str(tmp_path / name), "--out", str(out)]) == 0  # fmt: skip
        _nats_check(out)


def test_the_toml_form_passes_nats_server_t(tmp_path):
    regions = tmp_path / "regions.toml"
    regions.write_text(
        '[us]\ngateway = "127.0.0.1:17101"\ngateway-listen = 17201\nclient = 14222\ncluster = 16222\n'
        f'leafnode = 17422\nhttp = 18222\nstore-dir = "{tmp_path / "us"}"\nhost = "127.0.0.1"\n'
        '[eu]\ngateway = "127.0.0.1:17102"\n'
        '[ap]\ngateway = "127.0.0.1:17103"\n'
    )
    out = tmp_path / "us.conf"
    assert main(["nats-config", "--region", "us", "--config", str(regions), "--out", str(out)]) == 0
    text = out.read_text()
    assert 'listen: "127.0.0.1:17201"' in text and 'advertise: "127.0.0.1:17101"' in text
    _nats_check(out)


def test_the_leaf_form_passes_nats_server_t(tmp_path):
    out = tmp_path / "leaf.conf"
    assert main(["nats-config", "--leaf-of", "us", "--hub", "127.0.0.1:17422", "--client-port", "4223",
                 "--out", str(out)]) == 0  # fmt: skip
    _nats_check(out)


def test_without_out_the_config_goes_to_stdout(capsys):
    assert main(["nats-config", "--region", "ap", "--regions", THREE]) == 0
    assert capsys.readouterr().out == _render(THREE, "ap")


# --- what it refuses -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("regions", "why"),
    [
        ("us=a:1,us=b:2", "given twice"),
        ("US=a:1", "region name"),
        ("u.s=a:1", "region name"),
        ("1us=a:1", "region name"),
        ("u" * 33 + "=a:1", "region name"),
        ("us=a:0", "not a port"),
        ("us=a:70000", "not a port"),
        ("us=a:x", "not host:port"),
        ("us=a", "not host:port"),
        ("us", "NAME=HOST:PORT"),
        ("", "no regions"),
    ],
)
def test_bad_regions_are_refused(regions, why):
    with pytest.raises(ConfigError, match=why):
        nats_config.parse_regions(regions)


def test_the_own_region_must_be_in_the_list():
    with pytest.raises(ConfigError, match="not in the list"):
        _render("us=a:1,eu=b:2", "ap")


def test_a_region_name_may_be_32_characters_with_digits_and_dashes():
    name = "a" + "-1" * 15 + "z"
    assert len(name) == 32
    assert nats_config.parse_regions(f"{name}=h:1")[0].name == name


@pytest.mark.parametrize(
    ("toml", "why"),
    [
        ('[us]\ngateway = "a:1"\nclients = 4222\n', "unknown key 'clients'"),
        ("[us]\nclient = 4222\n", "gateway"),
        ('[us]\ngateway = "a:1"\nclient = 0\n', "not a port"),
        ('[us]\ngateway = "a:1"\nclient = "4222"\n', "not a port"),
        ('[us]\ngateway = "a:1"\nstore-dir = 3\n', "store-dir"),
        ('[EU]\ngateway = "a:1"\n', "region name"),
        ('us = "a:1"\n', "must be a table"),
        ("[us\n", "regions.toml"),
    ],
)
def test_bad_toml_is_refused(tmp_path, toml, why):
    path = tmp_path / "regions.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError, match=why):
        nats_config.load_toml(path)


def test_a_missing_toml_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="regions file"):
        nats_config.load_toml(tmp_path / "none.toml")


@pytest.mark.parametrize(
    ("argv", "why"),
    [
        (["--regions", "us=a:1"], "--region NAME is required"),
        (["--region", "us"], "either as --regions"),
        (["--region", "us", "--regions", "us=a:1", "--config", "x.toml"], "either as --regions"),
        (["--leaf-of", "us"], "--hub"),
        (["--leaf-of", "us", "--hub", "h"], "not host:port"),
        (["--region", "us", "--regions", "us=a:1", "--client-port", "0"], "not a port"),
    ],
)
def test_the_command_says_what_is_wrong(capsys, argv, why):
    assert main(["nats-config", *argv]) == 2
    assert why in capsys.readouterr().err
