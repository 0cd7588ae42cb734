#!/usr/bin/python3
"""README.md "## Deployment" matches the deployment files.

  - every repository path it names (deploy/..., docker/..., tests/deploy/..., scripts/...) exists,
    and its Kubernetes file table lists exactly the files of deploy/k8s;
  - every project command in its code blocks parses against the binary's --help, and every
    `--flag` in inline code exists for the binary it follows;
  - the compose service table shows the gateway's and the ranks' commands exactly as
    deploy/compose.yaml resolves them (rank id as `i`), and the CPU section the `ckpt` command of
    compose.cpu.yaml;
  - the NCCL table has every NCCL_* / CUDA_* variable the compose file and the ConfigMap set, with
    their values;
  - every variable the compose files interpolate, every alert of alerts.yml and the dashboard's
    title are mentioned;
  - secrets: the `scripts/make-certs.sh DIR` of the compose steps is where the compose files read
    their secrets by default; paths under a make-certs.sh DIR are files it writes (they need not
    exist in the tree); the `kubectl create secret` commands run in the kustomization's namespace,
    after the namespace exists and before `kubectl apply -k`, and create every Secret key the
    manifests read (per check_k8s.py's analysis), each from the make-certs.sh file of its kind
    (--tls-cert: a certificate, --tls-key: its key, --tls-ca: ca.pem, token files: the token);
    and the certificate made with the README's NAMEs carries every name the manifests' clients
    verify (openssl -checkhost).

usage: check_readme.py [--bin-dir DIR] [--source-dir DIR]
"""

import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import deploy_common as dc  # noqa: E402


def section(readme, title):
    text = readme.read_text()
    m = re.search(rf"^## {re.escape(title)}\s*$(.*?)(?=^## |\Z)", text, re.S | re.M)
    return m.group(1) if m else None


def table_rows(text, header_start):
    """Rows (lists of cells) of the markdown table whose header row starts with header_start."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("| " + header_start):
            rows = []
            for row in lines[i + 2:]:
                if not row.startswith("|"):
                    break
                rows.append([c.strip() for c in row.strip().strip("|").split("|")])
            return rows
    return []


def code(cell):
    return re.findall(r"`([^`]+)`", cell)


# What each file of make-certs.sh may be given as.
FILE_KINDS = {"ca.pem": {"tls-ca"}, "cluster-token": {"cluster-token-file", "api-token-file", "admin-token-file",
                                                      "token-file"}}
for _name in ("gateway", "rank", "client"):
    FILE_KINDS[f"{_name}.pem"] = {"tls-cert"}
    FILE_KINDS[f"{_name}.key"] = {"tls-key"}


def check_kubernetes_secrets(f, source, bindir, lines, certs, written):
    """The README's kubectl commands create the Secrets deploy/k8s mounts, from the right files."""
    import check_k8s
    k8s = check_k8s.Checker(source, bindir)
    k8s.f = dc.Failures("check_k8s (from check_readme)")  # its own failures are check_k8s.py's to report
    k8s.analyze()
    created = {}   # (secret, key) -> file path
    order = []     # ("namespace" | "secret" | "apply"), in README order
    for line in lines:
        words = shlex.split(line) if line else []
        if words[:1] != ["kubectl"]:
            continue
        ns = None
        for i, w in enumerate(words):
            if w in ("-n", "--namespace") and i + 1 < len(words):
                ns = words[i + 1]
            elif w.startswith("--namespace="):
                ns = w.partition("=")[2]
        if "create" in words and "secret" in words:
            i = words.index("secret")
            name = words[i + 2] if i + 2 < len(words) else ""
            f.check(words[i + 1:i + 2] == ["generic"], f"`{line}`: expected `kubectl create secret generic NAME`")
            f.check(ns == k8s.namespace, f"`{line}`: namespace {ns}, the manifests' is {k8s.namespace}")
            for w in words:
                if w.startswith("--from-file="):
                    key, _, path = w[len("--from-file="):].partition("=")
                    created[(name, key)] = path
            order.append("secret")
        elif "apply" in words and "-k" in words:
            order.append("apply")
        elif ("apply" in words and any(w.endswith("namespace.yaml") for w in words)) or "namespace" in words[1:3]:
            order.append("namespace")
    if not f.check("secret" in order, "no `kubectl create secret` command for the Kubernetes Secrets"):
        return
    f.check("namespace" in order and order.index("namespace") < order.index("secret"),
            "the Kubernetes steps create the Secrets before the namespace exists")
    f.check("apply" in order and order.index("apply") > max(i for i, o in enumerate(order) if o == "secret"),
            "the Kubernetes steps should create the Secrets before `kubectl apply -k` (the pods need them)")
    uses = k8s.secret_keys
    f.check(bool(uses), "check_k8s found no Secret keys the manifests read")
    cert_file = None
    for (secret, key), flags in sorted(uses.items()):
        path = created.get((secret, key))
        if not f.check(path is not None, f"the manifests read key {key} of Secret {secret} (as --{'/--'.join(sorted(flags))}),"
                       " which no `kubectl create secret` command of the README creates"):
            continue
        made = next((d for d, _ in certs if path.startswith(d + "/")), None)
        base = os.path.basename(path)
        if not f.check(made is not None and base in written, f"Secret {secret} key {key} comes from {path}, not a "
                       "file scripts/make-certs.sh writes"):
            continue
        f.check(flags <= FILE_KINDS.get(base, set()), f"Secret {secret} key {key} is read as --{'/--'.join(sorted(flags))} "
                f"but holds {base}")
        if "tls-cert" in flags:
            cert_file = (made, base)
    for (secret, key) in created:
        f.check((secret, key) in uses, f"the README creates key {key} of Secret {secret}, which no manifest reads")
    if cert_file is None or not k8s.tls_names:
        return
    made, base = cert_file
    names = next(n for d, n in certs if d == made)
    with tempfile.TemporaryDirectory(prefix="moe-readme-k8s-certs-") as tmp:
        out = subprocess.run(["bash", str(source / "scripts" / "make-certs.sh"), tmp] + names, capture_output=True,
                             text=True, timeout=120)
        if not f.check(out.returncode == 0, f"scripts/make-certs.sh {made} {' '.join(names)} failed: {out.stderr}"):
            return
        for name in sorted(k8s.tls_names):
            check = "-checkip" if re.fullmatch(r"[0-9.]+|[0-9a-fA-F:]+", name) else "-checkhost"
            r = subprocess.run(["openssl", "x509", "-in", str(Path(tmp) / base), "-noout", check, name],
                               capture_output=True, text=True)
            f.check(r.returncode == 0 and "does match" in r.stdout,
                    f"Kubernetes clients verify the gateway as {name}, which the certificate of "
                    f"`scripts/make-certs.sh {made} {' '.join(names)}` does not carry")


def main():
    _, source, bindir = dc.parse_check_args()
    f = dc.Failures("check_readme")
    text = section(source / "README.md", "Deployment")
    if text is None:
        f.add('README.md has no "## Deployment" section')
        f.finish("")

    # make-certs.sh runs in code blocks: (DIR, NAMEs); what it writes.
    blocks = re.findall(r"```(?:bash|sh)?\n(.*?)```", text, re.S)
    block_lines = [re.sub(r"\s+#.*$", "", l).strip() for b in blocks for l in b.splitlines()]
    certs = []
    for line in block_lines:
        words = shlex.split(line) if line else []
        for i, w in enumerate(words):
            if w.endswith("scripts/make-certs.sh"):
                rest = words[i + 1:]
                if rest[:1] == ["--owner"]:
                    rest = rest[2:]
                if f.check(bool(rest), f"code block: `{line}` gives make-certs.sh no DIR"):
                    certs.append((rest[0].rstrip("/"), rest[1:]))
    with tempfile.TemporaryDirectory(prefix="moe-readme-certs-") as tmp:
        out = subprocess.run(["bash", str(source / "scripts" / "make-certs.sh"), tmp], capture_output=True, text=True,
                             timeout=120)
        f.check(out.returncode == 0, f"scripts/make-certs.sh failed: {out.stderr.strip()}")
        written = {p.name for p in Path(tmp).iterdir()}

    # Paths.
    paths = set(re.findall(r"(?<![\w/.])((?:deploy|docker|tests/deploy|scripts)/[\w./-]*[\w/])", text))
    for p in sorted(paths):
        made = next((d for d, _ in certs if p == d or p.startswith(d + "/")), None)
        if made is not None:
            f.check(p == made or p[len(made) + 1:] in written,
                    f"names {p}, which scripts/make-certs.sh {made} does not write ({sorted(written)})")
            continue
        f.check((source / p).exists(), f"names {p}, which does not exist")
    k8s_rows = table_rows(text, "file | what")
    listed = {code(r[0])[0] for r in k8s_rows if code(r[0])}
    actual = {p.name for p in (source / "deploy" / "k8s").glob("*.y*ml")}
    f.check(listed == actual, f"Kubernetes file table lists {sorted(listed)}, deploy/k8s has {sorted(actual)}")

    # Commands in code blocks and inline code.
    commands = 0
    for block in re.findall(r"```(?:bash|sh)?\n(.*?)```", text, re.S):
        for line in block.splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            for argv in dc.commands_in_shell(line):
                if argv[0] in dc.SCRIPTS:
                    continue
                try:
                    dc.parse_argv(bindir, argv)
                    commands += 1
                except dc.CheckFailed as e:
                    f.add(f"code block: {e}")
            words = shlex.split(line) if line else []
            if "docker" in words[:1] and "compose" in words and "-f" in words:
                compose_file = source / words[words.index("-f") + 1]
                if f.check(compose_file.is_file(), f"code block: no {line}"):
                    # `exec SERVICE ...` / `run --rm SERVICE ...` name a service of that file.
                    verb = next((w for w in words if w in ("exec", "run")), None)
                    if verb:
                        rest = [w for w in words[words.index(verb) + 1:] if not w.startswith("-")]
                        services = dc.compose_config(compose_file)["services"]
                        f.check(bool(rest) and rest[0] in services, f"code block: {line}: "
                                f"{rest[0] if rest else 'no service'} is not a service of {compose_file.name}")
            if words[:2] == ["docker", "build"]:
                f.check((source / words[words.index("-f") + 1]).is_file(), f"code block: no Dockerfile in {line}")
    for snippet in re.findall(r"`([^`\n]+)`", text):
        words = snippet.split()
        for i, w in enumerate(words):
            if w not in dc.BINARIES:
                continue
            sub = words[i + 1] if w == "moe-client" and i + 1 < len(words) and words[i + 1] in dc.CLIENT_COMMANDS \
                else None
            if w == "moe-client" and sub is None:
                f.check(not any(x.startswith("--") for x in words[i + 1:]), f"`{snippet}`: moe-client needs a command")
                continue
            flags = dc.binary_flags(bindir, w, sub)
            for flag in words[i + 1:]:
                if flag in dc.BINARIES:
                    break
                if flag.startswith("--"):
                    name = flag[2:].split("=")[0]
                    f.check(name in flags or name == "help", f"`{snippet}`: {w} has no flag --{name}")
                    commands += 1

    # The compose table against compose.yaml.
    gpu = dc.compose_config(source / "deploy" / "compose.yaml")["services"]
    rows = {code(r[0])[0]: r for r in table_rows(text, "service | GPU") if code(r[0])}
    gw_cmd = " ".join(dc.as_argv(gpu["gateway-0"]["command"]))
    f.check(rows.get("gateway-0") and gw_cmd in code(rows["gateway-0"][2]),
            f"compose table: gateway-0 command should read `{gw_cmd}`")
    ranks = sorted(n for n in gpu if n.startswith("rank-"))
    rank_row = next((r for k, r in rows.items() if k.startswith("rank-0")), None)
    if f.check(rank_row is not None, "compose table: no rank-0 .. row"):
        f.check(code(rank_row[0])[-1] == ranks[-1], f"compose table: ranks end at {code(rank_row[0])[-1]}, the file "
                f"at {ranks[-1]}")
        for name in ranks:
            i = name.split("-")[1]
            cmd = " ".join(dc.as_argv(gpu[name]["command"]))
            shown = [c.replace(" i ", f" {i} ") for c in code(rank_row[2])]
            f.check(cmd in shown, f"compose table: {name} runs `{cmd}`, the README shows {code(rank_row[2])}")
    cpu = dc.compose_config(source / "deploy" / "compose.cpu.yaml")["services"]
    ckpt = " ".join(dc.as_argv(cpu["ckpt"]["command"]))
    f.check(f"`{ckpt}`" in text, f"CPU section should show the ckpt command `{ckpt}`")

    # NCCL table against compose.yaml and the ConfigMap.
    nccl_rows = {code(r[0])[0]: r for r in table_rows(text, "variable | compose") if code(r[0])}
    configmap = next(d for d in yaml.safe_load_all((source / "deploy" / "k8s" / "configmap.yaml").read_text()) if d)
    env = gpu["gateway-0"].get("environment") or {}
    for var in sorted(set(k for k in env if k.startswith(("NCCL_", "CUDA_")))
                      | set(k for k in configmap["data"] if k.startswith(("NCCL_", "CUDA_")))):
        row = nccl_rows.get(var)
        if not f.check(row is not None, f"NCCL table: no row for {var}"):
            continue
        f.check(code(row[1]) == [str(env.get(var))], f"NCCL table: {var} compose value {code(row[1])}, file has "
                f"{env.get(var)}")
        f.check(code(row[2]) == [str(configmap["data"].get(var))], f"NCCL table: {var} Kubernetes value "
                f"{code(row[2])}, ConfigMap has {configmap['data'].get(var)}")

    # Secrets: compose.
    cert_dirs = {d for d, _ in certs}
    for file in ("compose.yaml", "compose.cpu.yaml"):
        config = dc.compose_config(source / "deploy" / file)
        dirs = {os.path.relpath(os.path.dirname(s["file"]), source) for s in (config.get("secrets") or {}).values()}
        f.check(len(dirs) == 1 and dirs <= cert_dirs, f"{file} reads its secrets from {sorted(dirs)} by default; "
                f"the README makes them in {sorted(cert_dirs)}")
    check_kubernetes_secrets(f, source, bindir, block_lines, certs, written)

    # Variables, alerts, dashboard.
    for file in ("compose.yaml", "compose.cpu.yaml"):
        for var in sorted(set(re.findall(r"\$\{([A-Z_][A-Z0-9_]*)", (source / "deploy" / file).read_text()))):
            f.check(var in text, f"{file} reads ${{{var}}}, the README does not mention it")
    alerts = yaml.safe_load((source / "deploy" / "prometheus" / "alerts.yml").read_text())
    names = {r["alert"] for g in alerts["groups"] for r in g["rules"] if "alert" in r}
    # Moe* words that are not alerts: the gRPC services of proto/ (MoeService, MoeDiagnostics).
    services = {s for proto in (source / "proto").rglob("*.proto")
                for s in re.findall(r"^service (\w+)", proto.read_text(), re.M)}
    mentioned = set(re.findall(r"\bMoe[A-Z]\w+", text)) - services
    f.check(names == mentioned, f"alerts in alerts.yml {sorted(names)}, in the README {sorted(mentioned)}")
    title = json.loads((source / "deploy" / "grafana" / "dashboards" / "moe.json").read_text())["title"]
    f.check(f'"{title}"' in text, f'the dashboard is called "{title}"')
    f.finish(f"{len(paths)} paths, {commands} commands and flags, compose and NCCL tables, variables, "
             f"{len(names)} alerts, secrets and the Kubernetes secret commands agree with the files")


if __name__ == "__main__":
    try:
        main()
    except dc.CheckFailed as e:
        print(f"check_readme: FAIL: {e}", file=sys.stderr)
        sys.exit(1)
