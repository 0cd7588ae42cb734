#!/usr/bin/python3
"""Offline validation of deploy/k8s (no cluster, no kubeconform: Debian 12 has none).

Structure: every document has a known apiVersion/kind, a DNS-1123 name, no namespace other than
the kustomization's, and only fields of the Kubernetes API for the objects used (catches typos
such as `readinessprobe`); the kustomization lists exactly the manifests of the directory.

Semantics:
  - container commands (the image's ENTRYPOINT/CMD from docker/Dockerfile, then command/args,
    $(VAR) expanded from the ConfigMap and env, `sh -c` scripts split into commands) run the
    image's binaries with flags their --help knows, values where needed, required flags present;
  - exec probes likewise; every container has readiness and liveness probes; the gRPC probe port
    is the gateway's --port;
  - ranks and gateway request one nvidia.com/gpu; hostNetwork pods use ClusterFirstWithHostNet;
    a hostNetwork workload of several replicas declares no fixed containerPort; the rank id comes
    from the pod name (under hostNetwork the hostname is the node's);
  - selectors match template labels; Services point at declared ports; the StatefulSet's
    serviceName is a headless Service of its pods; the ranks' --gateway is a Service with
    publishNotReadyAddresses (the gateway is only ready once ranks have registered) on the
    gateway's port; --ranks equals the StatefulSet's replicas;
  - the checkpoint: a ReadOnlyMany PVC mounted read-only where --checkpoint points;
  - pods run as the image's non-root uid and carry prometheus.io/scrape;
  - the ranks' `sh -c` wrapper and exec probes really run under /bin/sh (the binaries stubbed)
    for several pod names: pod moe-rank-<i> runs moe-rank --rank <i>, and its probes read the
    metrics port it serves.

usage: check_k8s.py [--bin-dir DIR] [--source-dir DIR]
"""

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import deploy_common as dc  # noqa: E402

KINDS = {
    ("v1", "Namespace"), ("v1", "ConfigMap"), ("v1", "Service"), ("v1", "PersistentVolumeClaim"),
    ("apps/v1", "Deployment"), ("apps/v1", "StatefulSet"),
    ("kustomize.config.k8s.io/v1beta1", "Kustomization"),
}

# Fields of the Kubernetes API (core/v1, apps/v1) for the objects these manifests use.
FIELDS = {
    "object": {"apiVersion", "kind", "metadata", "spec", "data", "binaryData", "immutable", "status"},
    "metadata": {"name", "namespace", "labels", "annotations", "generateName"},
    "Deployment.spec": {"replicas", "selector", "template", "strategy", "minReadySeconds",
                        "revisionHistoryLimit", "progressDeadlineSeconds", "paused"},
    "StatefulSet.spec": {"replicas", "selector", "template", "serviceName", "podManagementPolicy",
                         "updateStrategy", "revisionHistoryLimit", "volumeClaimTemplates", "minReadySeconds",
                         "persistentVolumeClaimRetentionPolicy", "ordinals"},
    "selector": {"matchLabels", "matchExpressions"},
    "template": {"metadata", "spec"},
    "pod.spec": {"containers", "initContainers", "volumes", "hostNetwork", "hostIPC", "hostPID", "dnsPolicy",
                 "dnsConfig", "securityContext", "serviceAccountName", "nodeSelector", "affinity", "tolerations",
                 "terminationGracePeriodSeconds", "priorityClassName", "restartPolicy", "runtimeClassName",
                 "imagePullSecrets", "schedulerName", "topologySpreadConstraints", "enableServiceLinks",
                 "shareProcessNamespace", "automountServiceAccountToken", "hostname", "subdomain"},
    "container": {"name", "image", "imagePullPolicy", "command", "args", "env", "envFrom", "ports", "resources",
                  "readinessProbe", "livenessProbe", "startupProbe", "volumeMounts", "securityContext",
                  "workingDir", "lifecycle", "terminationMessagePolicy", "stdin", "tty"},
    "probe": {"exec", "grpc", "httpGet", "tcpSocket", "initialDelaySeconds", "periodSeconds", "timeoutSeconds",
              "successThreshold", "failureThreshold", "terminationGracePeriodSeconds"},
    "resources": {"requests", "limits", "claims"},
    "volumeMount": {"name", "mountPath", "readOnly", "subPath", "subPathExpr", "mountPropagation"},
    "volume": {"name", "persistentVolumeClaim", "hostPath", "emptyDir", "configMap", "secret", "projected",
               "downwardAPI", "nfs", "csi", "ephemeral"},
    "containerPort": {"name", "containerPort", "protocol", "hostPort", "hostIP"},
    "env": {"name", "value", "valueFrom"},
    "Service.spec": {"type", "selector", "ports", "clusterIP", "clusterIPs", "publishNotReadyAddresses",
                     "sessionAffinity", "externalTrafficPolicy", "internalTrafficPolicy", "ipFamilies",
                     "ipFamilyPolicy", "loadBalancerIP", "loadBalancerSourceRanges", "externalName"},
    "servicePort": {"name", "port", "targetPort", "protocol", "appProtocol", "nodePort"},
    "PersistentVolumeClaim.spec": {"accessModes", "resources", "storageClassName", "volumeName", "volumeMode",
                                   "selector", "dataSource", "dataSourceRef"},
    "Kustomization": {"apiVersion", "kind", "namespace", "resources", "labels", "commonLabels",
                      "commonAnnotations", "images", "configMapGenerator", "secretGenerator", "patches",
                      "namePrefix", "nameSuffix", "replicas", "generatorOptions", "components"},
}
DNS1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


class Checker:
    def __init__(self, source, bindir):
        self.source = source
        self.k8s = source / "deploy" / "k8s"
        self.bindir = bindir
        self.f = dc.Failures("check_k8s")
        self.docs = []   # (file, doc)
        self.commands_checked = 0

    # ---- loading and structure -----------------------------------------------------------------

    def load(self):
        for path in sorted(self.k8s.glob("*.y*ml")):
            try:
                for doc in yaml.safe_load_all(path.read_text()):
                    if doc is not None:
                        self.docs.append((path.name, doc))
            except yaml.YAMLError as e:
                self.f.add(f"{path.name}: {e}")

    def keys(self, obj, allowed, where):
        if not isinstance(obj, dict):
            self.f.add(f"{where}: expected a mapping, got {type(obj).__name__}")
            return
        for key in obj:
            self.f.check(key in FIELDS[allowed], f"{where}: unknown field '{key}'")

    def of_kind(self, kind):
        return [(f, d) for f, d in self.docs if d.get("kind") == kind]

    def check_structure(self):
        kust = self.of_kind("Kustomization")
        if not self.f.check(len(kust) == 1, "expected one kustomization.yaml"):
            return
        kfile, k = kust[0]
        self.keys(k, "Kustomization", kfile)
        self.namespace = k.get("namespace")
        self.f.check(self.namespace == "moe", f"kustomization namespace is {self.namespace}, expected moe")
        listed = k.get("resources", [])
        files = sorted(p.name for p in self.k8s.glob("*.y*ml") if p.name != kfile)
        for r in listed:
            self.f.check((self.k8s / r).is_file(), f"kustomization lists {r}, which does not exist")
        for name in files:
            self.f.check(name in listed, f"{name} is not listed in kustomization.yaml resources")
        self.f.check(len(listed) == len(set(listed)), "kustomization lists a resource twice")
        names = set()
        for fname, doc in self.docs:
            kind = doc.get("kind")
            if kind == "Kustomization":
                continue
            where = f"{fname}: {kind}/{(doc.get('metadata') or {}).get('name')}"
            if not self.f.check((doc.get("apiVersion"), kind) in KINDS,
                                f"{where}: unknown apiVersion/kind {doc.get('apiVersion')}/{kind}"):
                continue
            self.keys(doc, "object", where)
            meta = doc.get("metadata") or {}
            self.keys(meta, "metadata", where)
            name = meta.get("name", "")
            self.f.check(bool(DNS1123.match(name)) and len(name) <= 63, f"{where}: bad name '{name}'")
            self.f.check(meta.get("namespace") in (None, self.namespace),
                         f"{where}: namespace {meta.get('namespace')} differs from the kustomization's")
            self.f.check((kind, name) not in names, f"{where}: defined twice")
            names.add((kind, name))
            for value in (meta.get("labels") or {}).values():
                self.f.check(isinstance(value, str), f"{where}: label value {value!r} is not a string")
            for value in (meta.get("annotations") or {}).values():
                self.f.check(isinstance(value, str), f"{where}: annotation value {value!r} is not a string")
            spec = doc.get("spec")
            if kind in ("Deployment", "StatefulSet"):
                self.keys(spec, f"{kind}.spec", where)
                self.keys(spec.get("selector"), "selector", f"{where} selector")
                self.keys(spec.get("template"), "template", f"{where} template")
                self.keys(spec["template"].get("metadata"), "metadata", f"{where} template metadata")
                pod = spec["template"].get("spec") or {}
                self.keys(pod, "pod.spec", f"{where} pod")
                for v in pod.get("volumes", []):
                    self.keys(v, "volume", f"{where} volume {v.get('name')}")
                for c in pod.get("containers", []):
                    cw = f"{where} container {c.get('name')}"
                    self.keys(c, "container", cw)
                    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                        if probe in c:
                            self.keys(c[probe], "probe", f"{cw} {probe}")
                    if "resources" in c:
                        self.keys(c["resources"], "resources", f"{cw} resources")
                    for m in c.get("volumeMounts", []):
                        self.keys(m, "volumeMount", f"{cw} volumeMount")
                    for p in c.get("ports", []):
                        self.keys(p, "containerPort", f"{cw} port")
                    for e in c.get("env", []):
                        self.keys(e, "env", f"{cw} env")
            elif kind == "Service":
                self.keys(spec, "Service.spec", where)
                for p in spec.get("ports", []):
                    self.keys(p, "servicePort", f"{where} port")
            elif kind == "PersistentVolumeClaim":
                self.keys(spec, "PersistentVolumeClaim.spec", where)
            elif kind == "ConfigMap":
                for key, value in (doc.get("data") or {}).items():
                    self.f.check(isinstance(value, str), f"{where}: data.{key} = {value!r} is not a string")

    # ---- semantics -----------------------------------------------------------------------------

    def image_defaults(self):
        """ENTRYPOINT, CMD and numeric USER of the runtime stage of docker/Dockerfile."""
        entrypoint, cmd, user = [], [], None
        for instruction, rest in dc.dockerfile_instructions(self.source / "docker" / "Dockerfile"):
            if instruction == "FROM":
                entrypoint, cmd, user = [], [], None
            elif instruction == "ENTRYPOINT":
                entrypoint = dc.exec_form(rest) or ["/bin/sh", "-c", rest]
            elif instruction == "CMD":
                cmd = dc.exec_form(rest) or ["/bin/sh", "-c", rest]
            elif instruction == "USER":
                user = rest.split(":")[0]
        return entrypoint, cmd, user

    def config_env(self, container):
        env = {}
        for ref in container.get("envFrom", []):
            name = (ref.get("configMapRef") or {}).get("name")
            cms = [d for _, d in self.of_kind("ConfigMap") if d["metadata"]["name"] == name]
            if self.f.check(len(cms) == 1, f"envFrom ConfigMap {name} is not defined"):
                env.update(cms[0].get("data") or {})
        fieldrefs = {}
        for e in container.get("env", []):
            if "value" in e:
                env[e["name"]] = str(e["value"])
            elif "valueFrom" in e:
                fieldrefs[e["name"]] = ((e["valueFrom"].get("fieldRef") or {}).get("fieldPath"))
        return env, fieldrefs

    @staticmethod
    def expand_k8s(word, env):
        return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), word)

    @staticmethod
    def expand_shell(word, env):
        return re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?(?![#%:(])",
                      lambda m: env.get(m.group(1), m.group(0)), word)

    def command_lines(self, argv, env, where):
        """Project command lines inside argv (direct, or the commands of an sh -c script)."""
        argv = [self.expand_k8s(a, env) for a in argv]
        script = dc.shell_script_of(argv)
        if script is not None:
            lines = [[self.expand_shell(w, env) for w in words] for words in dc.commands_in_shell(script)]
            if not lines:
                self.f.add(f"{where}: the shell script runs no project binary: {script!r}")
            return lines, script
        argv = dc.strip_init(argv)
        if argv and os.path.basename(argv[0]) not in dc.BINARIES + dc.SCRIPTS:
            self.f.add(f"{where}: runs '{argv[0]}', not one of the image's binaries")
            return [], None
        return [argv], None

    def parse(self, argv, where):
        if os.path.basename(argv[0]) in dc.SCRIPTS:
            self.f.check((self.source / "docker" / os.path.basename(argv[0])).is_file(),
                         f"{where}: {argv[0]} is not in docker/")
            self.commands_checked += 1
            return os.path.basename(argv[0]), None, {}
        try:
            result = dc.parse_argv(self.bindir, argv)
            self.commands_checked += 1
            return result
        except dc.CheckFailed as e:
            self.f.add(f"{where}: {e}")
            return None, None, {}

    def check_workloads(self):
        entrypoint, cmd, user = self.image_defaults()
        self.f.check(user is not None and user.isdigit() and user != "0",
                     f"docker/Dockerfile runtime USER {user} is not a numeric non-root uid")
        pvcs = {d["metadata"]["name"]: d for _, d in self.of_kind("PersistentVolumeClaim")}
        services = {d["metadata"]["name"]: d for _, d in self.of_kind("Service")}
        self.gateway = None
        self.ranks = []
        workloads = self.of_kind("Deployment") + self.of_kind("StatefulSet")
        for fname, w in workloads:
            kind, name = w["kind"], w["metadata"]["name"]
            where = f"{fname}: {kind}/{name}"
            spec = w["spec"]
            tmpl_labels = (spec["template"].get("metadata") or {}).get("labels") or {}
            match = (spec.get("selector") or {}).get("matchLabels") or {}
            self.f.check(bool(match) and all(tmpl_labels.get(k) == v for k, v in match.items()),
                         f"{where}: selector {match} does not match the template labels {tmpl_labels}")
            pod = spec["template"]["spec"]
            annotations = (spec["template"].get("metadata") or {}).get("annotations") or {}
            self.f.check(annotations.get("prometheus.io/scrape") == "true",
                         f"{where}: pod template lacks the annotation prometheus.io/scrape: \"true\"")
            host_network = bool(pod.get("hostNetwork"))
            if host_network or pod.get("hostIPC"):
                ns = [d for _, d in self.of_kind("Namespace") if d["metadata"]["name"] == self.namespace]
                level = ((ns[0]["metadata"].get("labels") or {}).get("pod-security.kubernetes.io/enforce")
                         if ns else None)
                self.f.check(level == "privileged", f"{where}: hostNetwork/hostIPC pods need the namespace's "
                             f"pod-security.kubernetes.io/enforce: privileged (is {level})")
            if host_network:
                self.f.check(pod.get("dnsPolicy") == "ClusterFirstWithHostNet",
                             f"{where}: hostNetwork needs dnsPolicy ClusterFirstWithHostNet to resolve Services")
                if kind == "Deployment":
                    self.f.check((spec.get("strategy") or {}).get("type") == "Recreate",
                                 f"{where}: a hostNetwork Deployment needs strategy Recreate (the new pod needs "
                                 "the old one's host ports)")
            sc = pod.get("securityContext") or {}
            self.f.check(sc.get("runAsNonRoot") is True, f"{where}: runAsNonRoot is not set")
            self.f.check(str(sc.get("runAsUser")) == str(user),
                         f"{where}: runAsUser {sc.get('runAsUser')} is not the image's user {user}")
            volumes = {v["name"]: v for v in pod.get("volumes", [])}
            for c in pod.get("containers", []):
                cw = f"{where} container {c['name']}"
                self.f.check(str(c.get("image", "")).split("/")[-1].split(":")[0] == "moe-serve",
                             f"{cw}: image {c.get('image')} is not moe-serve")
                env, fieldrefs = self.config_env(c)
                command = c["command"] if "command" in c else entrypoint
                args = c["args"] if "args" in c else ([] if "command" in c else cmd)
                lines, script = self.command_lines(list(command) + list(args), env, f"{cw} command")
                main = None
                for argv in lines:
                    binary, sub, values = self.parse(argv, f"{cw} command")
                    if binary in ("moe-gateway", "moe-rank"):
                        main = (binary, values)
                if main is None:
                    self.f.add(f"{cw}: runs neither moe-gateway nor moe-rank")
                    continue
                binary, values = main
                ports = {p.get("name"): p["containerPort"] for p in c.get("ports", [])}
                if host_network and (spec.get("replicas", 1) > 1 or kind == "StatefulSet"):
                    self.f.check(not c.get("ports"),
                                 f"{cw}: hostNetwork replicas would share the node's ports; declare no "
                                 "containerPort (it becomes a hostPort and allows one pod per node)")
                # Probes.
                for probe in ("readinessProbe", "livenessProbe"):
                    self.f.check(probe in c, f"{cw}: no {probe}")
                for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                    p = c.get(probe)
                    if not p:
                        continue
                    handlers = [h for h in ("exec", "grpc", "httpGet", "tcpSocket") if h in p]
                    if not self.f.check(len(handlers) == 1, f"{cw} {probe}: needs exactly one handler"):
                        continue
                    if "exec" in p:
                        for argv in self.command_lines(p["exec"]["command"], env, f"{cw} {probe}")[0]:
                            self.parse(argv, f"{cw} {probe}")
                            if os.path.basename(argv[0]) == "moe-rank-probe":
                                self.check_probe_port(argv, values, script, kind, spec, f"{cw} {probe}")
                    if "grpc" in p:
                        self.f.check(binary == "moe-gateway", f"{cw} {probe}: gRPC probe on {binary}, which "
                                     "serves no gRPC")
                        port = dc.flag_value(self.bindir, binary, values, "port")
                        self.f.check(str(p["grpc"].get("port")) == str(port),
                                     f"{cw} {probe}: gRPC probe port {p['grpc'].get('port')} but --port {port}")
                # GPU.
                res = c.get("resources") or {}
                limit = (res.get("limits") or {}).get("nvidia.com/gpu")
                self.f.check(limit is not None and int(limit) >= 1, f"{cw}: no nvidia.com/gpu limit")
                req = (res.get("requests") or {}).get("nvidia.com/gpu")
                self.f.check(req is None or int(req) == int(limit or 0),
                             f"{cw}: nvidia.com/gpu request {req} differs from the limit {limit}")
                # Checkpoint volume.
                ckpt = values.get("checkpoint") or (self.gateway_checkpoint if binary == "moe-rank" else None)
                mounts = c.get("volumeMounts", [])
                for m in mounts:
                    self.f.check(m["name"] in volumes, f"{cw}: volumeMount {m['name']} has no volume")
                if binary == "moe-gateway":
                    self.gateway_checkpoint = ckpt
                    self.gateway = (where, w, c, values, ports, env)
                else:
                    self.ranks.append((where, w, c, values, env, fieldrefs, script, host_network))
                for m in mounts:
                    v = volumes.get(m["name"]) or {}
                    claim = (v.get("persistentVolumeClaim") or {}).get("claimName")
                    if claim:
                        pvc = pvcs.get(claim)
                        if self.f.check(pvc is not None, f"{cw}: PVC {claim} is not defined"):
                            self.f.check("ReadOnlyMany" in pvc["spec"].get("accessModes", []),
                                         f"{cw}: PVC {claim} is not ReadOnlyMany")
                        self.f.check(m.get("readOnly") is True and v["persistentVolumeClaim"].get("readOnly") is True,
                                     f"{cw}: checkpoint volume {m['name']} is not mounted read-only")
                if ckpt is not None:
                    self.f.check(any(ckpt == m["mountPath"] or str(ckpt).startswith(m["mountPath"].rstrip("/") + "/")
                                     for m in mounts),
                                 f"{cw}: --checkpoint {ckpt} is not under a volume mount")
        self.check_gateway_and_ranks(services)

    def check_probe_port(self, argv, values, script, kind, spec, where):
        """moe-rank-probe [--live] PORT must read the port the rank serves /metrics on, for every
        pod ordinal."""
        ports = [a for a in argv[1:] if not a.startswith("--")]
        if not self.f.check(len(ports) == 1, f"{where}: moe-rank-probe needs the metrics port"):
            return
        served = values.get("metrics-port")
        if not self.f.check(served not in (None, "-1"), f"{where}: the rank serves no /metrics to probe"):
            return
        ordinals = range(int(spec.get("replicas", 1))) if kind == "StatefulSet" else [0]
        try:
            for i in ordinals:
                probed = dc.port_for_ordinal(ports[0], i, script)
                want = dc.port_for_ordinal(served, i, script)
                self.f.check(probed == want, f"{where}: pod ordinal {i} probes port {probed}, serves {want}")
        except dc.CheckFailed as e:
            self.f.add(f"{where}: {e}")

    def run_with_stubs(self, argv, env, where):
        """Runs argv (an sh -c wrapper) under /bin/sh with stubs in place of the image's binaries
        and scripts; returns the argv lists the stubs were called with."""
        stubs = Path(tempfile.mkdtemp(prefix="moe-k8s-stubs-"))
        try:
            log = stubs / "calls"
            for name in dc.BINARIES + dc.SCRIPTS:
                stub = stubs / name
                stub.write_text(f'#!/bin/sh\nprintf "%s\\0" "{name}" "$@" >> "{log}"\nprintf "\\n" >> "{log}"\n')
                stub.chmod(0o755)
            run_env = dict(env, PATH=f"{stubs}:/usr/bin:/bin")
            out = subprocess.run(dc.strip_init(argv), env=run_env, capture_output=True, text=True, timeout=30)
            if out.returncode != 0:
                self.f.add(f"{where}: /bin/sh exited {out.returncode}: {out.stderr.strip()}")
            calls = []
            if log.exists():
                for line in log.read_text().split("\n"):
                    if line:
                        calls.append(line.rstrip("\0").split("\0"))
            return calls
        finally:
            shutil.rmtree(stubs, ignore_errors=True)

    def execute_rank_wrappers(self):
        """Runs each rank container's command and exec probes with /bin/sh for a few pod names
        (stubbed binaries): the rank id and the metrics port each pod really gets."""
        for where, w, c, values, env, fieldrefs, script, host_network in self.ranks:
            if script is None:
                continue
            name = w["metadata"]["name"]
            for ordinal in sorted({0, 1, int(w["spec"].get("replicas", 1)) - 1, 12}):
                pod_env = dict(env)
                for var, path in fieldrefs.items():
                    if path == "metadata.name":
                        pod_env[var] = f"{name}-{ordinal}"
                argv = [self.expand_k8s(a, pod_env) for a in (c.get("command", []) + c.get("args", []))]
                calls = self.run_with_stubs(argv, pod_env, f"{where} pod {name}-{ordinal}")
                ranks = [call for call in calls if call[0] == "moe-rank"]
                if not self.f.check(len(ranks) == 1, f"{where} pod {name}-{ordinal}: ran {calls}"):
                    continue
                try:
                    _, _, got = dc.parse_argv(self.bindir, ranks[0])
                except dc.CheckFailed as e:
                    self.f.add(f"{where} pod {name}-{ordinal}: {e}")
                    continue
                self.f.check(got.get("rank") == str(ordinal),
                             f"{where} pod {name}-{ordinal}: runs --rank {got.get('rank')}")
                port = got.get("metrics-port")
                for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                    p = c.get(probe) or {}
                    if "exec" not in p:
                        continue
                    for call in self.run_with_stubs(p["exec"]["command"], pod_env,
                                                    f"{where} {probe} pod {name}-{ordinal}"):
                        if call[0] == "moe-rank-probe":
                            probed = [a for a in call[1:] if not a.startswith("--")]
                            self.f.check(probed == [port], f"{where} {probe} pod {name}-{ordinal}: probes "
                                         f"{probed}, the rank serves /metrics on {port}")
                self.executed += 1

    def check_gateway_and_ranks(self, services):
        if not self.f.check(self.gateway is not None, "no workload runs moe-gateway"):
            return
        gwhere, gw, gc, gvalues, gports, genv = self.gateway
        if not self.f.check(bool(self.ranks), "no workload runs moe-rank"):
            return
        gw_port = int(dc.flag_value(self.bindir, "moe-gateway", gvalues, "port"))
        for where, w, c, values, env, fieldrefs, script, host_network in self.ranks:
            replicas = w["spec"].get("replicas", 1)
            self.f.check(w["kind"] == "StatefulSet", f"{where}: ranks need stable identities: a StatefulSet")
            self.f.check(str(gvalues.get("ranks")) == str(replicas),
                         f"{where}: {replicas} replicas, but the gateway waits for --ranks {gvalues.get('ranks')}")
            res = (c.get("resources") or {}).get("limits") or {}
            self.f.check(str(res.get("nvidia.com/gpu")) == "1", f"{where}: each rank should hold one GPU")
            # Rank id from the pod ordinal.
            rank_value = str(values.get("rank", ""))
            if self.f.check(rank_value not in ("", "-1"), f"{where}: --rank is not set from the pod ordinal"):
                if script:
                    uses = [n for n, path in fieldrefs.items() if path == "metadata.name" and n in script]
                    self.f.check(bool(uses), f"{where}: the ordinal does not come from the pod name "
                                 "(env from fieldRef metadata.name)")
                    if host_network:
                        self.f.check(not re.search(r"\bhostname\b|\$\{?HOSTNAME", script),
                                     f"{where}: under hostNetwork the hostname is the node's: take the ordinal "
                                     "from the pod name")
            # The gateway address: a Service that lists the not-ready gateway, on its port.
            address = str(values.get("gateway", ""))
            m = re.fullmatch(r"([a-z0-9-]+)(\.[a-z0-9-]+)?(\.svc(\.[a-z0-9.-]+)?)?:([0-9]+)", address)
            if self.f.check(m is not None, f"{where}: --gateway '{address}' is not SERVICE[.NAMESPACE.svc]:PORT"):
                svc_name, ns, port = m.group(1), (m.group(2) or "").lstrip("."), int(m.group(5))
                self.f.check(ns in ("", self.namespace), f"{where}: --gateway names namespace {ns}")
                svc = services.get(svc_name)
                if self.f.check(svc is not None, f"{where}: --gateway names Service {svc_name}, not defined"):
                    sel = svc["spec"].get("selector") or {}
                    labels = gw["spec"]["template"]["metadata"]["labels"]
                    self.f.check(sel and all(labels.get(k) == v for k, v in sel.items()),
                                 f"{where}: Service {svc_name} does not select the gateway pods")
                    self.f.check(svc["spec"].get("publishNotReadyAddresses") is True,
                                 f"{where}: Service {svc_name} must publishNotReadyAddresses: the gateway is "
                                 "ready only after the ranks registered through it")
                    sport = [p for p in svc["spec"].get("ports", []) if p["port"] == port]
                    if self.f.check(bool(sport), f"{where}: Service {svc_name} has no port {port}"):
                        target = sport[0].get("targetPort", port)
                        target = gports.get(target, target) if isinstance(target, str) else target
                        self.f.check(int(target) == gw_port,
                                     f"{where}: {svc_name}:{port} reaches container port {target}, the gateway "
                                     f"listens on {gw_port}")
            # Headless governing Service.
            governing = services.get(w["spec"].get("serviceName"))
            if self.f.check(governing is not None, f"{where}: serviceName {w['spec'].get('serviceName')} undefined"):
                self.f.check(governing["spec"].get("clusterIP") == "None",
                             f"{where}: the governing Service must be headless (clusterIP: None)")
        cms = self.of_kind("ConfigMap")
        for _, cm in cms:
            data = cm.get("data") or {}
            if "MOE_RANKS" in data:
                for where, w, *_ in self.ranks:
                    self.f.check(data["MOE_RANKS"] == str(w["spec"].get("replicas", 1)),
                                 f"ConfigMap MOE_RANKS {data['MOE_RANKS']} differs from {where} replicas")

    def check_services(self):
        workloads = self.of_kind("Deployment") + self.of_kind("StatefulSet")
        for fname, svc in self.of_kind("Service"):
            where = f"{fname}: Service/{svc['metadata']['name']}"
            sel = svc["spec"].get("selector") or {}
            pods = [w for _, w in workloads
                    if sel and all(w["spec"]["template"]["metadata"]["labels"].get(k) == v for k, v in sel.items())]
            self.f.check(bool(pods), f"{where}: selector {sel} matches no workload")
            headless = svc["spec"].get("clusterIP") == "None"
            self.f.check(headless or bool(svc["spec"].get("ports")), f"{where}: no ports")
            for p in svc["spec"].get("ports", []):
                target = p.get("targetPort", p["port"])
                declared = {(cp.get("name"), cp["containerPort"]) for w in pods
                            for c in w["spec"]["template"]["spec"]["containers"] for cp in c.get("ports", [])}
                ok = any(target in (n, num) for n, num in declared)
                self.f.check(ok, f"{where}: targetPort {target} is not a declared container port {sorted(declared)}")

    def run(self):
        self.load()
        self.gateway_checkpoint = None
        self.check_structure()
        # Gateways first: ranks inherit the gateway's checkpoint path.
        self.check_workloads()
        self.check_services()
        self.executed = 0
        self.execute_rank_wrappers()
        kinds = sorted({f"{d.get('kind')}" for _, d in self.docs})
        self.f.finish(f"{len(self.docs)} documents ({', '.join(kinds)}); {self.commands_checked} command lines "
                      f"checked against the binaries' --help; rank wrapper and probes run under /bin/sh for "
                      f"{self.executed} pod names")


def main():
    _, source, bindir = dc.parse_check_args()
    try:
        Checker(source, bindir).run()
    except dc.CheckFailed as e:
        print(f"check_k8s: FAIL: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
