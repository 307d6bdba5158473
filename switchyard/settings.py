"""Where configuration comes from: flags, environment, a TOML file, defaults, in that order.

Every setting is declared once, as a field of a service's config tree (its type, default,
help and check: ``switchyard.schemas.config``). This module walks those trees and derives
everything else from them:

- its name: the field's, with dashes (``token_budget`` -> ``token-budget``), unless the
  field says otherwise; a nested tree may put a prefix before its names (``sim-``);
- its flag ``--token-budget``, its environment variable ``SWITCHYARD_TOKEN_BUDGET``, and its
  key in a config file (``token-budget`` or ``token_budget``), at the top of the file (for
  every service that has it) or in the service's own table (``[worker]``, ``[scheduler]``,
  ``[ingress]``, ``[up]``), which wins over the top;
- precedence: flag > environment > file > default (some defaults depend on the engine:
  ``engine_defaults``).

A bad value is one ``ConfigError`` naming the setting and where it came from, raised
before anything starts. ``switchyard up`` resolves every child's tree here and hands it
to the child as data (``SWITCHYARD_CONFIG_DATA``, JSON), never as flags rebuilt from it.
"""

from __future__ import annotations

import argparse
import os
import tomllib
import types
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin, get_type_hints

import msgspec

from switchyard.ingress import BatchRunnerConfig, IngressConfig
from switchyard.scheduler import SchedulerServiceConfig
from switchyard.schemas import ConfigStruct, SwitchyardError, setting
from switchyard.workers import WorkerConfig

BUNDLED_MODEL = Path(__file__).parent / "models" / "sim-tiny"
ENV_PREFIX = "SWITCHYARD_"
CONFIG_DATA_ENV = "SWITCHYARD_CONFIG_DATA"  # a child's whole configuration, from `switchyard up`
CONFIG_FILE_ENV = "SWITCHYARD_CONFIG"  # the config file, when --config names none
# SWITCHYARD_* variables that are not settings.
_NOT_SETTINGS = {CONFIG_DATA_ENV, CONFIG_FILE_ENV, "SWITCHYARD_GPU"}


class ConfigError(SwitchyardError, ValueError):
    """A setting that cannot be used: its name, its source and why."""


class ProcessConfig(ConfigStruct, frozen=True, kw_only=True):
    """What every command's process takes, whatever its service."""

    log_level: Annotated[Literal["debug", "info", "warning", "error"], setting("log level")] = "info"
    trace_exporter: Annotated[Literal["none", "console", "otlp"], setting("where spans go")] = "none"


class UpConfig(ConfigStruct, frozen=True, kw_only=True):
    """``switchyard up``'s own settings; the services' come from their own trees."""

    nats: Annotated[str, setting("NATS server URL (default: start a private nats-server)")] = ""
    engine: Annotated[Literal["sim", "vllm"], setting("the workers' engine: sim (a cost model) or vllm")] = "sim"
    prefill: Annotated[int, setting("prefill workers", ge=0)] = 1
    decode: Annotated[int, setting("decode workers", ge=0)] = 1
    colocated: Annotated[
        int,
        setting(
            "colocated workers (role both: each prefills and decodes; with a TPOT SLO the scheduler lends some "
            "to decoding). A fleet of only colocated workers takes --prefill 0 --decode 0; beside decode workers "
            "(--prefill 0 --decode 2) they prefill and hand over as prefill workers do, and are lent to decoding "
            "when the decode workers run slow",
            ge=0,
        ),
    ] = 0
    schedulers: Annotated[
        int, setting("scheduler replicas: one active (it holds the lease), the others standing by", gt=0)
    ] = 1
    batch_runners: Annotated[int, setting("batch runners (the Batch API's lines run through them; 0: none)", ge=0)] = 1
    ready_timeout_s: Annotated[
        float, setting("how long the stack may take to serve; default: 60 s, or 600 s for vllm", gt=0)
    ] = 60.0
    mooncake_segment_bytes: Annotated[
        int,
        setting(
            "vllm: memory the Mooncake Store's segment process lends the store (its Transfer Engine data "
            "port, like the engines', listens on every interface: Mooncake has no setting to bind it)",
            gt=0,
        ),
    ] = 1 << 30
    mooncake_external: Annotated[
        bool, setting("vllm: use the Mooncake Store named by --mooncake-master instead of starting one")
    ] = False
    max_restarts: Annotated[
        int, setting("crashes of one child within --restart-window-s before the stack stops (0: the first)", ge=0)
    ] = 5
    restart_window_s: Annotated[float, setting("how far back a child's crashes are counted", gt=0)] = 600.0
    # Federation on one machine (docs/federation.md): one region per name, each its own
    # nats-server (joined as a supercluster), scheduler, workers, ingress and batch runners.
    regions: Annotated[
        str,
        setting(
            "run one region per name (e.g. us,eu,ap) on this machine, joined as a NATS supercluster; region i's "
            "ingress listens on --port + i"
        ),
    ] = ""
    region_rtt_ms: Annotated[
        str,
        setting("--regions: emulated round trips between regions in ms, e.g. us-eu=30,us-ap=70,eu-ap=140 (default 0)"),
    ] = ""
    # What outlives the stack: the private nats-server's JetStream store (files, batches,
    # usage records, sessions). One `up` at a time per folder (up.py holds its lock).
    data_dir: Annotated[
        str,
        setting(
            "where the private nats-server keeps JetStream (file storage), so files and batches survive a "
            "restart; default: $XDG_DATA_HOME/switchyard, else ~/.local/share/switchyard"
        ),
    ] = ""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.colocated and not (self.prefill and self.decode):
            raise ValueError(
                f"a fleet needs a prefill and a decode worker, or colocated ones "
                f"(got --prefill {self.prefill} --decode {self.decode} --colocated 0)"
            )


# The service each command runs, and the tree that configures it.
SERVICES: dict[str, type[ConfigStruct]] = {
    "ingress": IngressConfig,
    "scheduler": SchedulerServiceConfig,
    "worker": WorkerConfig,
    "batch-runner": BatchRunnerConfig,
}
# The trees behind each command's flags (a name shared by several is one flag), and what
# `up` decides for its children itself.
COMMAND_TREES: dict[str, list[type[ConfigStruct]]] = {
    "up": [ProcessConfig, UpConfig, SchedulerServiceConfig, WorkerConfig, IngressConfig, BatchRunnerConfig],
    "ingress": [ProcessConfig, IngressConfig],
    "scheduler": [ProcessConfig, SchedulerServiceConfig],
    "worker": [ProcessConfig, WorkerConfig],
    "batch-runner": [ProcessConfig, BatchRunnerConfig],
}
UP_SKIPS = frozenset({"role", "worker-id", "ingress-url"})
# Defaults that belong to the composition root: where the bundled model is.
_EDGE_DEFAULTS: dict[str, Any] = {"model": str(BUNDLED_MODEL)}


# --- the settings of a tree --------------------------------------------------------------


@dataclass(frozen=True)
class Setting:
    """One leaf of a config tree, as the CLI, the environment and a file name it."""

    name: str  # "token-budget"
    path: tuple[str, ...]  # ("vllm", "parallel", "tensor"): where it goes in the tree
    hint: Any  # the annotated type one value is checked against
    default: Any  # msgspec.NODEFAULT when the tree requires it
    help: str
    optional_parent: tuple[str, ...] | None = None  # an optional subtree it belongs to (built only if set)

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper().replace("-", "_")

    @property
    def flag(self) -> str:
        return "--" + self.name

    @property
    def is_bool(self) -> bool:
        return _strip(self.hint) is bool


def settings_of(tree: type[ConfigStruct]) -> list[Setting]:
    return list(_walk(tree, "", (), None))


def _walk(tree: type, prefix: str, path: tuple[str, ...], optional: tuple[str, ...] | None) -> Iterator[Setting]:
    hints = get_type_hints(tree, include_extras=True)
    for info in msgspec.structs.fields(tree):
        hint = hints[info.name]
        meta = _meta(hint)
        extra = (meta.extra if meta else None) or {}
        if extra.get("hidden"):
            continue
        inner = _strip(hint)
        here = (*path, info.name)
        if isinstance(inner, type) and issubclass(inner, msgspec.Struct):
            nested_optional = optional or (here if _is_optional(hint) else None)
            yield from _walk(inner, prefix + extra.get("prefix", ""), here, nested_optional)
            continue
        name = extra.get("flag") or prefix + info.name.replace("_", "-")
        default = info.default if info.default is not msgspec.NODEFAULT else msgspec.NODEFAULT
        yield Setting(name, here, hint, default, (meta.description if meta else None) or "", optional)


def _meta(hint: Any) -> msgspec.Meta | None:
    if get_origin(hint) is Annotated:
        metas = [m for m in get_args(hint)[1:] if isinstance(m, msgspec.Meta) and m.description]
        return metas[-1] if metas else None
    return None


def _strip(hint: Any) -> Any:
    """The plain type under Annotated and ``| None``."""
    while True:
        if get_origin(hint) is Annotated:
            hint = get_args(hint)[0]
        elif get_origin(hint) in (Union, types.UnionType):
            args = [a for a in get_args(hint) if a is not type(None)]
            if len(args) != 1:
                return hint
            hint = args[0]
        else:
            return hint


def _is_optional(hint: Any) -> bool:
    if get_origin(hint) is Annotated:
        return _is_optional(get_args(hint)[0])
    return type(None) in get_args(hint)


def choices_of(s: Setting) -> tuple[Any, ...] | None:
    inner = _strip(s.hint)
    return get_args(inner) if get_origin(inner) is Literal else None


# --- sources -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Value:
    value: Any
    source: str  # "flag --port", "env SWITCHYARD_PORT", "file a.toml [ingress]", "default"


@dataclass
class Sources:
    """What the operator said, before it is checked against any tree."""

    flags: dict[str, Any] = field(default_factory=dict)  # setting name -> raw value
    env: Mapping[str, str] = field(default_factory=dict)
    file: dict[str, Any] = field(default_factory=dict)  # the parsed TOML
    file_path: str = ""

    @classmethod
    def load(cls, flags: dict[str, Any], env: Mapping[str, str], config_file: str | None) -> Sources:
        path = config_file or env.get(CONFIG_FILE_ENV, "")
        data: dict[str, Any] = {}
        if path:
            try:
                data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
            except OSError as exc:
                raise ConfigError(f"config file {path}: {exc.strerror or exc}") from None
            except tomllib.TOMLDecodeError as exc:
                raise ConfigError(f"config file {path}: {exc}") from None
        env = {k: v for k, v in env.items() if k.startswith(ENV_PREFIX) and k not in _NOT_SETTINGS}
        return cls(flags=flags, env=env, file=data, file_path=path)

    def pick(self, s: Setting, section: str) -> Value | None:
        """The value of one setting for one service, by precedence; None when unset."""
        if s.name in self.flags:
            return Value(self.flags[s.name], f"flag {s.flag}")
        if s.env in self.env:
            return Value(self.env[s.env], f"environment {s.env}")
        table = self.file.get(section)
        for scope, where in ((table, f"[{section}]"), (self.file, "(top level)")):
            if isinstance(scope, dict):
                for key in (s.name, s.name.replace("-", "_")):
                    if key in scope and not isinstance(scope[key], dict):
                        return Value(scope[key], f"file {self.file_path} {where} {key}")
        return None

    def check_known(self, known: dict[str, set[str]]) -> None:
        """Every key of the file and every SWITCHYARD_* variable names a setting: a typo is
        an error, not a silently ignored line. ``known``: section -> setting names."""
        everything = set().union(*known.values())
        for env in self.env:
            name = env[len(ENV_PREFIX) :].lower().replace("_", "-")
            if name not in everything:
                raise ConfigError(f"environment {env}: no such setting ({name})")
        for key, value in self.file.items():
            if isinstance(value, dict):
                if key not in known:
                    raise ConfigError(f"file {self.file_path}: unknown table [{key}]; use {', '.join(known)}")
                for inner in value:
                    if inner.replace("_", "-") not in known[key]:
                        raise ConfigError(f"file {self.file_path} [{key}]: no such setting {inner!r}")
            elif key.replace("_", "-") not in everything:
                raise ConfigError(f"file {self.file_path}: no such setting {key!r}")


# --- resolving one tree ------------------------------------------------------------------


@dataclass(frozen=True)
class Resolved:
    """One service's checked tree, and where each of its settings came from."""

    config: Any
    origin: dict[str, Value]  # setting name -> its value and source


def resolve(
    tree: type[ConfigStruct],
    sources: Sources,
    section: str,
    *,
    defaults: Mapping[str, Any] | None = None,
    fixed: Mapping[str, Any] | None = None,
    fixed_by: str = "up",
) -> Resolved:
    """Build ``tree`` from ``sources``. ``defaults`` replace the tree's own (engine-dependent
    ones); ``fixed`` are decided by the caller and beat every source (``up``'s children)."""
    data: dict[str, Any] = {}
    origin: dict[str, Value] = {}
    given_optional: set[tuple[str, ...]] = set()
    for s in settings_of(tree):
        found = _value_of(s, sources, section, defaults or {}, fixed or {}, fixed_by)
        if found is None:
            if s.optional_parent is None:
                raise ConfigError(f"{s.name}: required ({s.flag}, {s.env} or {s.name} in [{section}] of a config file)")
            continue
        value = _check(s, found)
        origin[s.name] = Value(value, found.source)
        if found.source.startswith("default") and s.optional_parent:
            continue
        if s.optional_parent:
            given_optional.add(s.optional_parent)
        _put(data, s.path, value)
    _require_optional_parents(tree, sources, section, given_optional, origin)
    try:
        config = msgspec.convert(data, tree)
    except msgspec.ValidationError as exc:
        given = ", ".join(f"{v.source}" for v in origin.values() if not v.source.startswith("default"))
        raise ConfigError(f"{section} settings: {exc}" + (f" (given: {given})" if given else "")) from None
    return Resolved(config, origin)


def _value_of(
    s: Setting, sources: Sources, section: str, defaults: Mapping[str, Any], fixed: Mapping[str, Any], fixed_by: str
) -> Value | None:
    if s.name in fixed:
        return Value(fixed[s.name], f"set by {fixed_by}")
    picked = sources.pick(s, section)
    if picked is not None:
        return picked
    if s.name in defaults:
        return Value(defaults[s.name], "default")
    if s.name in _EDGE_DEFAULTS:
        return Value(_EDGE_DEFAULTS[s.name], "default")
    if s.default is not msgspec.NODEFAULT:
        return Value(s.default, "default")
    return None


def _check(s: Setting, found: Value) -> Any:
    """One value against its setting's type and check: flags and environment variables are
    text, so they are read laxly ("8000" is a number); a TOML file has types of its own."""
    text = found.source.startswith(("flag", "environment"))
    try:
        return msgspec.convert(found.value, s.hint, strict=not text)
    except msgspec.ValidationError as exc:
        choices = choices_of(s)
        hint = f" (choose one of {', '.join(map(str, choices))})" if choices else ""
        raise ConfigError(f"{s.name}: {found.value!r} from {found.source}: {exc}{hint}") from None


def _put(data: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        data = data.setdefault(key, {})
    data[path[-1]] = value


def _require_optional_parents(
    tree: type, sources: Sources, section: str, given: set[tuple[str, ...]], origin: dict[str, Value]
) -> None:
    """A setting of an optional subtree (``--num-speculative-tokens``) needs that subtree's
    required settings (``--speculative-method``): say so by name rather than ignore it."""
    for s in settings_of(tree):
        if s.optional_parent in given and s.default is msgspec.NODEFAULT and s.name not in origin:
            others = [n for n, v in origin.items() if not v.source.startswith("default")]
            raise ConfigError(f"{', '.join(others)} need {s.flag} ({section})")


# --- the CLI -----------------------------------------------------------------------------


def add_flags(parser: argparse.ArgumentParser, trees: list[type[Any]], skip: frozenset[str] = frozenset()) -> None:
    """One flag per setting of ``trees`` (a name shared by several trees is one flag);
    unset flags stay out of the namespace, so a source below them can speak."""
    seen: set[str] = set(skip)
    for tree in trees:
        group = parser.add_argument_group(_group_name(tree))
        for s in settings_of(tree):
            if s.name in seen:
                continue
            seen.add(s.name)
            group.add_argument(s.flag, dest=_dest(s.name), default=argparse.SUPPRESS, help=_help(s), **_kind(s))


def add_command_flags(parser: argparse.ArgumentParser, command: str) -> None:
    """``--config FILE`` and one flag per setting of ``command``'s trees."""
    parser.add_argument(
        "--config",
        metavar="FILE",
        default=None,
        help=f"a TOML file of settings (also {CONFIG_FILE_ENV}); precedence: flag > environment > file > default",
    )
    add_flags(parser, COMMAND_TREES[command], skip=UP_SKIPS if command == "up" else frozenset())


def known_names() -> dict[str, set[str]]:
    """Config-file table (and environment) -> the settings it may name."""
    return {command: {s.name for tree in trees for s in settings_of(tree)} for command, trees in COMMAND_TREES.items()}


def _group_name(tree: type) -> str:
    named: dict[type, str] = {
        IngressConfig: "ingress",
        SchedulerServiceConfig: "scheduler",
        WorkerConfig: "worker",
        BatchRunnerConfig: "batch-runner",
    }
    return named.get(tree, tree.__name__.removesuffix("Config").lower() or "settings")


def _kind(s: Setting) -> dict[str, Any]:
    if s.is_bool:
        return {"action": argparse.BooleanOptionalAction}
    choices = choices_of(s)
    return {"metavar": "{" + ",".join(map(str, choices)) + "}"} if choices else {"metavar": _metavar(s)}


def _metavar(s: Setting) -> str:
    inner = _strip(s.hint)
    return {int: "N", float: "X"}.get(inner, "TEXT")


def _help(s: Setting) -> str:
    default = _EDGE_DEFAULTS.get(s.name, s.default)
    shown = "" if default in (msgspec.NODEFAULT, None, "") else f" (default: {default})"
    return f"{s.help}{shown} [{s.env}]".replace("%", "%%")


def _dest(name: str) -> str:
    return "setting:" + name


def flags_given(namespace: argparse.Namespace) -> dict[str, Any]:
    return {k.removeprefix("setting:"): v for k, v in vars(namespace).items() if k.startswith("setting:")}


def engine_hints(tree: type[Any], sources: Sources, section: str) -> tuple[str, str | None]:
    """The engine (and key scheme) a tree's engine-dependent defaults follow, as given,
    unchecked: the tree's own resolution checks them."""
    picked: dict[str, str | None] = {}
    for s in settings_of(tree):
        if s.name in ("engine", "key-scheme"):
            found = sources.pick(s, section)
            picked[s.name] = str(found.value) if found else None
    return picked.get("engine") or "sim", picked.get("key-scheme")


def engine_defaults(engine: str, key_scheme: str | None = None) -> dict[str, Any]:
    """Defaults that depend on the engine: vLLM's CPU backend takes blocks of 32 and up, and
    its engines boot in 30-90 s on a CPU host."""
    vllm = engine == "vllm" or key_scheme == "vllm-sha256-cbor"
    if not vllm:
        return {"block-size": 16}
    return {"block-size": 32, "ready-timeout-s": 600.0, "key-scheme": "vllm-sha256-cbor"}


def encode_child(process: ProcessConfig, config: ConfigStruct) -> str:
    return msgspec.json.encode({"process": process, "config": config}).decode()


class _Child(msgspec.Struct, frozen=True):
    process: ProcessConfig
    config: msgspec.Raw


def decode_child(data: str, tree: type[ConfigStruct]) -> tuple[ProcessConfig, Any]:
    """A child's configuration as ``up`` resolved it; a mismatch is a bug, said loudly."""
    try:
        child = msgspec.json.decode(data, type=_Child)
        return child.process, msgspec.json.decode(child.config, type=tree)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{CONFIG_DATA_ENV}: {exc}") from None


def environ() -> Mapping[str, str]:
    return os.environ
