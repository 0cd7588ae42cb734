#!/usr/bin/python3
"""Offline validation of deploy/k8s (no cluster, no kubeconform: Debian 12 has none).

Structure: every document has a known apiVersion/kind, a DNS-1123 name, no namespace other than
the kustomization's, and only fields of the Kubernetes API for the objects used (catches typos
such as `readinessprobe`); the kustomization lists exactly the manifests of the directory.

Semantics:
  - container commands (the image's ENTRYPOINT/CMD from docker/Dockerfile, then command/args,
    $(VAR) expanded from the ConfigMap and env, `sh -c` scripts split into commands) run the
    image's binaries with flags their --help knows, values where needed, required flags present;
  - exec probes likewise; every gateway and rank container has three probes, each with its own
    meaning (check_probe_roles): startup and liveness ask /healthz, readiness /readyz, through an
    httpGet probe on the port the process serves /metrics on (the kubelet connects to the pod IP,
    so that port must listen there) or moe-rank-probe [--live] PORT; the startup probe allows at
    least STARTUP_BUDGET_S, the liveness probe less and without initialDelaySeconds; a gRPC probe
    port is the gateway's --port;
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
    certificate); the gateway serves TLS, so no kubelet gRPC probe (plaintext) on it, and a
    moe-client of an exec probe verifies it with --tls-ca under a name of the gateway's Service;
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
    metrics port it serves, on the host the rank binds (MOE_METRICS_HOST); an httpGet probe's port is
    the one each pod serves.

Overlays (the other directories of deploy/ with a kustomization.yaml, e.g. deploy/k8s-lws; kustomize
refuses one inside deploy/k8s) are checked the same way, as kustomize builds them: the base's
objects minus those its `$patch: delete` patches delete (which must exist), plus its own
manifests; where kustomize or kubectl is installed, its build must have the same objects, all in
one namespace. The overlay's kustomization lists the base and exactly its directory's manifests,
with the base's namespace, labels and images. A LeaderWorkerSet (leaderworkerset.x-k8s.io/v1,
LWS 0.9: the fields, required fields and enumerations of its CRD) is checked like the StatefulSet,
its workerTemplate (and leaderTemplate) as pod templates, plus: one workload runs the ranks;
replicas 1 and size = --ranks = MOE_RANKS (one group is the pool); restartPolicy None;
startupPolicy LeaderCreated; maxSurge 0; no Service of its own pods, nor objects named like those
the controller creates; the rank id comes from LWS_WORKER_INDEX (not the pod name or hostname),
and the wrapper, run for worker indices 0, 1 and size-1 with the variables the controller sets,
runs moe-rank --rank <index>, and refuses to start without LWS_WORKER_INDEX; on the pod network
/metrics is the declared containerPort `metrics` on the pod IP.

usage: check_k8s.py [--bin-dir DIR] [--source-dir DIR]
"""

import os
import re
import shlex
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
    ("kustomize.config.k8s.io/v1beta1", "Kustomization"), ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"),
}
WORKLOADS = ("Deployment", "StatefulSet", "LeaderWorkerSet")

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
    "httpGet": {"path", "port", "host", "scheme", "httpHeaders"},
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
    "kustomizePatch": {"patch", "path", "target", "options"},
    # leaderworkerset.x-k8s.io/v1 as LWS 0.9 defines it (kubernetes-sigs/lws v0.9.0,
    # api/leaderworkerset/v1/leaderworkerset_types.go and config/crd/bases/).
    "LeaderWorkerSet.spec": {"replicas", "leaderWorkerTemplate", "rolloutStrategy", "startupPolicy", "networkConfig"},
    "leaderWorkerTemplate": {"leaderTemplate", "workerTemplate", "size", "restartPolicy", "subGroupPolicy",
                             "volumeClaimTemplates", "persistentVolumeClaimRetentionPolicy"},
    "rolloutStrategy": {"type", "rollingUpdateConfiguration"},
    "rollingUpdateConfiguration": {"partition", "maxUnavailable", "maxSurge"},
    "subGroupPolicy": {"subGroupPolicyType", "subGroupSize"},
    "networkConfig": {"subdomainPolicy"},
}
# Required fields and enumerations (the CRD's `required` and kubebuilder Enum markers) of the
# FIELDS entries that have them.
REQUIRED = {"LeaderWorkerSet.spec": {"leaderWorkerTemplate"}, "leaderWorkerTemplate": {"workerTemplate"},
            "rolloutStrategy": {"type"}, "networkConfig": {"subdomainPolicy"}}
ENUMS = {
    ("LeaderWorkerSet.spec", "startupPolicy"): {"LeaderCreated", "LeaderReady"},
    ("leaderWorkerTemplate", "restartPolicy"): {"Default", "RecreateGroupOnPodRestart", "RecreateGroupAfterStart",
                                                "None"},
    ("rolloutStrategy", "type"): {"RollingUpdate"},
    ("networkConfig", "subdomainPolicy"): {"Shared", "UniquePerReplica"},
    ("subGroupPolicy", "subGroupPolicyType"): {"LeaderWorker", "LeaderExcluded"},
}
DNS1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
# An LWS names its headless Service after itself: a DNS-1035 label (the LWS webhook checks it).
DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
# Environment variables the LWS controller sets in every container of its pods (LWS 0.9:
# pkg/utils/pod/pod_utils.go AddLWSVariables), replacing any of the same name in the template.
LWS_ENV = ("LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE", "LWS_WORKER_INDEX")
# The startup probe of a rank allows at least this long (seconds) before its liveness probe takes
# over, like the gateway's.
STARTUP_BUDGET_S = 600


class PrefixedFailures(dc.Failures):
    """Failures of one variant (an overlay), reported through the main check's list."""

    def __init__(self, parent, prefix):
        super().__init__(parent.name)
        self.parent = parent
        self.prefix = prefix

    def add(self, message):
        self.parent.add(f"{self.prefix}{message}")


def workload_templates(w):
    """[(role, pod template)] of a workload: a Deployment's or StatefulSet's `template`; a
    LeaderWorkerSet's workerTemplate and leaderTemplate (without one the leader runs the
    workerTemplate)."""
    spec = w.get("spec") or {}
    if w.get("kind") == "LeaderWorkerSet":
        lwt = spec.get("leaderWorkerTemplate") or {}
        return [(role, lwt[role]) for role in ("workerTemplate", "leaderTemplate") if isinstance(lwt.get(role), dict)]
    return [("template", spec.get("template") or {})]


def template_labels(template):
    return (template.get("metadata") or {}).get("labels") or {}


def pod_count(w):
    """Pods of a workload: replicas; a LeaderWorkerSet's replicas (groups) x size."""
    spec = w.get("spec") or {}
    replicas = int(spec.get("replicas", 1))
    if w.get("kind") == "LeaderWorkerSet":
        return replicas * int((spec.get("leaderWorkerTemplate") or {}).get("size", 1))
    return replicas


def rank_indices(w):
    """The rank ids of a rank workload's pods: StatefulSet ordinals; LeaderWorkerSet worker indices
    (the same in every group)."""
    if w.get("kind") == "LeaderWorkerSet":
        return range(int(w["spec"]["leaderWorkerTemplate"].get("size", 1)))
    return range(pod_count(w)) if w.get("kind") == "StatefulSet" else [0]


class Checker:
    def __init__(self, source, bindir, overlay=None):
        """Checks deploy/k8s, or with `overlay` the kustomize overlay in that directory as
        `kustomize build` makes it from deploy/k8s."""
        self.source = source
        self.k8s = source / "deploy" / "k8s"
        self.overlay = overlay
        self.directory = overlay or self.k8s
        self.bindir = bindir
        self.f = dc.Failures("check_k8s")
        self.docs = []   # (file, doc)
        self.commands_checked = 0
        self.overlays = []
        self.kustomize_note = ""
        self.namespace = "default"   # kustomize's objects without one land in kubectl's (default)

    # ---- loading and structure -----------------------------------------------------------------

    def read_manifests(self, directory, prefix=""):
        docs = []
        for path in sorted(directory.glob("*.y*ml")):
            try:
                docs += [(prefix + path.name, doc) for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
            except yaml.YAMLError as e:
                self.f.add(f"{prefix}{path.name}: {e}")
        return docs

    def load(self):
        if self.overlay is None:
            self.docs = self.read_manifests(self.k8s)
            return
        self.base_docs = self.read_manifests(self.k8s)
        own = self.read_manifests(self.overlay, f"{self.overlay.name}/")
        k = next((d for _, d in own if d.get("kind") == "Kustomization"), {})
        deleted = self.delete_patches(k)
        defined = {(d.get("kind"), (d.get("metadata") or {}).get("name")) for _, d in self.base_docs
                   if d.get("kind") != "Kustomization"}
        for kind, name in sorted(deleted - defined):
            self.f.add(f"{self.overlay.name}/kustomization.yaml: a patch deletes {kind}/{name}, which {self.k8s.name}/ "
                       "does not define (kustomize: no resource matches the patch)")
        self.docs = [(f, d) for f, d in self.base_docs if d.get("kind") != "Kustomization" and
                     (d.get("kind"), (d.get("metadata") or {}).get("name")) not in deleted] + own

    def delete_patches(self, k):
        """{(kind, name)} the overlay's patches delete; any other patch is reported (the checks
        would not see its effect)."""
        deleted = set()
        for i, entry in enumerate(k.get("patches") or []):
            where = f"{self.overlay.name}/kustomization.yaml patches[{i}]"
            self.keys(entry, "kustomizePatch", where)
            text = entry.get("patch")
            if text is None and entry.get("path"):
                path = self.overlay / entry["path"]
                text = path.read_text() if path.is_file() else None
            try:
                patch = yaml.safe_load(text) if text else None
            except yaml.YAMLError as e:
                self.f.add(f"{where}: {e}")
                continue
            if not self.f.check(isinstance(patch, dict) and patch.get("$patch") == "delete",
                                f"{where}: only `$patch: delete` patches are checked here; this one is not"):
                continue
            target = entry.get("target") or {}
            kind = target.get("kind") or patch.get("kind")
            name = target.get("name") or (patch.get("metadata") or {}).get("name")
            if self.f.check(kind and name, f"{where}: names no kind and name to delete"):
                deleted.add((kind, name))
        return deleted

    def keys(self, obj, allowed, where):
        if not isinstance(obj, dict):
            self.f.add(f"{where}: expected a mapping, got {type(obj).__name__}")
            return
        for key in obj:
            self.f.check(key in FIELDS[allowed], f"{where}: unknown field '{key}'")
            values = ENUMS.get((allowed, key))
            if values is not None:
                self.f.check(obj[key] in values, f"{where}: {key} '{obj[key]}' is not one of {sorted(values)}")
        for key in sorted(REQUIRED.get(allowed, set()) - set(obj)):
            self.f.add(f"{where}: required field '{key}' missing")

    def of_kind(self, kind):
        return [(f, d) for f, d in self.docs if d.get("kind") == kind]

    def workloads(self):
        """(file, workload) in WORKLOADS order: the gateway's Deployment before the ranks."""
        return sorted(((f, d) for f, d in self.docs if d.get("kind") in WORKLOADS),
                      key=lambda fd: WORKLOADS.index(fd[1]["kind"]))

    def cross_check_kustomize(self):
        """Where kustomize (or kubectl) is installed, its build of the directory has the objects
        the checks read, each in the kustomization's namespace."""
        if shutil.which("kustomize"):
            argv = [shutil.which("kustomize"), "build"]
        elif shutil.which("kubectl"):
            argv = [shutil.which("kubectl"), "kustomize"]
        else:
            self.kustomize_note = "no kustomize or kubectl to compare the build with"
            return
        tool = " ".join([os.path.basename(argv[0])] + argv[1:])
        out = subprocess.run(argv + [str(self.directory)], capture_output=True, text=True, timeout=120)
        if not self.f.check(out.returncode == 0, f"`{tool} {self.directory.name}` failed: {out.stderr.strip()}"):
            return
        built = [d for d in yaml.safe_load_all(out.stdout) if d]
        got = sorted((d.get("kind"), d["metadata"].get("name")) for d in built)
        want = sorted((d.get("kind"), d["metadata"].get("name")) for _, d in self.docs
                      if d.get("kind") != "Kustomization")
        self.f.check(got == want, f"`{tool} {self.directory.name}` builds {got}, the checks read {want}")
        spread = {d["metadata"].get("namespace") for d in built if d["kind"] != "Namespace"}
        self.f.check(spread == {self.namespace}, f"`{tool} {self.directory.name}` puts objects in the namespaces "
                     f"{sorted(map(str, spread))}, not all in {self.namespace}")
        self.kustomize_note = f"the same objects as `{tool}`"

    def check_kustomization(self):
        kust = self.of_kind("Kustomization")
        if not self.f.check(len(kust) == 1, "expected one kustomization.yaml"):
            return False
        kfile, k = kust[0]
        self.keys(k, "Kustomization", kfile)
        self.namespace = k.get("namespace") or "default"
        self.f.check(k.get("namespace") == "moe", f"kustomization namespace is {k.get('namespace')}, expected moe")
        listed = k.get("resources", [])
        files = sorted(p.name for p in self.directory.glob("*.y*ml") if p.name != "kustomization.yaml")
        dirs = [r for r in listed if (self.directory / r).is_dir()]
        for r in listed:
            self.f.check(r in dirs or (self.directory / r).is_file(), f"kustomization lists {r}, which does not exist")
        for name in files:
            self.f.check(name in listed, f"{name} is not listed in kustomization.yaml resources")
        self.f.check(len(listed) == len(set(listed)), "kustomization lists a resource twice")
        if self.overlay is None:
            self.f.check(not dirs, f"kustomization.yaml lists directories {dirs}")
            # kustomize refuses a base that contains its overlay ("cycle detected").
            for nested in sorted(self.k8s.glob("*/kustomization.y*ml")):
                self.f.add(f"{nested.parent.name}/: an overlay inside its base is refused by kustomize (cycle "
                           f"detected): put it next to {self.k8s.name}/ (deploy/{nested.parent.name})")
            return True
        # An overlay: the base once, plus its own files; the base's namespace, labels and images
        # (kustomize applies the base's to the base's objects only).
        base = os.path.relpath(self.k8s, self.overlay)
        self.f.check([os.path.normpath(r) for r in dirs] == [base],
                     f"{kfile}: lists the directories {dirs}; expected the base {base} only")
        base_k = next((d for _, d in self.base_docs if d.get("kind") == "Kustomization"), {})
        for key in ("namespace", "labels", "images"):
            self.f.check(k.get(key) == base_k.get(key), f"{kfile}: {key} {k.get(key)} differs from the base's "
                         f"{base_k.get(key)}: the overlay's own manifests get only the overlay's")
        return True

    def check_structure(self):
        if not self.check_kustomization():
            return
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
                self.check_template_fields(spec.get("template"), f"{where} template")
            elif kind == "LeaderWorkerSet":
                self.check_lws_fields(doc, where)
            elif kind == "Service":
                self.keys(spec, "Service.spec", where)
                for p in spec.get("ports", []):
                    self.keys(p, "servicePort", f"{where} port")
            elif kind == "PersistentVolumeClaim":
                self.keys(spec, "PersistentVolumeClaim.spec", where)
            elif kind == "PodDisruptionBudget":
                self.keys(spec, "PodDisruptionBudget.spec", where)
                self.keys(spec.get("selector"), "selector", f"{where} selector")
                match = (spec.get("selector") or {}).get("matchLabels") or {}
                targets = [d for _, d in self.workloads()
                           if any(all(template_labels(t).get(k) == v for k, v in match.items())
                                  for _, t in workload_templates(d))]
                self.f.check(len(targets) == 1, f"{where}: selects {len(targets)} workloads, not one")
                if targets:
                    replicas = pod_count(targets[0])
                    self.f.check(isinstance(spec.get("minAvailable"), int) and 0 < spec["minAvailable"] < replicas,
                                 f"{where}: minAvailable {spec.get('minAvailable')} must leave room to evict one of "
                                 f"{replicas} replicas and keep one")
            elif kind == "ConfigMap":
                for key, value in (doc.get("data") or {}).items():
                    self.f.check(isinstance(value, str), f"{where}: data.{key} = {value!r} is not a string")

    def check_lws_fields(self, doc, where):
        spec = doc.get("spec")
        self.keys(spec, "LeaderWorkerSet.spec", where)
        if not isinstance(spec, dict):
            return
        name = doc["metadata"].get("name", "")
        self.f.check(bool(DNS1035.match(name)), f"{where}: the name of a LeaderWorkerSet names its headless Service: "
                     "a DNS-1035 label (a-z first, no dots)")
        for field in ("rolloutStrategy", "networkConfig"):
            if field in spec:
                self.keys(spec[field], field, f"{where} {field}")
        rolling = (spec.get("rolloutStrategy") or {}).get("rollingUpdateConfiguration")
        if rolling is not None:
            self.keys(rolling, "rollingUpdateConfiguration", f"{where} rollingUpdateConfiguration")
        lwt = spec.get("leaderWorkerTemplate") or {}
        self.keys(lwt, "leaderWorkerTemplate", f"{where} leaderWorkerTemplate")
        if "subGroupPolicy" in lwt:
            self.keys(lwt["subGroupPolicy"], "subGroupPolicy", f"{where} subGroupPolicy")
        self.f.check(isinstance(spec.get("replicas", 1), int), f"{where}: replicas is not an integer")
        self.f.check(isinstance(lwt.get("size", 1), int) and lwt.get("size", 1) >= 1,
                     f"{where}: leaderWorkerTemplate.size {lwt.get('size')} is not an integer >= 1")
        for role, template in workload_templates(doc):
            self.check_template_fields(template, f"{where} {role}")

    def check_template_fields(self, template, where):
        self.keys(template, "template", where)
        if not isinstance(template, dict):
            return
        self.keys(template.get("metadata"), "metadata", f"{where} metadata")
        pod = template.get("spec") or {}
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
                    if "httpGet" in (c[probe] or {}):
                        self.keys(c[probe]["httpGet"], "httpGet", f"{cw} {probe} httpGet")
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
        units = [(fname, w, role, t) for fname, w in self.workloads() for role, t in workload_templates(w)]
        for fname, w, role, template in units:
            kind, name = w["kind"], w["metadata"]["name"]
            where = f"{fname}: {kind}/{name}" + (f" {role}" if kind == "LeaderWorkerSet" else "")
            spec = w["spec"]
            tmpl_labels = template_labels(template)
            if kind != "LeaderWorkerSet":  # the LWS controller makes the selectors
                match = (spec.get("selector") or {}).get("matchLabels") or {}
                self.f.check(bool(match) and all(tmpl_labels.get(k) == v for k, v in match.items()),
                             f"{where}: selector {match} does not match the template labels {tmpl_labels}")
            pod = template.get("spec") or {}
            annotations = (template.get("metadata") or {}).get("annotations") or {}
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
                if host_network and kind in ("StatefulSet", "LeaderWorkerSet"):
                    self.f.check(not c.get("ports"),
                                 f"{cw}: hostNetwork replicas would share the node's ports; declare no "
                                 "containerPort (it becomes a hostPort and allows one pod per node)")
                metrics_port = values.get("metrics-port") if binary == "moe-rank" else None
                if not host_network and metrics_port not in (None, "-1"):
                    # On the pod network Prometheus scrapes the declared port (prometheus-k8s.yml).
                    self.f.check(ports.get("metrics") is not None and str(ports["metrics"]) == str(metrics_port),
                                 f"{cw}: serves /metrics on --metrics-port {metrics_port} but declares "
                                 f"containerPort metrics {ports.get('metrics')}: Prometheus scrapes the declared port")
                # Probes: three, each with its own meaning (check_probe_roles).
                modes = {}
                for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
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
                                self.check_probe_port(argv, values, script, w, f"{cw} {probe}")
                                modes[probe] = "live" if "--live" in argv[1:] else "ready"
                    if "httpGet" in p:
                        modes[probe] = self.check_http_probe(p["httpGet"], binary, values, ports, fieldrefs,
                                                             f"{cw} {probe}")
                    if "grpc" in p:
                        self.f.check(binary == "moe-gateway", f"{cw} {probe}: gRPC probe on {binary}, which "
                                     "serves no gRPC")
                        self.f.check(not values.get("tls-cert"), f"{cw} {probe}: the kubelet's gRPC probe speaks "
                                     "plaintext, the gateway serves TLS (--tls-cert): use an exec probe with "
                                     "moe-client health --tls-ca")
                        port = dc.flag_value(self.bindir, binary, values, "port")
                        self.f.check(str(p["grpc"].get("port")) == str(port),
                                     f"{cw} {probe}: gRPC probe port {p['grpc'].get('port')} but --port {port}")
                if all(probe in c for probe in ("startupProbe", "livenessProbe", "readinessProbe")):
                    self.check_probe_roles(c, modes, cw)
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
                    self.ranks.append((where, w, c, values, env, fieldrefs, script, host_network, role))
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

    def check_probe_port(self, argv, values, script, w, where):
        """moe-rank-probe [--live] PORT must read the port the rank serves /metrics on, for every
        pod ordinal (StatefulSet) or worker index (LeaderWorkerSet)."""
        ports = [a for a in argv[1:] if not a.startswith("--")]
        if not self.f.check(len(ports) == 1, f"{where}: moe-rank-probe needs the metrics port"):
            return
        served = values.get("metrics-port")
        if not self.f.check(served not in (None, "-1"), f"{where}: the rank serves no /metrics to probe"):
            return
        try:
            for i in rank_indices(w):
                probed = dc.port_for_ordinal(ports[0], i, script)
                want = dc.port_for_ordinal(served, i, script)
                if not self.f.check(probed == want, f"{where}: rank {i} probes port {probed}, serves {want}"):
                    break
        except dc.CheckFailed as e:
            self.f.add(f"{where}: {e}")

    def check_http_probe(self, http, binary, values, ports, fieldrefs, where):
        """An httpGet probe of a gateway or rank: GET /healthz or /readyz (returned as "live" or
        "ready") over plain HTTP on the port the process serves /metrics on (a number or a declared
        containerPort name), at the kubelet's default host, the pod IP, where the process must
        listen (--metrics-host the pod IP, 0.0.0.0 or ::)."""
        path = http.get("path")
        mode = {"/healthz": "live", "/readyz": "ready"}.get(path)
        self.f.check(mode is not None, f"{where}: httpGet path {path}: the metrics endpoint answers probes on "
                     "/healthz and /readyz")
        self.f.check(http.get("scheme", "HTTP") == "HTTP", f"{where}: httpGet scheme {http.get('scheme')}: "
                     "/metrics, /healthz and /readyz are plain HTTP")
        self.f.check("host" not in http, f"{where}: httpGet host {http.get('host')}: leave it out (the pod IP, "
                     "where the process listens)")
        served = dc.flag_value(self.bindir, binary, values, "metrics-port")
        port = http.get("port")
        number = ports.get(port) if isinstance(port, str) and not port.isdigit() else port
        if self.f.check(number is not None, f"{where}: httpGet port {port} is not a declared containerPort"):
            self.f.check(served not in (None, "-1") and str(number) == str(served),
                         f"{where}: httpGet port {port} ({number}), but {binary} serves /metrics on "
                         f"--metrics-port {served}")
        host = dc.flag_value(self.bindir, binary, values, "metrics-host")
        if binary == "moe-gateway" and "metrics-host" not in values:
            host = values.get("host", host)
        self.f.check(self.pod_ip_value(host, fieldrefs) or host in ("0.0.0.0", "::"),
                     f"{where}: {binary} --metrics-host {host}: the kubelet's httpGet connects to the pod IP")
        return mode

    def check_probe_roles(self, c, modes, where):
        """A gateway's or rank's startup, liveness and readiness probes, kept apart: started and
        alive = /healthz answers (httpGet, or moe-rank-probe --live; a rank registers only with a
        gateway, and a gateway is ready only with its ranks, which a restart does not bring back),
        ready = /readyz (httpGet, or moe-rank-probe: a rank registered with its experts loaded, a
        gateway SERVING); the startup probe allows a slow start, the liveness probe is tighter and
        runs only after it."""
        wanted = {"startupProbe": "live", "livenessProbe": "live", "readinessProbe": "ready"}
        runs = {"live": "/healthz (httpGet, or moe-rank-probe --live)",
                "ready": "/readyz (httpGet, or moe-rank-probe)", None: "neither /healthz nor /readyz"}
        for probe, mode in wanted.items():
            self.f.check(modes.get(probe) == mode, f"{where} {probe}: runs {runs[modes.get(probe)]}, expected "
                         f"{runs[mode]}")
        probes = [c.get(probe) or {} for probe in wanted]
        self.f.check(len({yaml.safe_dump(p, sort_keys=True) for p in probes}) == len(probes),
                     f"{where}: the startup, liveness and readiness probes must be three distinct probes")

        def budget(p):
            return (int(p.get("initialDelaySeconds", 0)) +
                    int(p.get("periodSeconds", 10)) * int(p.get("failureThreshold", 3)))
        startup, live = probes[0], probes[1]
        self.f.check(budget(startup) >= STARTUP_BUDGET_S, f"{where} startupProbe: allows {budget(startup)} s to start, "
                     f"less than {STARTUP_BUDGET_S} s")
        self.f.check(budget(live) < budget(startup), f"{where} livenessProbe: allows {budget(live)} s, not tighter "
                     f"than the startup probe's {budget(startup)} s")
        self.f.check(not live.get("initialDelaySeconds"), f"{where} livenessProbe: initialDelaySeconds "
                     f"{live.get('initialDelaySeconds')}: it runs only after the startup probe succeeded")

    def run_with_stubs(self, argv, env, where, must_fail=False):
        """Runs argv (an sh -c wrapper) under /bin/sh with stubs in place of the image's binaries
        and scripts; returns the argv lists the stubs were called with. must_fail: the command
        must exit non-zero (reported otherwise)."""
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
            if must_fail:
                self.f.check(out.returncode != 0, f"{where}: exited 0, it should fail")
            elif out.returncode != 0:
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

    def rank_pods(self, w, role):
        """(pod name, rank id, environment the controller adds) of a few pods of a rank workload:
        StatefulSet pods <name>-<ordinal> (0, 1, the last, 12 for two digits); LeaderWorkerSet
        pods of group 0, the leader <name>-0 (worker index 0) and workers <name>-0-<index> (1, the
        last), each with the LWS_* variables; a leaderTemplate runs only the leader."""
        name = w["metadata"]["name"]
        if w["kind"] != "LeaderWorkerSet":
            return [(f"{name}-{i}", i, {}) for i in sorted({0, 1, pod_count(w) - 1, 12})]
        size = int(w["spec"]["leaderWorkerTemplate"].get("size", 1))
        has_leader = "leaderTemplate" in w["spec"]["leaderWorkerTemplate"]
        indices = [0] if role == "leaderTemplate" else sorted({1, size - 1} | (set() if has_leader else {0}))
        return [(f"{name}-0" + (f"-{i}" if i else ""), i,
                 {"LWS_LEADER_ADDRESS": f"{name}-0.{name}.{self.namespace}", "LWS_GROUP_SIZE": str(size),
                  "LWS_WORKER_INDEX": str(i)}) for i in indices if 0 <= i < size]

    def execute_rank_wrappers(self):
        """Runs each rank container's command and exec probes with /bin/sh for a few pods (stubbed
        binaries): the rank id and the metrics port each pod really gets. A LeaderWorkerSet's
        wrapper must also refuse to start without LWS_WORKER_INDEX."""
        for where, w, c, values, env, fieldrefs, script, host_network, role in self.ranks:
            if script is None:
                continue
            argv = c.get("command", []) + c.get("args", [])
            if w["kind"] == "LeaderWorkerSet":
                calls = self.run_with_stubs([self.expand_k8s(a, env) for a in argv], env,
                                            f"{where}: the rank wrapper run without LWS_WORKER_INDEX", must_fail=True)
                for call in calls:
                    if call[0] == "moe-rank":
                        self.f.add(f"{where}: without LWS_WORKER_INDEX the wrapper still runs {shlex.join(call)} "
                                   "(use ${LWS_WORKER_INDEX:?...})")
            for pod_name, ordinal, controller_env in self.rank_pods(w, role):
                pod_env = dict(env)
                pod_ip = f"10.0.7.{ordinal + 1}"
                for var, path in fieldrefs.items():
                    if path == "metadata.name":
                        pod_env[var] = pod_name
                    elif path == "status.podIP":
                        pod_env[var] = pod_ip
                pod_env.update(controller_env)
                calls = self.run_with_stubs([self.expand_k8s(a, pod_env) for a in argv], pod_env,
                                            f"{where} pod {pod_name}")
                ranks = [call for call in calls if call[0] == "moe-rank"]
                if not self.f.check(len(ranks) == 1, f"{where} pod {pod_name}: ran {calls}"):
                    continue
                try:
                    _, _, got = dc.parse_argv(self.bindir, ranks[0])
                except dc.CheckFailed as e:
                    self.f.add(f"{where} pod {pod_name}: {e}")
                    continue
                self.f.check(got.get("rank") == str(ordinal),
                             f"{where} pod {pod_name}: runs --rank {got.get('rank')}, expected {ordinal}")
                port = got.get("metrics-port")
                metrics_host = dc.flag_value(self.bindir, "moe-rank", got, "metrics-host")
                if host_network:
                    self.f.check(metrics_host == pod_ip, f"{where} pod {pod_name}: --metrics-host "
                                 f"{metrics_host}, the pod IP is {pod_ip}")
                elif port not in (None, "-1"):
                    self.f.check(metrics_host in (pod_ip, "0.0.0.0", "::"), f"{where} pod {pod_name}: "
                                 f"--metrics-host {metrics_host}: Prometheus scrapes the pod IP {pod_ip}")
                for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                    p = c.get(probe) or {}
                    if "httpGet" in p:
                        declared = {cp.get("name"): cp["containerPort"] for cp in c.get("ports", [])}
                        hp = p["httpGet"].get("port")
                        number = declared.get(hp) if isinstance(hp, str) and not hp.isdigit() else hp
                        self.f.check(str(number) == str(port), f"{where} {probe} pod {pod_name}: httpGet port "
                                     f"{hp} ({number}), the rank serves /metrics on {port}")
                    if "exec" not in p:
                        continue
                    for call in self.run_with_stubs(p["exec"]["command"], pod_env, f"{where} {probe} pod {pod_name}"):
                        if call[0] == "moe-rank-probe":
                            probed = [a for a in call[1:] if not a.startswith("--")]
                            self.f.check(probed == [port], f"{where} {probe} pod {pod_name}: probes "
                                         f"{probed}, the rank serves /metrics on {port}")
                            # moe-rank-probe reads $MOE_METRICS_HOST, else 127.0.0.1 (0.0.0.0: loopback).
                            probed_host = self.stub_env.get(id(call)) or "127.0.0.1"
                            want = "127.0.0.1" if metrics_host in ("0.0.0.0", None) else metrics_host
                            self.f.check(probed_host.replace("0.0.0.0", "127.0.0.1") == want,
                                         f"{where} {probe} pod {pod_name}: moe-rank-probe reads "
                                         f"{probed_host}, the rank serves /metrics on {metrics_host}")
                self.executed += 1

    def check_gateway_and_ranks(self, services):
        if not self.f.check(self.gateway is not None, "no workload runs moe-gateway"):
            return
        gwhere, gw, gc, gvalues, gports, genv = self.gateway
        if not self.f.check(bool(self.ranks), "no workload runs moe-rank"):
            return
        gw_port = int(dc.flag_value(self.bindir, "moe-gateway", gvalues, "control-port"))
        workloads = {id(w): where for where, w, *_ in self.ranks}
        self.f.check(len(workloads) == 1, f"{len(workloads)} workloads run moe-rank ({', '.join(workloads.values())}): "
                     "their pods would claim the same rank ids at the same gateways")
        for where, w, c, values, env, fieldrefs, script, host_network, role in self.ranks:
            lws = w["kind"] == "LeaderWorkerSet"
            pods = pod_count(w)
            self.f.check(w["kind"] in ("StatefulSet", "LeaderWorkerSet"),
                         f"{where}: ranks need stable identities: a StatefulSet or a LeaderWorkerSet")
            self.f.check(str(gvalues.get("ranks")) == str(pods),
                         f"{where}: {pods} {'pods' if lws else 'replicas'}, but the gateway waits for --ranks "
                         f"{gvalues.get('ranks')}")
            if lws:
                self.check_lws_ranks(w, c, where)
            res = (c.get("resources") or {}).get("limits") or {}
            self.f.check(str(res.get("nvidia.com/gpu")) == "1", f"{where}: each rank should hold one GPU")
            # Rank id from the pod ordinal, or the LWS worker index.
            rank_value = str(values.get("rank", ""))
            if self.f.check(rank_value not in ("", "-1"), f"{where}: --rank is not set from the pod "
                            f"{'worker index' if lws else 'ordinal'}"):
                if script and lws:
                    self.f.check(re.search(r"\$\{?LWS_WORKER_INDEX\b", script) is not None,
                                 f"{where}: the rank id does not come from LWS_WORKER_INDEX (set by the LWS "
                                 "controller)")
                    names = [n for n, path in fieldrefs.items() if path == "metadata.name"]
                    self.f.check(not any(re.search(rf"\$\{{?{n}\b", script) for n in names) and
                                 not re.search(r"\bhostname\b|\$\{?HOSTNAME", script),
                                 f"{where}: the rank id must not be parsed from the pod name or hostname: the "
                                 "leader's is <lws>-<group>, its worker index is LWS_WORKER_INDEX")
                elif script:
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
                    self.f.check(self.selects(svc, gw), f"{where}: Service {svc_name} does not select the gateway pods")
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
            # Headless governing Service (an LWS makes its own); no other Service of the ranks.
            for svc_name, svc in sorted(services.items()):
                self.f.check(not self.selects(svc, w) or (not lws and svc_name == w["spec"].get("serviceName")),
                             f"{where}: Service {svc_name} selects the rank pods but governs no StatefulSet of them"
                             + (f" (the LWS controller makes the Service {w['metadata']['name']})" if lws else ""))
            governing = services.get(w["spec"].get("serviceName"))
            if not lws and self.f.check(governing is not None,
                                        f"{where}: serviceName {w['spec'].get('serviceName')} undefined"):
                self.f.check(governing["spec"].get("clusterIP") == "None",
                             f"{where}: the governing Service must be headless (clusterIP: None)")
        cms = self.of_kind("ConfigMap")
        for _, cm in cms:
            data = cm.get("data") or {}
            if "MOE_RANKS" in data:
                for where, w, *_ in self.ranks:
                    self.f.check(data["MOE_RANKS"] == str(pod_count(w)),
                                 f"ConfigMap MOE_RANKS {data['MOE_RANKS']} differs from {where}'s {pod_count(w)} pods")

    def check_lws_ranks(self, w, c, where):
        """The rank pool as a LeaderWorkerSet: one group of MOE_RANKS pods that is never recreated
        as a whole, never doubled, and names no object of its own that the manifests define."""
        spec = w["spec"]
        lwt = spec["leaderWorkerTemplate"]
        replicas, size, name = int(spec.get("replicas", 1)), int(lwt.get("size", 1)), w["metadata"]["name"]
        self.f.check(replicas == 1, f"{where}: replicas {replicas}: every group's pods claim rank ids 0..{size - 1} "
                     "at the same gateways; the pool is one group of size = --ranks")
        policy = lwt.get("restartPolicy", "RecreateGroupOnPodRestart")
        self.f.check(policy == "None", f"{where}: restartPolicy {policy}: a failed rank must be restarted alone "
                     "(None; it re-registers, the gateways fail only its steps meanwhile), not the whole pool")
        self.f.check(spec.get("startupPolicy", "LeaderCreated") == "LeaderCreated",
                     f"{where}: startupPolicy {spec.get('startupPolicy')}: the ranks register independently; "
                     "LeaderCreated starts the workers with the leader")
        rolling = (spec.get("rolloutStrategy") or {}).get("rollingUpdateConfiguration") or {}
        surge, unavailable = str(rolling.get("maxSurge", 0)), str(rolling.get("maxUnavailable", 1))
        self.f.check(surge in ("0", "0%"), f"{where}: maxSurge {surge}: a surge group would claim the same rank ids")
        self.f.check(unavailable not in ("0", "0%"), f"{where}: maxUnavailable {unavailable} with maxSurge 0: "
                     "the LWS webhook refuses it")
        controller_env = [e.get("name") for e in c.get("env", []) if e.get("name") in LWS_ENV]
        self.f.check(not controller_env, f"{where}: sets {controller_env}, which the LWS controller replaces")
        # The controller creates the headless Service <name> and StatefulSets <name>, <name>-<group>.
        made = {("Service", name), ("StatefulSet", name)} | {("StatefulSet", f"{name}-{g}") for g in range(replicas)}
        for kind, other in sorted(made):
            self.f.check(not any(d["metadata"].get("name") == other for _, d in self.of_kind(kind)),
                         f"{where}: the LWS controller creates {kind} {other}, which the manifests also define")
        last = f"{name}-{replicas - 1}-{size - 1}"
        self.f.check(len(last) <= 63, f"{where}: pod name {last} is longer than a hostname label (63)")

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
    def selected_templates(svc, workload):
        """The pod templates of the workload that the Service selects."""
        sel = svc["spec"].get("selector") or {}
        return [t for _, t in workload_templates(workload)
                if sel and all(template_labels(t).get(k) == v for k, v in sel.items())]

    @classmethod
    def selects(cls, svc, workload):
        return bool(cls.selected_templates(svc, workload))

    def check_services(self):
        for fname, svc in self.of_kind("Service"):
            where = f"{fname}: Service/{svc['metadata']['name']}"
            sel = svc["spec"].get("selector") or {}
            templates = [t for _, w in self.workloads() for t in self.selected_templates(svc, w)]
            self.f.check(bool(templates), f"{where}: selector {sel} matches no workload")
            headless = svc["spec"].get("clusterIP") == "None"
            self.f.check(headless or bool(svc["spec"].get("ports")), f"{where}: no ports")
            for p in svc["spec"].get("ports", []):
                target = p.get("targetPort", p["port"])
                declared = {(cp.get("name"), cp["containerPort"]) for t in templates
                            for c in (t.get("spec") or {}).get("containers", []) for cp in c.get("ports", [])}
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
        self.cross_check_kustomize()
        if self.overlay is not None:
            return
        # The overlays, as kustomize builds them; check_readme.py sees their Secrets and names too.
        for directory in dc.k8s_overlays(self.source):
            overlay = Checker(self.source, self.bindir, directory)
            overlay.f = PrefixedFailures(self.f, f"{directory.name}: ")
            overlay.analyze()
            self.overlays.append(overlay)
            for key, flags in overlay.secret_keys.items():
                self.secret_keys.setdefault(key, set()).update(flags)
            self.tls_names |= overlay.tls_names

    def summary(self):
        kinds = sorted({f"{d.get('kind')}" for _, d in self.docs})
        return (f"{len(self.docs)} documents ({', '.join(kinds)}); {self.commands_checked} command lines checked "
                f"against the binaries' --help; rank wrapper and probes run under /bin/sh for {self.executed} pod "
                f"names; {self.kustomize_note}")

    def run(self):
        self.analyze()
        self.f.finish("; ".join([f"{self.directory.name}/: {self.summary()}"] +
                                [f"overlay {o.directory.name}/: {o.summary()}" for o in self.overlays]))


def main():
    _, source, bindir = dc.parse_check_args()
    try:
        Checker(source, bindir).run()
    except dc.CheckFailed as e:
        print(f"check_k8s: FAIL: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
