#!/usr/bin/python3
"""The Grafana dashboard and the alert rules use only metrics and labels the code exports.

Reads the metric families from the C++ sources (server/**/*.cc: `x_ = &BuildGauge().Name("moe_...")`
or GatewayMetrics' `x_ = gauge("moe_...", help)`, and the label keys of every `x_->Add({{"label", ...}})`), then checks every PromQL expression of
deploy/grafana/dashboards/moe.json (panels, template variables) and deploy/prometheus/alerts.yml:
metric names exist (histograms as _bucket/_sum/_count), label matchers, by/without clauses,
legends and $labels.* in annotations name labels those metrics carry (or job/instance and the
target labels our scrape configs add), histogram_quantile runs over a _bucket series grouped by le.
Also: the dashboard is valid Grafana JSON (schemaVersion >= 36, unique panel ids, 24-column grid,
datasource variable), and it keeps the panels the deployment promises; and every moe_* series the
README and the docs pages name is one the code exports.

The Quantile Balancing gauges moe_qb_predicted_balancedness / moe_qb_observed_balancedness are
accepted (label layer) even when the sources do not define them yet.
"""

import argparse
import json
import re
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import deploy_common as dc  # noqa: E402

ALLOWED_PENDING = {
    "moe_qb_predicted_balancedness": ("gauge", {"layer"}),
    "moe_qb_observed_balancedness": ("gauge", {"layer"}),
}
# Metrics every panel list of the deployment promises (docs/OBSERVABILITY.md, "Grafana").
REQUIRED_ON_DASHBOARD = [
    "moe_rank_tokens_total", "moe_load_balancedness", "moe_forward_stage_duration_seconds_bucket",
    "moe_requests_total", "moe_qb_predicted_balancedness", "moe_qb_observed_balancedness", "moe_rank_up",
    "moe_rank_weight_bytes", "moe_transport_gateway_to_rank_bytes_total", "moe_transport_rank_to_gateway_bytes_total",
    "moe_request_duration_seconds_bucket", "moe_step_tokens_bucket", "moe_requests_in_flight", "moe_queue_tokens",
    "moe_expert_tokens_total", "moe_rank_active_experts", "moe_experts_unavailable", "moe_failovers_total",
    "moe_redispatched_rows_total", "moe_placement_generation", "moe_placement_changes_total", "moe_auth_failures_total",
    "moe_stream_buffer_bytes",
]
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
                "offset"}


def balanced(text, start):
    """text[start] == '(' -> the content up to the matching ')'."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "(":
            depth += 1
        elif text[i] == ")":
            depth -= 1
            if depth == 0:
                return text[start + 1:i]
    return text[start + 1:]


def label_keys(literal):
    return set(re.findall(r'\{\s*"([a-zA-Z_][a-zA-Z0-9_]*)"\s*,', literal))


def exported_families(source_dir):
    """{name: (type, labels or None)} from the C++ sources."""
    families = {}
    for path in sorted((source_dir / "server").rglob("*.cc")):
        text = path.read_text()
        var_to_name = {}
        for m in re.finditer(r"(\w+)\s*=\s*&\s*(?:prometheus::)?Build(Counter|Gauge|Histogram|Summary)\(\)\s*"
                             r"\.Name\(\s*\"([a-zA-Z_:][a-zA-Z0-9_:]*)\"\s*\)", text):
            var, kind, name = m.group(1), m.group(2).lower(), m.group(3)
            var_to_name[var] = name
            families.setdefault(name, [kind, set()])
        # GatewayMetrics' table: `x_ = counter("moe_...", help)` (or `&gauge(...)->Add({})`).
        for m in re.finditer(r"(\w+)\s*=\s*&?\s*(counter|gauge|histogram)\(\s*\"(moe_[a-zA-Z0-9_:]*)\"", text):
            var, kind, name = m.group(1), m.group(2), m.group(3)
            var_to_name[var] = name
            families.setdefault(name, [kind, set()])
        for m in re.finditer(r"\.Name\(\s*\"(moe_[a-zA-Z0-9_:]*)\"\s*\)", text):
            families.setdefault(m.group(1), ["unknown", None])
        local_labels = {m.group(1): label_keys(m.group(2))
                        for m in re.finditer(r"prometheus::Labels\s+(\w+)\s*=\s*(\{.*?\});", text, re.S)}
        for m in re.finditer(r"(\w+)\s*->\s*Add\(", text):
            var = m.group(1)
            if var not in var_to_name:
                continue
            args = balanced(text, m.end() - 1).strip()
            fam = families[var_to_name[var]]
            if fam[1] is None:
                continue
            if args.startswith("{"):
                fam[1] |= label_keys(args)
            else:
                ident = re.match(r"(\w+)", args)
                if ident and ident.group(1) in local_labels:
                    fam[1] |= local_labels[ident.group(1)]
    pending = [name for name in ALLOWED_PENDING if name not in families]
    for name in pending:
        kind, labels = ALLOWED_PENDING[name]
        families[name] = [kind, set(labels)]
    return {name: (kind, labels) for name, (kind, labels) in families.items()}, pending


def series_names(families):
    """{series name: labels or None} as the exposition shows them."""
    series = {}
    for name, (kind, labels) in families.items():
        if kind == "histogram":
            series[name + "_bucket"] = None if labels is None else labels | {"le"}
            series[name + "_sum"] = labels
            series[name + "_count"] = labels
        else:
            series[name] = labels
    series["up"] = set()
    return series


def target_labels(source_dir):
    """Labels our scrape configs attach to every series: job, instance and relabel targets."""
    labels = {"job", "instance"}
    for f in ("prometheus.yml", "prometheus-k8s.yml"):
        path = source_dir / "deploy" / "prometheus" / f
        if not path.exists():
            continue
        for job in yaml.safe_load(path.read_text()).get("scrape_configs", []):
            for rc in job.get("relabel_configs", []) + job.get("metric_relabel_configs", []):
                t = rc.get("target_label")
                if t and not t.startswith("__"):
                    labels.add(t)
    return labels


def check_expr(expr, where, series, extra, failures, legend=None, used=None):
    text = re.sub(r"\$\{?[A-Za-z_][A-Za-z0-9_]*\}?", "1", expr)  # template variables
    metrics = []
    for m in re.finditer(r"(?<![A-Za-z0-9_:\"'.])([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(\{[^}]*\})?", text):
        name, matchers = m.group(1), m.group(2)
        if not (name.startswith("moe_") or name == "up"):
            continue
        if name not in series:
            failures.add(f"{where}: metric {name} is not exported by the code")
            continue
        metrics.append(name)
        if used is not None:
            used.add(name)
        labels = series[name]
        if labels is None or not matchers:
            continue
        for label in re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)", matchers):
            if label not in labels | extra | {"__name__"}:
                failures.add(f"{where}: {name} has no label '{label}' (it has {sorted(labels)})")
    known = set(extra)
    for name in metrics:
        known |= series[name] or set()
    unknown_labels = any(series[n] is None for n in metrics)
    for m in re.finditer(r"\b(by|without)\s*\(([^)]*)\)", text):
        for label in [l.strip() for l in m.group(2).split(",") if l.strip()]:
            if not unknown_labels and label not in known:
                failures.add(f"{where}: '{m.group(1)} ({label})' but the series carry {sorted(known)}")
    if "histogram_quantile" in text:
        for m in re.finditer(r"histogram_quantile\s*\(", text):
            inner = balanced(text, m.end() - 1)
            if "_bucket" not in inner:
                failures.add(f"{where}: histogram_quantile over no _bucket series")
            grouping = re.findall(r"\bby\s*\(([^)]*)\)", inner)
            if grouping and not all("le" in [l.strip() for l in g.split(",")] for g in grouping):
                failures.add(f"{where}: histogram_quantile aggregation must keep 'le'")
    if legend:
        for label in re.findall(r"\{\{\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\}\}", legend):
            if not unknown_labels and label not in known:
                failures.add(f"{where}: legend uses {{{{{label}}}}} but the series carry {sorted(known)}")
    return metrics, known


def check_dashboard(path, series, extra, failures):
    try:
        dashboard = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        failures.add(f"{path}: {e}")
        return
    failures.check(isinstance(dashboard.get("schemaVersion"), int) and dashboard["schemaVersion"] >= 36,
                   f"{path}: schemaVersion {dashboard.get('schemaVersion')} < 36")
    for key in ("uid", "title", "panels", "templating"):
        failures.check(key in dashboard, f"{path}: no '{key}'")
    variables = {v.get("name"): v for v in dashboard.get("templating", {}).get("list", [])}
    ds_vars = [n for n, v in variables.items() if v.get("type") == "datasource" and v.get("query") == "prometheus"]
    failures.check(bool(ds_vars), f"{path}: no Prometheus datasource variable (needed to import the dashboard)")
    used = set()
    for name, var in variables.items():
        if var.get("type") == "query":
            query = var.get("query")
            query = query.get("query", "") if isinstance(query, dict) else str(query or "")
            check_expr(query, f"variable ${name}", series, extra, failures, used=used)
            lv = re.match(r"label_values\((.*),\s*([a-zA-Z_]+)\)\s*$", query)
            if lv:
                metrics, known = check_expr(lv.group(1), f"variable ${name}", series, extra, failures)
                failures.check(lv.group(2) in known, f"variable ${name}: label {lv.group(2)} not on {metrics}")

    def walk(panels):
        for p in panels:
            yield p
            yield from walk(p.get("panels", []))

    ids = []
    for panel in walk(dashboard.get("panels", [])):
        where = f"panel '{panel.get('title')}'"
        ids.append(panel.get("id"))
        gp = panel.get("gridPos") or {}
        failures.check(all(k in gp for k in ("h", "w", "x", "y")) and gp["x"] + gp["w"] <= 24,
                       f"{where}: gridPos {gp} outside the 24-column grid")
        failures.check(bool(panel.get("type")), f"{where}: no type")
        if panel.get("type") == "row":
            continue
        targets = panel.get("targets") or []
        failures.check(bool(targets), f"{where}: no queries")
        for t in targets:
            ds = t.get("datasource") or panel.get("datasource") or {}
            uid = ds.get("uid", "") if isinstance(ds, dict) else str(ds)
            failures.check(uid.strip("${}") in ds_vars,
                           f"{where}: datasource {ds} is not the dashboard's datasource variable")
            failures.check(bool(t.get("expr")), f"{where}: query {t.get('refId')} has no expr")
            check_expr(t.get("expr", ""), where, series, extra, failures, legend=t.get("legendFormat"), used=used)
    failures.check(len(ids) == len(set(ids)), f"{path}: duplicate panel ids {ids}")
    for metric in REQUIRED_ON_DASHBOARD:
        failures.check(metric in used, f"{path}: no panel shows {metric}")
    return len(ids)


def check_alerts(path, series, extra, failures):
    rules = yaml.safe_load(path.read_text())
    count = 0
    for group in rules.get("groups", []):
        for rule in group.get("rules", []):
            name = rule.get("alert") or rule.get("record")
            metrics, known = check_expr(rule["expr"], f"alert {name}", series, extra, failures)
            failures.check(bool(metrics), f"alert {name}: uses no metric")
            for text in list((rule.get("annotations") or {}).values()) + list((rule.get("labels") or {}).values()):
                for label in re.findall(r"\$labels\.([a-zA-Z_][a-zA-Z0-9_]*)", str(text)):
                    failures.check(label in known, f"alert {name}: $labels.{label} but the series carry {sorted(known)}")
            count += 1
    return count


def check_docs(source_dir, families, series, failures):
    """Every moe_* series named in README.md and docs/**/*.md is exported (histograms also as
    _bucket/_sum/_count). Python names (moe_serve...) and file names (moe_reference.py) are not
    series."""
    count = 0
    for page in [source_dir / "README.md"] + sorted((source_dir / "docs").rglob("*.md")):
        for name in sorted(set(re.findall(r"(?<![\w/.])(moe_[a-z0-9_]*[a-z0-9])(?![\w(]|\.\w)", page.read_text()))):
            if name.startswith("moe_serve"):
                continue
            count += 1
            failures.check(name in series or name in families, f"{page.relative_to(source_dir)} names the series {name}, which the code "
                           "does not export")
    return count


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--source-dir", default=str(dc.SOURCE_DIR))
    args = parser.parse_args()
    source = Path(args.source_dir)
    failures = dc.Failures("check_metrics")
    families, pending = exported_families(source)
    series = series_names(families)
    extra = target_labels(source)
    panels = check_dashboard(source / "deploy" / "grafana" / "dashboards" / "moe.json", series, extra, failures)
    alerts = check_alerts(source / "deploy" / "prometheus" / "alerts.yml", series, extra, failures)
    documented = check_docs(source, families, series, failures)
    failures.finish(f"{len(families) - len(pending)} metric families in the code; dashboard ({panels} panels), "
                    f"{alerts} alert rules and the {documented} series the docs name use only those"
                    + (f" (accepted before the code has them: {', '.join(pending)})" if pending else ""))


if __name__ == "__main__":
    main()
