#!/usr/bin/python3
"""deploy/prometheus/prometheus-k8s.yml finds the pods of deploy/k8s on the right ports.

Debian's promtool is built without Kubernetes discovery, so this test emulates it: it builds the
targets Prometheus' `kubernetes_sd_configs: role: pod` would produce for the pods of the
manifests (the Deployment's pod, the StatefulSet's moe-rank-0..N-1 plus moe-rank-12 for the
two-digit case, and the LeaderWorkerSet of each overlay (deploy/k8s-lws): per group the leader
<lws>-<group> and the workers <lws>-<group>-<index> of its size plus worker 12 for the two-digit
case, labelled as the LWS controller labels them (leaderworkerset.sigs.k8s.io/worker-index...);
one target per declared container port, or one per container without ports; the
__meta_kubernetes_pod_* labels, sanitized as Prometheus does; the job's namespace and label
selectors applied), swaps each job's kubernetes_sd_configs for file_sd_configs holding them, and
runs `promtool check config` and `promtool check service-discovery` on the result. Both rank
layouts are discovered at once. Each gateway pod must yield one target on the gateway's
--metrics-port, each rank pod one target on the port its own command computes (--metrics-port
"$((9500 + ordinal))", evaluated for its ordinal; an LWS pod's fixed 9400), with the label
rank=<ordinal> (an LWS pod: rank=<worker index>). Nothing else may be scraped.

usage: check_prometheus_k8s.py [--bin-dir DIR] [--source-dir DIR]
"""

import copy
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import deploy_common as dc  # noqa: E402


def sanitize(name):
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def pods_of(w):
    """(pod name, ordinal or worker index, labels its controller adds, pod template) of the pods a
    workload makes, as the emulation lists them."""
    spec, name = w["spec"], w["metadata"]["name"]
    replicas = int(spec.get("replicas", 1))
    if w["kind"] == "Deployment":
        return [(f"{name}-5d9c7b8f4-x{i}q2z", i, {"pod-template-hash": "5d9c7b8f4"}, spec["template"])
                for i in range(replicas)]
    if w["kind"] == "StatefulSet":
        return [(f"{name}-{i}", i, {"statefulset.kubernetes.io/pod-name": f"{name}-{i}",
                                    "apps.kubernetes.io/pod-index": str(i)}, spec["template"])
                for i in list(range(replicas)) + [12]]
    # LeaderWorkerSet (LWS 0.9: pkg/webhooks/pod_webhook.go, pkg/controllers): the leader
    # <name>-<group> (worker index 0, the leaderTemplate if any) and the workers
    # <name>-<group>-<index>.
    lwt = spec["leaderWorkerTemplate"]
    pods = []
    for group in range(replicas):
        for index in list(range(int(lwt.get("size", 1)))) + [12]:
            labels = {"leaderworkerset.sigs.k8s.io/name": name, "leaderworkerset.sigs.k8s.io/group-index": str(group),
                      "leaderworkerset.sigs.k8s.io/worker-index": str(index),
                      "leaderworkerset.sigs.k8s.io/group-key": f"{group:040x}",
                      "leaderworkerset.sigs.k8s.io/template-revision-hash": "5c5fcdfb44"}
            tmpl = lwt.get("leaderTemplate") or lwt["workerTemplate"] if index == 0 else lwt["workerTemplate"]
            pods.append((f"{name}-{group}" + (f"-{index}" if index else ""), index, labels, tmpl))
    return pods


def main():
    _, source, bindir = dc.parse_check_args()
    f = dc.Failures("check_prometheus_k8s")
    config_path = source / "deploy" / "prometheus" / "prometheus-k8s.yml"
    config = yaml.safe_load(config_path.read_text())
    docs = []
    for path in sorted((source / "deploy" / "k8s").glob("*.y*ml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    # The overlays' own workloads (their other objects are the base's).
    for overlay in dc.k8s_overlays(source):
        for path in sorted(overlay.glob("*.y*ml")):
            docs += [d for d in yaml.safe_load_all(path.read_text()) if d and d.get("kind") == "LeaderWorkerSet"]
    namespace = next((d.get("namespace") for d in docs if d.get("kind") == "Kustomization"), "default")
    configmaps = {d["metadata"]["name"]: d.get("data") or {} for d in docs if d.get("kind") == "ConfigMap"}

    # ---- pods as the API server would list them ----------------------------------------------
    pods = []   # (pod name, labels, annotations, containers, expected {job: (port, extra labels)})
    ip = 0
    for w in docs:
        if w.get("kind") not in ("Deployment", "StatefulSet", "LeaderWorkerSet"):
            continue
        for name, ordinal, extra_labels, tmpl in pods_of(w):
            ip += 1
            labels = dict(tmpl["metadata"].get("labels") or {}, **extra_labels)
            expected = {}
            for c in tmpl["spec"]["containers"]:
                env = {}
                for ref in c.get("envFrom", []):
                    env.update(configmaps.get((ref.get("configMapRef") or {}).get("name"), {}))
                argv = list(c.get("args") or [])
                script = dc.shell_script_of(argv)
                lines = dc.commands_in_shell(script) if script else [dc.strip_init(argv)]
                for line in lines:
                    line = [re.sub(r"\$\(([A-Za-z_]+)\)", lambda m: env.get(m.group(1), m.group(0)), a) for a in line]
                    try:
                        binary, _, values = dc.parse_argv(bindir, line)
                    except dc.CheckFailed as e:
                        f.add(f"{name}: {e}")
                        continue
                    if binary == "moe-gateway":
                        expected["moe-gateway"] = (int(dc.flag_value(bindir, binary, values, "metrics-port")), {})
                    elif binary == "moe-rank":
                        port = dc.port_for_ordinal(values.get("metrics-port", "-1"), ordinal, script)
                        expected["moe-rank"] = (port, {"rank": str(ordinal)})
            pods.append((name, f"10.0.0.{ip}", labels, tmpl["metadata"].get("annotations") or {},
                         tmpl["spec"]["containers"], expected, tmpl["spec"].get("nodeName", f"gpu-node-{ip % 2}")))

    def targets_for(pod):
        name, pod_ip, labels, annotations, containers, _, node = pod
        meta = {"__meta_kubernetes_namespace": namespace, "__meta_kubernetes_pod_name": name,
                "__meta_kubernetes_pod_ip": pod_ip, "__meta_kubernetes_pod_node_name": node,
                "__meta_kubernetes_pod_ready": "true", "__meta_kubernetes_pod_phase": "Running",
                "__meta_kubernetes_pod_host_ip": pod_ip}
        for k, v in labels.items():
            meta[f"__meta_kubernetes_pod_label_{sanitize(k)}"] = v
            meta[f"__meta_kubernetes_pod_labelpresent_{sanitize(k)}"] = "true"
        for k, v in annotations.items():
            meta[f"__meta_kubernetes_pod_annotation_{sanitize(k)}"] = v
            meta[f"__meta_kubernetes_pod_annotationpresent_{sanitize(k)}"] = "true"
        groups = []
        for c in containers:
            cmeta = dict(meta, __meta_kubernetes_pod_container_name=c["name"],
                         __meta_kubernetes_pod_container_image=c.get("image", ""))
            ports = c.get("ports") or []
            if not ports:
                groups.append({"targets": [pod_ip], "labels": cmeta})
            for p in ports:
                groups.append({"targets": [f"{pod_ip}:{p['containerPort']}"],
                               "labels": dict(cmeta, __meta_kubernetes_pod_container_port_name=p.get("name", ""),
                                              __meta_kubernetes_pod_container_port_number=str(p["containerPort"]),
                                              __meta_kubernetes_pod_container_port_protocol=p.get("protocol", "TCP"))})
        return groups

    def selected(pod, sd):
        if namespace not in ((sd.get("namespaces") or {}).get("names") or [namespace]):
            return False
        for sel in sd.get("selectors") or []:
            if sel.get("role") != "pod":
                continue
            for term in filter(None, (sel.get("label") or "").split(",")):
                k, _, v = term.partition("=")
                if pod[2].get(k.strip()) != v.strip():
                    return False
        return True

    # ---- the config with file SD instead of Kubernetes SD -------------------------------------
    work = Path(tempfile.mkdtemp(prefix="moe-prom-k8s-"))
    emulated = copy.deepcopy(config)
    emulated["rule_files"] = [str((config_path.parent / r).resolve()) for r in config.get("rule_files", [])]
    jobs = {}
    for job in emulated.get("scrape_configs", []):
        sds = job.pop("kubernetes_sd_configs", None)
        if not sds:
            continue
        groups = []
        for sd in sds:
            f.check(sd.get("role") == "pod", f"job {job['job_name']}: role {sd.get('role')}, expected pod")
            for pod in pods:
                if selected(pod, sd):
                    groups += targets_for(pod)
        path = work / f"{job['job_name']}.json"
        path.write_text(json.dumps(groups, indent=1))
        job["file_sd_configs"] = [{"files": [str(path)]}]
        jobs[job["job_name"]] = job
    f.check({"moe-gateway", "moe-rank"} <= set(jobs), f"jobs {sorted(jobs)}: expected moe-gateway and moe-rank "
            "(the alert rules use these names)")
    emulated_path = work / "prometheus-k8s-emulated.yml"
    emulated_path.write_text(yaml.safe_dump(emulated, sort_keys=False))
    out = subprocess.run(["promtool", "check", "config", str(emulated_path)], capture_output=True, text=True,
                         timeout=60)
    f.check(out.returncode == 0, f"promtool check config: {out.stdout}{out.stderr}")

    summary = []
    for job_name in sorted(jobs):
        out = subprocess.run(["promtool", "check", "service-discovery", "--timeout=3s", str(emulated_path), job_name],
                             capture_output=True, text=True, timeout=60)
        if not f.check(out.returncode == 0, f"promtool check service-discovery {job_name}: {out.stderr}"):
            continue
        found = [t["labels"] for t in json.loads(out.stdout or "[]") if t.get("labels")]
        want = {}
        for pod in pods:
            if job_name in pod[5]:
                port, labels = pod[5][job_name]
                want[f"{pod[1]}:{port}"] = (pod[0], labels)
        got = {t["__address__"]: t for t in found}
        f.check(len(found) == len(got), f"job {job_name}: duplicate targets {[t['__address__'] for t in found]}")
        for address, (pod_name, labels) in want.items():
            if not f.check(address in got, f"job {job_name}: pod {pod_name} should be scraped at {address}; "
                           f"targets: {sorted(got)}"):
                continue
            for k, v in labels.items():
                f.check(got[address].get(k) == v, f"job {job_name}: {address} has {k}={got[address].get(k)}, "
                        f"expected {v}")
            f.check(got[address].get("__metrics_path__") == "/metrics", f"job {job_name}: {address} path "
                    f"{got[address].get('__metrics_path__')}")
        for address in got:
            f.check(address in want, f"job {job_name}: unexpected target {address}")
        summary.append(f"{job_name}: {len(got)} targets ({', '.join(sorted(got)[:3])}{', ...' if len(got) > 3 else ''})")
    shutil.rmtree(work, ignore_errors=True)
    f.finish("; ".join(summary))


if __name__ == "__main__":
    try:
        main()
    except dc.CheckFailed as e:
        print(f"check_prometheus_k8s: FAIL: {e}", file=sys.stderr)
        sys.exit(1)
