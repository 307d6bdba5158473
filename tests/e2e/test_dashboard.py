"""The Grafana dashboard (deploy/grafana/dashboards/switchyard.json) against a live stack: every
metric a panel queries is exported by the ingress's /metrics, with the labels the panel groups by.

A panel over a metric nobody exports shows "No data" forever and nobody notices; so the
PromQL of every panel is reduced to the series names it selects, and a real stack (sim
engine, a real nats-server) that has served a few requests through the ``openai`` client is
scraped for them."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from switchyard.observability.metrics import EDGE_REFUSAL_REASONS
from tests.support.stack import MODEL, running_stack

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "dashboards" / "switchyard.json"

# Series Prometheus makes itself, not the services.
PROMETHEUS_OWN = {"up"}
# Labels Prometheus puts on every scraped series (the target's), so no service exports them.
TARGET_LABELS = {"job", "instance"}
# Families only an engine that counts for itself fills (vllm: WorkerSummary.stats); the sim
# engine reports none, so on this stack they are declared but have no samples.
ENGINE_COUNTED = {"switchyard_worker_prompt_tokens", "switchyard_worker_kv_fallbacks"}
# Labelled counters with a series only once their event happened, too rare for this stack:
# each is checked, samples and labels, by the test that makes it happen. (None now: the
# migration outcomes are exported at 0 from the start.)
EVENT_COUNTED: dict[str, str] = {}

# --- PromQL -> the series names it selects ------------------------------------------------------

_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGES = re.compile(r"\[[^\[\]]*\]")  # ranges and subqueries: [5m], [$__rate_interval], [1h:1m]
_VARIABLES = re.compile(r"\$\{[^}]*\}|\$\w+")  # Grafana's $__rate_interval, ${job}
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^()]*)\)")
# An identifier that does not continue a number (1e3, 5m) or a name.
_NAME = re.compile(r"(?<![\w.:])[A-Za-z_:][\w:]*")
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool"}
_KEYWORDS |= {"and", "or", "unless", "inf", "nan", "atan2"}


def _strip(expr: str) -> str:
    for pattern in (_STRINGS, _MATCHERS, _RANGES, _VARIABLES):
        expr = pattern.sub(" ", expr)
    return expr


def series_names(expr: str) -> set[str]:
    """The series ``expr`` selects: every identifier that is not a function or an
    aggregation (those are followed by a parenthesis), a keyword, a label in a grouping
    clause, a label matcher, a string, a duration or a number."""
    bare = _GROUPING.sub(" ", _strip(expr))
    names = set()
    for m in _NAME.finditer(bare):
        if m.group() not in _KEYWORDS and not bare[m.end() :].lstrip().startswith("("):
            names.add(m.group())
    return names


def grouping_labels(expr: str) -> set[str]:
    """Labels the result is grouped by (``by``/``on``): each must be on the selected series."""
    labels = set()
    for clause, names in _GROUPING.findall(_strip(expr)):
        if clause in ("by", "on"):
            labels |= {n.strip() for n in names.split(",") if n.strip()}
    return labels


# --- the dashboard -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Query:
    panel: str
    expr: str


def panels(container: dict) -> Iterator[dict]:
    """Every panel, inside collapsed rows too."""
    for panel in container.get("panels", []):
        yield panel
        yield from panels(panel)


def dashboard_queries(dashboard: dict) -> list[Query]:
    return [
        Query(panel["title"], target["expr"])
        for panel in panels(dashboard)
        for target in panel.get("targets", [])
        if target.get("expr")
    ]


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text(encoding="utf-8"))


# --- an exposition, as Prometheus would store it -------------------------------------------------

# The series a family of each type stores (the text format's names).
_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
    "summary": ("", "_sum", "_count", "_created"),
    "info": ("_info",),
}


@dataclass(frozen=True)
class Exposition:
    family_of: dict[str, str]  # series name -> its family, declared whether or not it has samples
    labels_of: dict[str, set[str]]  # series name -> the labels its samples carry (absent: no samples)

    @classmethod
    def parse(cls, text: str) -> Exposition:
        family_of: dict[str, str] = {}
        labels_of: dict[str, set[str]] = {}
        for family in text_string_to_metric_families(text):
            for suffix in _SUFFIXES.get(family.type, ("",)):
                family_of[family.name + suffix] = family.name
            for sample in family.samples:
                family_of.setdefault(sample.name, family.name)
                labels_of.setdefault(sample.name, set()).update(sample.labels)
        return cls(family_of, labels_of)

    def problems(self, query: Query) -> list[str]:
        """Why ``query`` would show no data (or ungrouped data) on this exposition."""
        found = []
        names = series_names(query.expr) - PROMETHEUS_OWN
        labels: set[str] = set(TARGET_LABELS)
        counted_only = False
        for name in sorted(names):
            family = self.family_of.get(name)
            if family is None:
                found.append(f"{query.panel!r}: {name} is not exported (in {query.expr!r})")
            elif name in self.labels_of:
                labels |= self.labels_of[name]
            elif family in ENGINE_COUNTED or family in EVENT_COUNTED:
                counted_only = True
            else:
                found.append(f"{query.panel!r}: {name} is declared but has no samples")
        missing = grouping_labels(query.expr) - labels
        if names and missing and not counted_only and not found:
            found.append(f"{query.panel!r}: no series of {sorted(names)} has the labels {sorted(missing)}")
        return found


# --- the extraction, on its own ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("expr", "names", "labels"),
    [
        (
            'histogram_quantile(0.99, sum by (le) (rate(a_seconds_bucket{job="x", path=~"/v1.+"}[$__rate_interval])))',
            {"a_seconds_bucket"},
            {"le"},
        ),
        ("sum(rate(b_total[5m])) / sum(rate(c_total[5m] offset 1h))", {"b_total", "c_total"}, set()),
        ("count by (role) (max without (instance) (d))", {"d"}, {"role"}),
        ("sum(e) by (tenant, source) > 1e3 and on (tenant) f:recorded", {"e", "f:recorded"}, {"tenant", "source"}),
        ('max_over_time(g{l="sum(h)"}[1h:1m])', {"g"}, set()),
        ("sum by (job) (up)", {"up"}, {"job"}),
    ],
)
def test_series_names_and_grouping_labels(expr, names, labels):
    assert series_names(expr) == names
    assert grouping_labels(expr) == labels


def test_a_query_is_checked_by_its_series_not_its_family():
    text = (
        '# HELP t_total Tokens.\n# TYPE t_total counter\nt_total{tenant="a"} 3.0\n'
        "# HELP h Latency.\n# TYPE h histogram\n"
        'h_bucket{le="1.0"} 1.0\nh_bucket{le="+Inf"} 1.0\nh_sum 0.5\nh_count 1.0\n'
        "# HELP g Declared, never set.\n# TYPE g gauge\n"
    )
    expo = Exposition.parse(text)
    assert not expo.problems(Query("ok", "sum by (tenant) (rate(t_total[5m]))"))
    assert not expo.problems(Query("ok", "histogram_quantile(0.5, sum by (le) (rate(h_bucket[5m])))"))
    assert expo.problems(Query("a counter is stored as _total", "rate(t[5m])"))
    assert expo.problems(Query("no such suffix", "rate(h_total[5m])"))
    assert expo.problems(Query("never set", "g"))
    assert expo.problems(Query("no such label", "sum by (worker) (rate(t_total[5m]))"))


def test_every_panel_queries_something(dashboard):
    for panel in panels(dashboard):
        if panel["type"] != "row":
            assert [q for q in dashboard_queries({"panels": [panel]}) if series_names(q.expr)], panel["title"]


# --- the live stack ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def scraped(module_nats) -> str:
    """/metrics of a stack that has served a streamed and a non-streamed request."""
    with running_stack(module_nats.url) as stack:
        client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=30)
        messages = [{"role": "user", "content": "Which metrics does the yard keep?"}]
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
        for _ in client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=8, temperature=0, stream=True
        ):
            pass
        return httpx.get(stack.ingress.url + "/metrics", timeout=10).text


def test_every_metric_the_dashboard_queries_is_exported(dashboard, scraped):
    expo = Exposition.parse(scraped)
    queries = dashboard_queries(dashboard)
    assert len(queries) >= 15
    problems = [p for q in queries for p in expo.problems(q)]
    assert not problems, "\n".join(problems)


def test_every_edge_refusal_reason_has_a_series_before_any_refusal(scraped):
    """So the refusals panel shows each reason at 0, and a rate over it starts from the first."""
    family = next(f for f in text_string_to_metric_families(scraped) if f.name == "switchyard_edge_refusals")
    reasons = {s.labels["reason"]: s.value for s in family.samples if s.name.endswith("_total")}
    assert reasons == dict.fromkeys(EDGE_REFUSAL_REASONS, 0.0)
