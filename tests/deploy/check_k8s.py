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
  - trust boundaries: the ranks' --gateway reaches the gateway's --control-port through a Service
    that carries only the control port, and no other Service (the clients' one) carries it; the
    gateway authenticates ranks (no --insecure-cluster; cluster token and/or mTLS) and every rank
    presents that credential (the same Secret key as the gateway's token, or a client
    certificate); the gateway serves TLS, so its probes are exec probes (the kubelet's gRPC probe is
    plaintext) whose moe-client verifies it with --tls-ca under a name of the gateway's Service;
    under hostNetwork the control port and every /metrics listen on the pod IP (status.podIP),
    not on all of the node's interfaces, and no Service carries a metrics port;
  - secrets: every credential file (--tls-*, --*token-file) of a command or probe is a key of a
    Secret volume mounted read-only, mode 0440 with fsGroup = the pod's group (Secret files are
    root-owned) and never world-readable; every Secret volume a container mounts is read by it;
    a container that does not use a key of a Secret (the ranks and the gateway's private key)
    only mounts that Secret with `items` that leave it out;
  - pods run as the image's non-root uid and carry prometheus.io/scrape;
  - the ranks' `sh -c` wrapper and exec probes really run under /bin/sh (the binaries stubbed)
    for several pod names: pod moe-rank-<i> runs moe-rank --rank <i>, and its probes read the
    metrics port it serves, on the host the rank binds (MOE_METRICS_HOST).

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
    ("apps/v1", "Deployment"), ("apps/v1", "StatefulSet"), ("policy/v1", "PodDisruptionBudget"),
    ("kustomize.config.k8s.io/v1beta1", "Kustomization"),
}

# Fields of the Kubernetes API (core/v1, apps/v1) for the objects these manifests use.
FIELDS = {
    "object": {"apiVersion", "kind", "metadata", "spec", "data", "binaryData", "immutable", "status"},
    "metadata": {"name", "namespace", "labels", "annotations", "generateName"},
    "Deployment.spec": {"replicas", "selector", "template", "strategy", "minReadySeconds",
                        "revisionHistoryLimit", "progressDeadlineSeconds", "paused"},
    "deploymentStrategy": {"type", "rollingUpdate"},
    "rollingUpdate": {"maxSurge", "maxUnavailable"},
    "PodDisruptionBudget.spec": {"minAvailable", "maxUnavailable", "selector", "unhealthyPodEvictionPolicy"},
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
    "secretVolume": {"secretName", "defaultMode", "items", "optional"},
    "keyToPath": {"key", "path", "mode"},
    "podSecurityContext": {"runAsNonRoot", "runAsUser", "runAsGroup", "fsGroup", "fsGroupChangePolicy",
                           "supplementalGroups", "seccompProfile", "seLinuxOptions", "sysctls", "windowsOptions"},
    "envValueFrom": {"fieldRef", "configMapKeyRef", "secretKeyRef", "resourceFieldRef"},
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
                if "strategy" in spec:
                    self.keys(spec["strategy"], "deploymentStrategy", f"{where} strategy")
                    if "rollingUpdate" in spec["strategy"]:
                        self.keys(spec["strategy"]["rollingUpdate"], "rollingUpdate", f"{where} rollingUpdate")
                self.keys(spec.get("selector"), "selector", f"{where} selector")
                self.keys(spec.get("template"), "template", f"{where} template")
                self.keys(spec["template"].get("metadata"), "metadata", f"{where} template metadata")
                pod = spec["template"].get("spec") or {}
                self.keys(pod, "pod.spec", f"{where} pod")
                if "securityContext" in pod:
                    self.keys(pod["securityContext"], "podSecurityContext", f"{where} pod securityContext")
                for v in pod.get("volumes", []):
                    self.keys(v, "volume", f"{where} volume {v.get('name')}")
                    if "secret" in v:
                        self.keys(v["secret"], "secretVolume", f"{where} volume {v.get('name')} secret")
                        for item in v["secret"].get("items", []):
                            self.keys(item, "keyToPath", f"{where} volume {v.get('name')} secret item")
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
                        if "valueFrom" in e:
                            self.keys(e["valueFrom"], "envValueFrom", f"{cw} env {e.get('name')} valueFrom")
            elif kind == "Service":
                self.keys(spec, "Service.spec", where)
                for p in spec.get("ports", []):
                    self.keys(p, "servicePort", f"{where} port")
            elif kind == "PersistentVolumeClaim":
                self.keys(spec, "PersistentVolumeClaim.spec", where)
            elif kind == "PodDisruptionBudget":
                self.keys(spec, "PodDisruptionBudget.spec", where)
                self.keys(spec.get("selector"), "selector", f"{where} selector")
                targets = [d for _, d in self.of_kind("Deployment") + self.of_kind("StatefulSet")
                           if all(((d["spec"]["template"].get("metadata") or {}).get("labels") or {}).get(k) == v
                                  for k, v in ((spec.get("selector") or {}).get("matchLabels") or {}).items())]
                self.f.check(len(targets) == 1, f"{where}: selects {len(targets)} workloads, not one")
                if targets:
                    replicas = int(targets[0]["spec"].get("replicas", 1))
                    self.f.check(isinstance(spec.get("minAvailable"), int) and 0 < spec["minAvailable"] < replicas,
                                 f"{where}: minAvailable {spec.get('minAvailable')} must leave room to evict one of "
                                 f"{replicas} replicas and keep one")
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
                    strategy = spec.get("strategy") or {}
                    rolling = strategy.get("rollingUpdate") or {}
                    self.f.check(strategy.get("type") == "Recreate" or
                                 (strategy.get("type") == "RollingUpdate" and str(rolling.get("maxSurge")) == "0"),
                                 f"{where}: a hostNetwork Deployment needs strategy Recreate, or RollingUpdate with "
                                 "maxSurge 0 (the new pod needs the old one's host ports)")
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
                uses = [(binary, values, "command")]
                ports = {p.get("name"): p["containerPort"] for p in c.get("ports", [])}
                if host_network and kind == "StatefulSet":
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
                            pb, _, pv = self.parse(argv, f"{cw} {probe}")
                            if pb:
                                uses.append((pb, pv, probe))
                            if os.path.basename(argv[0]) == "moe-rank-probe":
                                self.check_probe_port(argv, values, script, kind, spec, f"{cw} {probe}")
                    if "grpc" in p:
                        self.f.check(binary == "moe-gateway", f"{cw} {probe}: gRPC probe on {binary}, which "
                                     "serves no gRPC")
                        self.f.check(not values.get("tls-cert"), f"{cw} {probe}: the kubelet's gRPC probe speaks "
                                     "plaintext, the gateway serves TLS (--tls-cert): use an exec probe with "
                                     "moe-client health --tls-ca")
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
                self.containers.append({"where": cw, "binary": binary, "values": values, "uses": uses, "pod": pod,
                                        "container": c, "volumes": volumes, "fieldrefs": fieldrefs,
                                        "host_network": host_network, "workload": w})
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
                # The call's argv, then the environment moe-rank-probe reads (MOE_METRICS_HOST).
                stub.write_text(f'#!/bin/sh\nprintf "%s\\0" "{name}" "$@" "@MOE_METRICS_HOST=${{MOE_METRICS_HOST-}}" '
                                f'>> "{log}"\nprintf "\\n" >> "{log}"\n')
                stub.chmod(0o755)
            run_env = dict(env, PATH=f"{stubs}:/usr/bin:/bin")
            out = subprocess.run(dc.strip_init(argv), env=run_env, capture_output=True, text=True, timeout=30)
            if out.returncode != 0:
                self.f.add(f"{where}: /bin/sh exited {out.returncode}: {out.stderr.strip()}")
            calls = []
            if log.exists():
                for line in log.read_text().split("\n"):
                    if line:
                        call = line.rstrip("\0").split("\0")
                        self.stub_env[id(call)] = call.pop()[len("@MOE_METRICS_HOST="):]
                        calls.append(call)
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
                pod_ip = f"10.0.7.{ordinal + 1}"
                for var, path in fieldrefs.items():
                    if path == "metadata.name":
                        pod_env[var] = f"{name}-{ordinal}"
                    elif path == "status.podIP":
                        pod_env[var] = pod_ip
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
                metrics_host = dc.flag_value(self.bindir, "moe-rank", got, "metrics-host")
                if host_network:
                    self.f.check(metrics_host == pod_ip, f"{where} pod {name}-{ordinal}: --metrics-host "
                                 f"{metrics_host}, the pod IP is {pod_ip}")
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
                            # moe-rank-probe reads $MOE_METRICS_HOST, else 127.0.0.1 (0.0.0.0: loopback).
                            probed_host = self.stub_env.get(id(call)) or "127.0.0.1"
                            want = "127.0.0.1" if metrics_host in ("0.0.0.0", None) else metrics_host
                            self.f.check(probed_host.replace("0.0.0.0", "127.0.0.1") == want,
                                         f"{where} {probe} pod {name}-{ordinal}: moe-rank-probe reads "
                                         f"{probed_host}, the rank serves /metrics on {metrics_host}")
                self.executed += 1

    def check_gateway_and_ranks(self, services):
        if not self.f.check(self.gateway is not None, "no workload runs moe-gateway"):
            return
        gwhere, gw, gc, gvalues, gports, genv = self.gateway
        if not self.f.check(bool(self.ranks), "no workload runs moe-rank"):
            return
        gw_port = int(dc.flag_value(self.bindir, "moe-gateway", gvalues, "control-port"))
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
                                     f"{where}: {svc_name}:{port} reaches container port {target}, the gateway's "
                                     f"control port is {gw_port} (--control-port)")
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

    # ---- trust boundaries ----------------------------------------------------------------------

    def secret_of(self, entry, path):
        """(Secret name, key, volume mount, volume) a file path of a container reads, or None."""
        c, volumes = entry["container"], entry["volumes"]
        for m in sorted(c.get("volumeMounts", []), key=lambda m: -len(m["mountPath"])):
            base = m["mountPath"].rstrip("/") + "/"
            if not str(path).startswith(base):
                continue
            rel = str(path)[len(base):]
            secret = (volumes.get(m["name"]) or {}).get("secret")
            if secret is None:
                return None
            items = secret.get("items")
            if items is None:
                return (secret.get("secretName"), rel, m, volumes[m["name"]]) if "/" not in rel else None
            for item in items:
                if item.get("path") == rel:
                    return secret.get("secretName"), item.get("key"), m, volumes[m["name"]]
            return None
        return None

    @staticmethod
    def pod_ip_value(value, fieldrefs):
        """The flag value is the pod IP: $(VAR), $VAR or ${VAR} of an env var from status.podIP."""
        m = re.fullmatch(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)|\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", str(value or ""))
        return bool(m) and fieldrefs.get(m.group(1) or m.group(2)) == "status.podIP"

    def check_trust(self, services):
        f = self.f
        gws = [e for e in self.containers if e["binary"] == "moe-gateway"]
        if len(gws) != 1:
            return
        g = gws[0]
        gw = dc.gateway_security(self.bindir, g["values"])
        f.check(gw["tls"], f"{g['where']}: the gateway serves its ports in plaintext (give --tls-cert/--tls-key)")
        # Credential files: keys of read-only Secret volumes readable by the pod's user only.
        used_keys = {}   # container where -> {(secret, key)}
        key_use = {}     # (secret, key) -> {flag}
        for e in self.containers:
            used_keys[e["where"]] = set()
            sc = e["pod"].get("securityContext") or {}
            for b, v, what in e["uses"]:
                if b == "moe-client":
                    for problem in dc.tls_client_problems(gw, v, f"{what} (moe-client)"):
                        f.add(f"{e['where']}: {problem}")
                    if gw["tls"]:
                        name = v.get("tls-server-name") or str(v.get("target", "")).rsplit(":", 1)[0]
                        self.tls_names.add(name)
                        svc = name.split(".")[0]
                        ok = (svc in services and self.selects(services[svc], g["workload"])
                              and re.fullmatch(rf"{re.escape(svc)}(\.{re.escape(self.namespace)}(\.svc(\.[a-z0-9.-]+)?)?)?",
                                               name) is not None)
                        f.check(ok, f"{e['where']} {what}: verifies the gateway's certificate as '{name}', not as a "
                                "Service of the gateway (give --tls-server-name SERVICE.NAMESPACE.svc)")
                for flag in dc.CREDENTIAL_FLAGS:
                    if not v.get(flag):
                        continue
                    ref = self.secret_of(e, v[flag])
                    if not f.check(ref is not None, f"{e['where']} {what}: --{flag} {v[flag]} is not a key of a "
                                   "mounted Secret volume"):
                        continue
                    secret, key, mount, volume = ref
                    used_keys[e["where"]].add((secret, key))
                    key_use.setdefault((secret, key), set()).add(flag)
                    e.setdefault("refs", {})[(what, flag)] = (secret, key)
            for m in e["container"].get("volumeMounts", []):
                vol = e["volumes"].get(m["name"]) or {}
                if "secret" not in vol:
                    continue
                vw = f"{e['where']}: Secret volume {m['name']}"
                f.check(m.get("readOnly") is True, f"{vw} is not mounted readOnly")
                f.check("subPath" not in m, f"{vw} uses subPath, which never sees a rotated Secret")
                mode = vol["secret"].get("defaultMode", 0o644)
                f.check(mode & 0o007 == 0, f"{vw}: defaultMode {mode:04o} lets every user of the node read it")
                f.check(mode & 0o222 == 0, f"{vw}: defaultMode {mode:04o} is writable")
                if str(sc.get("runAsUser", "0")) != "0":
                    groups = {str(sc.get("runAsGroup"))} | {str(x) for x in sc.get("supplementalGroups") or []}
                    f.check(mode & 0o040 and str(sc.get("fsGroup")) in groups,
                            f"{vw}: defaultMode {mode:04o}, fsGroup {sc.get('fsGroup')}: Secret files are root-owned "
                            f"with group fsGroup, so uid {sc.get('runAsUser')} reads them only with mode 0440 and "
                            "fsGroup = its group")
                secret = vol["secret"].get("secretName")
                f.check(any(s == secret for s, _ in used_keys[e["where"]]),
                        f"{vw} (Secret {secret}) is mounted but nothing of the container reads it")
                e.setdefault("mounted", []).append(vol["secret"])
        # Nobody mounts a key another container needs privately (the gateway's private key).
        for (secret, key), flags in key_use.items():
            if "tls-key" not in flags:
                continue
            for e in self.containers:
                if (secret, key) in used_keys[e["where"]]:
                    continue
                for s in e.get("mounted", []):
                    if s.get("secretName") == secret:
                        f.check(s.get("items") is not None and all(i.get("key") != key for i in s["items"]),
                                f"{e['where']}: mounts Secret {secret} with its private key {key}, which it does "
                                "not use (mount only the keys it reads: items)")
        self.secret_keys = key_use
        # Ranks: the gateway's control port, authenticated with the gateway's token.
        gref = g.get("refs", {})
        for e in self.containers:
            if e["binary"] != "moe-rank":
                continue
            for problem in dc.rank_auth_problems(gw, e["values"], "the rank"):
                f.add(f"{e['where']}: {problem}")
            if gw["token"] and e["values"].get("cluster-token-file"):
                f.check(e.get("refs", {}).get(("command", "cluster-token-file")) ==
                        gref.get(("command", "cluster-token-file")),
                        f"{e['where']}: its cluster token is {e.get('refs', {}).get(('command', 'cluster-token-file'))}, "
                        f"the gateway's {gref.get(('command', 'cluster-token-file'))}")
            address = str(e["values"].get("gateway", ""))
            self.tls_names.add(e["values"].get("tls-server-name") or address.rsplit(":", 1)[0])
        # Listening only on the pod network under hostNetwork.
        for e in self.containers:
            if not e["host_network"]:
                continue
            flags = ["metrics-host"] + (["control-host"] if e["binary"] == "moe-gateway" else [])
            for flag in flags:
                v = e["values"].get(flag)
                if e["binary"] == "moe-gateway" and v is None:  # both default to the gateway's --host
                    v = e["values"].get("host")
                if flag == "metrics-host" and dc.flag_value(self.bindir, e["binary"], e["values"], "metrics-port") \
                        in (None, "-1"):
                    continue
                f.check(self.pod_ip_value(v, e["fieldrefs"]),
                        f"{e['where']}: --{flag} {v}: under hostNetwork that is every interface of the node; bind "
                        "the pod IP (an env var from fieldRef status.podIP)")
        # Services: the control port only on the ranks' Service, no metrics ports.
        control = gw["control_port"]
        gports = {p.get("name"): p["containerPort"] for p in g["container"].get("ports", [])}
        rank_services = {str(e["values"].get("gateway", "")).split(".")[0].split(":")[0]
                         for e in self.containers if e["binary"] == "moe-rank"}
        metrics = {int(dc.flag_value(self.bindir, "moe-gateway", g["values"], "metrics-port"))}
        for name, svc in services.items():
            for p in svc["spec"].get("ports", []):
                target = p.get("targetPort", p["port"])
                target = gports.get(target, target) if isinstance(target, str) else target
                if not self.selects(svc, g["workload"]):
                    continue
                if target == control:
                    f.check(name in rank_services, f"Service {name}: carries the gateway's control port {control}, "
                            "but the ranks do not use it (keep the control port on the ranks' Service only)")
                elif name in rank_services:
                    f.add(f"Service {name}: the ranks' control Service also carries port {p['port']} "
                          f"(container port {target}); give it only the control port")
                if target in metrics:
                    f.add(f"Service {name}: carries the metrics port {target}; Prometheus scrapes the pods on the "
                          "pod network")

    @staticmethod
    def selects(svc, workload):
        sel = svc["spec"].get("selector") or {}
        labels = workload["spec"]["template"]["metadata"].get("labels") or {}
        return bool(sel) and all(labels.get(k) == v for k, v in sel.items())

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

    def analyze(self):
        """Every check; failures collect in self.f (check_readme.py reuses the analysis)."""
        self.load()
        self.gateway_checkpoint = None
        self.containers = []
        self.stub_env = {}
        self.tls_names = set()
        self.secret_keys = {}
        self.check_structure()
        # Gateways first: ranks inherit the gateway's checkpoint path.
        self.check_workloads()
        self.check_services()
        self.check_trust({d["metadata"]["name"]: d for _, d in self.of_kind("Service")})
        self.executed = 0
        self.execute_rank_wrappers()

    def run(self):
        self.analyze()
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
