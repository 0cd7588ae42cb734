#!/usr/bin/python3
"""The README and the docs pages match the deployment files and the binaries.

docs/DEPLOYMENT.md:
  - its Kubernetes file table lists exactly the files of deploy/k8s;
  - the compose service table shows the gateway's and the ranks' commands exactly as
    deploy/compose.yaml resolves them (rank id as `i`), and the CPU section the `ckpt` command of
    compose.cpu.yaml;
  - the NCCL table has every NCCL_* / CUDA_* variable the compose file and the ConfigMap set, with
    their values;
  - every variable the compose files interpolate is mentioned;
  - secrets: the `scripts/make-certs.sh DIR` of the compose steps is where the compose files read
    their secrets by default; the `kubectl create secret` commands run in the kustomization's
    namespace, after the namespace exists and before `kubectl apply -k`, and create every Secret
    key the manifests read (per check_k8s.py's analysis), each from the make-certs.sh file of its
    kind (--tls-cert: a certificate, --tls-key: its key, --tls-ca: ca.pem, token files: the
    token); and the certificate made with the page's NAMEs carries every name the manifests'
    clients verify (openssl -checkhost).
docs/OBSERVABILITY.md: names exactly the alerts of alerts.yml, and the dashboard's title.

README.md and every docs page this project writes for users (PAGES):
  - every repository path it names (deploy/..., docker/..., scripts/..., tests/..., any top-level
    directory of the tree; {a,b} alternatives expanded) exists; paths under a make-certs.sh DIR of
    the same page are files it writes (they need not exist in the tree);
  - every project command in its bash code blocks parses against the binary's --help, every
    `docker compose -f FILE exec|run SERVICE` names a service of FILE, every `docker build -f`
    a Dockerfile; every `--flag` in inline code (and in the usage lines of its plain code blocks)
    exists for the binary it follows (moe-bench and moe-client per subcommand);
  - it names no Moe* word that is neither an alert of alerts.yml, a gRPC service of proto/ nor a
    class of the clients.

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
    """The kubectl commands of docs/DEPLOYMENT.md create the Secrets deploy/k8s mounts, from the right files."""
    import check_k8s
    k8s = check_k8s.Checker(source, bindir)
    k8s.f = dc.Failures("check_k8s (from check_readme)")  # its own failures are check_k8s.py's to report
    k8s.analyze()
    created = {}   # (secret, key) -> file path
    order = []     # ("namespace" | "secret" | "apply"), in page order
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
                       " which no `kubectl create secret` command of docs/DEPLOYMENT.md creates"):
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
        f.check((secret, key) in uses, f"docs/DEPLOYMENT.md creates key {key} of Secret {secret}, which no manifest reads")
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


# The pages checked for paths, commands and flags: the README and the docs pages written for users
# (docs/ARCHITECTURE.md, FUZZING.md and gpu-results.md are design notes and procedures).
PAGES = ("README.md", "docs/DEPLOYMENT.md", "docs/CLI.md", "docs/CLIENTS.md", "docs/OBSERVABILITY.md",
         "docs/SECURITY.md", "docs/MODELS.md", "docs/PERFORMANCE.md", "docs/TESTING.md")
DEPLOYMENT = "docs/DEPLOYMENT.md"
OBSERVABILITY = "docs/OBSERVABILITY.md"
# Binaries whose flags inline code may name, with their subcommands (flags are per subcommand).
DOC_BINARIES = dc.BINARIES + ("moe-bench",)
SUBCOMMANDS = {"moe-client": dc.CLIENT_COMMANDS, "moe-bench": ("layer", "kernels", "roofline")}
SHELL_LANGS = ("bash", "sh", "shell")


def fenced_blocks(text):
    """[(info string, body)] of the ``` fenced code blocks of a markdown text."""
    blocks, lang, body = [], None, []
    for line in text.splitlines():
        m = re.match(r"^\s*```\s*([\w+-]*)", line)
        if lang is None and m:
            lang, body = m.group(1), []
        elif lang is not None and re.match(r"^\s*```\s*$", line):
            blocks.append((lang, "\n".join(body) + "\n"))
            lang = None
        elif lang is not None:
            body.append(line)
    return blocks


def without_blocks(text):
    """The text with its fenced code blocks removed (inline code and prose only)."""
    out, inside = [], False
    for line in text.splitlines():
        if re.match(r"^\s*```", line):
            inside = not inside
            continue
        if not inside:
            out.append(line)
    return "\n".join(out)


def shell_lines(text):
    """Command lines of the page's shell code blocks: continuations joined, comments, trailing `&`
    and here-document bodies dropped."""
    lines = []
    for lang, body in fenced_blocks(text):
        if lang not in SHELL_LANGS:
            continue
        heredoc = None
        for line in re.sub(r"\\\n", " ", body).splitlines():
            if heredoc is not None:
                if line.strip() == heredoc:
                    heredoc = None
                continue
            m = re.search(r"<<-?\s*['\"]?(\w+)['\"]?", line)
            if m:
                heredoc = m.group(1)
            line = re.sub(r"\s+#.*$", "", line).strip()
            line = re.sub(r"\s*&\s*$", "", line)
            if line and not line.startswith("#"):
                lines.append(line)
    return lines


def make_certs_runs(f, where, lines):
    """(DIR, [NAME...]) of every scripts/make-certs.sh run in the lines."""
    certs = []
    for line in lines:
        words = shlex.split(line) if line else []
        for i, w in enumerate(words):
            if w.endswith("scripts/make-certs.sh"):
                rest = words[i + 1:]
                if rest[:1] == ["--owner"]:
                    rest = rest[2:]
                if f.check(bool(rest), f"{where}: code block: `{line}` gives make-certs.sh no DIR"):
                    certs.append((rest[0].rstrip("/"), rest[1:]))
    return certs


def expand_braces(path):
    """docs/bench/{k3,k2}-x.json -> [docs/bench/k3-x.json, docs/bench/k2-x.json]."""
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [q for alt in m.group(1).split(",") for q in expand_braces(path[:m.start()] + alt + path[m.end():])]


def check_paths(f, source, where, text, certs, written):
    """Every path under a top-level directory of the tree that the page names exists."""
    tops = sorted((p.name for p in source.iterdir() if p.is_dir() and not p.name.startswith(".")
                   and not p.name.startswith("build") and p.name != "out"), key=len, reverse=True)
    pattern = rf"(?<![\w/.{{}}-])((?:{'|'.join(map(re.escape, tops))})/[\w./{{}},-]*[\w/}}])"
    paths = set()
    for raw in re.findall(pattern, text):
        paths.update(expand_braces(raw.rstrip(".,")))
    for p in sorted(paths):
        made = next((d for d, _ in certs if p == d or p.startswith(d + "/")), None)
        if made is not None:
            f.check(p == made or p[len(made) + 1:] in written,
                    f"{where} names {p}, which scripts/make-certs.sh {made} does not write ({sorted(written)})")
            continue
        f.check((source / p).exists(), f"{where} names {p}, which does not exist")
    return len(paths)


def check_flag_words(f, bindir, where, snippet, words):
    """`binary [subcommand] --flag ...` in inline code or a usage line: every --flag exists."""
    count = 0
    for i, w in enumerate(words):
        if w not in DOC_BINARIES:
            continue
        subs = SUBCOMMANDS.get(w)
        rest = words[i + 1:]
        for j, x in enumerate(rest):
            if x in DOC_BINARIES:
                rest = rest[:j]
                break
        flags = [x.strip("[]()|,;") for x in rest]
        flags = [x for x in flags if x.startswith("--") and len(x) > 2]
        chosen = None
        if subs:
            alternatives = rest[0].strip("[]()").split("|") if rest else []
            if alternatives and all(a in subs for a in alternatives):
                chosen = alternatives
            else:
                f.check(all(x == "--help" for x in flags), f"{where}: `{snippet}`: {w} needs a command {subs}")
                continue
        for sub in chosen or [None]:
            try:
                known = dc.binary_flags(bindir, w, sub)
            except dc.CheckFailed as e:
                f.add(f"{where}: `{snippet}`: {e}")
                continue
            for flag in flags:
                name = flag[2:].split("=")[0]
                f.check(name in known or name in ("help", "helpfull", "version", "flagfile"),
                        f"{where}: `{snippet}`: {w}{' ' + sub if sub else ''} has no flag --{name}")
                count += 1
    return count


def check_commands(f, source, bindir, where, text, lines):
    """Shell blocks parse against the binaries' --help; inline code and usage lines name real flags."""
    commands = 0
    for line in lines:
        try:
            argvs = dc.commands_in_shell(line)
        except dc.CheckFailed as e:
            f.add(f"{where}: code block: {e}")
            continue
        for argv in argvs:
            if argv[0] in dc.SCRIPTS:
                continue
            try:
                dc.parse_argv(bindir, argv)
                commands += 1
            except dc.CheckFailed as e:
                f.add(f"{where}: code block: {e}")
        words = shlex.split(line) if line else []
        if words[:1] == ["sudo"]:
            words = words[1:]
        if "docker" in words[:1] and "compose" in words and "-f" in words:
            compose_file = source / words[words.index("-f") + 1]
            if f.check(compose_file.is_file(), f"{where}: code block: no {line}"):
                # `exec SERVICE ...` / `run --rm SERVICE ...` name a service of that file.
                verb = next((w for w in words if w in ("exec", "run")), None)
                if verb:
                    rest = [w for w in words[words.index(verb) + 1:] if not w.startswith("-")]
                    services = dc.compose_config(compose_file)["services"]
                    f.check(bool(rest) and rest[0] in services, f"{where}: code block: {line}: "
                            f"{rest[0] if rest else 'no service'} is not a service of {compose_file.name}")
        if words[:2] == ["docker", "build"]:
            f.check((source / words[words.index("-f") + 1]).is_file(), f"{where}: code block: no Dockerfile in {line}")
    for lang, body in fenced_blocks(text):
        if lang in ("", "text"):
            for line in body.splitlines():
                words = line.split()
                if words and words[0] in DOC_BINARIES:
                    commands += check_flag_words(f, bindir, where, line.strip(), words)
    for snippet in re.findall(r"`([^`\n]+)`", without_blocks(text)):
        commands += check_flag_words(f, bindir, where, snippet, snippet.split())
    return commands


def check_deployment(f, source, bindir, text, lines, certs, written):
    """docs/DEPLOYMENT.md against deploy/: tables, compose commands, NCCL, secrets, variables."""
    k8s_rows = table_rows(text, "file | what")
    listed = {code(r[0])[0] for r in k8s_rows if code(r[0])}
    actual = {p.name for p in (source / "deploy" / "k8s").glob("*.y*ml")}
    f.check(listed == actual, f"{DEPLOYMENT}: Kubernetes file table lists {sorted(listed)}, deploy/k8s has {sorted(actual)}")

    # The compose table against compose.yaml.
    gpu = dc.compose_config(source / "deploy" / "compose.yaml")["services"]
    rows = {code(r[0])[0]: r for r in table_rows(text, "service | GPU") if code(r[0])}
    gw_cmd = " ".join(dc.as_argv(gpu["gateway-0"]["command"]))
    f.check(rows.get("gateway-0") and gw_cmd in code(rows["gateway-0"][2]),
            f"{DEPLOYMENT}: compose table: gateway-0 command should read `{gw_cmd}`")
    ranks = sorted(n for n in gpu if n.startswith("rank-"))
    rank_row = next((r for k, r in rows.items() if k.startswith("rank-0")), None)
    if f.check(rank_row is not None, f"{DEPLOYMENT}: compose table: no rank-0 .. row"):
        f.check(code(rank_row[0])[-1] == ranks[-1], f"{DEPLOYMENT}: compose table: ranks end at "
                f"{code(rank_row[0])[-1]}, the file at {ranks[-1]}")
        for name in ranks:
            i = name.split("-")[1]
            cmd = " ".join(dc.as_argv(gpu[name]["command"]))
            shown = [c.replace(" i ", f" {i} ") for c in code(rank_row[2])]
            f.check(cmd in shown, f"{DEPLOYMENT}: compose table: {name} runs `{cmd}`, the page shows {code(rank_row[2])}")
    cpu = dc.compose_config(source / "deploy" / "compose.cpu.yaml")["services"]
    ckpt = " ".join(dc.as_argv(cpu["ckpt"]["command"]))
    f.check(f"`{ckpt}`" in text, f"{DEPLOYMENT}: the CPU section should show the ckpt command `{ckpt}`")

    # NCCL table against compose.yaml and the ConfigMap.
    nccl_rows = {code(r[0])[0]: r for r in table_rows(text, "variable | compose") if code(r[0])}
    configmap = next(d for d in yaml.safe_load_all((source / "deploy" / "k8s" / "configmap.yaml").read_text()) if d)
    env = gpu["gateway-0"].get("environment") or {}
    for var in sorted(set(k for k in env if k.startswith(("NCCL_", "CUDA_")))
                      | set(k for k in configmap["data"] if k.startswith(("NCCL_", "CUDA_")))):
        row = nccl_rows.get(var)
        if not f.check(row is not None, f"{DEPLOYMENT}: NCCL table: no row for {var}"):
            continue
        f.check(code(row[1]) == [str(env.get(var))], f"{DEPLOYMENT}: NCCL table: {var} compose value {code(row[1])}, "
                f"file has {env.get(var)}")
        f.check(code(row[2]) == [str(configmap["data"].get(var))], f"{DEPLOYMENT}: NCCL table: {var} Kubernetes "
                f"value {code(row[2])}, ConfigMap has {configmap['data'].get(var)}")

    # Secrets: compose.
    cert_dirs = {d for d, _ in certs}
    for file in ("compose.yaml", "compose.cpu.yaml"):
        config = dc.compose_config(source / "deploy" / file)
        dirs = {os.path.relpath(os.path.dirname(s["file"]), source) for s in (config.get("secrets") or {}).values()}
        f.check(len(dirs) == 1 and dirs <= cert_dirs, f"{file} reads its secrets from {sorted(dirs)} by default; "
                f"{DEPLOYMENT} makes them in {sorted(cert_dirs)}")
    check_kubernetes_secrets(f, source, bindir, lines, certs, written)

    # Variables.
    for file in ("compose.yaml", "compose.cpu.yaml"):
        for var in sorted(set(re.findall(r"\$\{([A-Z_][A-Z0-9_]*)", (source / "deploy" / file).read_text()))):
            f.check(var in text, f"{file} reads ${{{var}}}, {DEPLOYMENT} does not mention it")


def main():
    _, source, bindir = dc.parse_check_args()
    f = dc.Failures("check_readme")
    texts = {}
    for page in PAGES:
        if f.check((source / page).is_file(), f"{page} does not exist"):
            texts[page] = (source / page).read_text()
    if DEPLOYMENT not in texts or OBSERVABILITY not in texts:
        f.finish("")

    # What scripts/make-certs.sh writes.
    with tempfile.TemporaryDirectory(prefix="moe-readme-certs-") as tmp:
        out = subprocess.run(["bash", str(source / "scripts" / "make-certs.sh"), tmp], capture_output=True, text=True,
                             timeout=120)
        f.check(out.returncode == 0, f"scripts/make-certs.sh failed: {out.stderr.strip()}")
        written = {p.name for p in Path(tmp).iterdir()}

    alerts = yaml.safe_load((source / "deploy" / "prometheus" / "alerts.yml").read_text())
    names = {r["alert"] for g in alerts["groups"] for r in g["rules"] if "alert" in r}
    # Moe* words that are not alerts: the gRPC services of proto/ (MoeService, MoeDiagnostics).
    services = {s for proto in (source / "proto").rglob("*.proto")
                for s in re.findall(r"^service (\w+)", proto.read_text(), re.M)}
    # ... and the clients' classes (MoeClient, MoeError).
    services |= {c for path in (source / "client").rglob("*") if path.suffix in (".h", ".py")
                 for c in re.findall(r"^\s*(?:class|struct) (Moe\w+)", path.read_text(), re.M)}

    paths = commands = 0
    for page, text in texts.items():
        lines = shell_lines(text)
        certs = make_certs_runs(f, page, lines)
        paths += check_paths(f, source, page, text, certs, written)
        commands += check_commands(f, source, bindir, page, text, lines)
        mentioned = set(re.findall(r"\bMoe[A-Z]\w+", text)) - services
        f.check(mentioned <= names, f"{page} names {sorted(mentioned - names)}, which are not alerts of alerts.yml")
        if page == DEPLOYMENT:
            check_deployment(f, source, bindir, text, lines, certs, written)

    # Alerts and the dashboard: docs/OBSERVABILITY.md.
    mentioned = set(re.findall(r"\bMoe[A-Z]\w+", texts[OBSERVABILITY])) - services
    f.check(names == mentioned, f"alerts in alerts.yml {sorted(names)}, in {OBSERVABILITY} {sorted(mentioned)}")
    title = json.loads((source / "deploy" / "grafana" / "dashboards" / "moe.json").read_text())["title"]
    f.check(f'"{title}"' in texts[OBSERVABILITY], f'{OBSERVABILITY}: the dashboard is called "{title}"')
    f.finish(f"{len(texts)} pages: {paths} paths, {commands} commands and flags; {DEPLOYMENT}: compose and NCCL "
             f"tables, variables, secrets and the Kubernetes secret commands; {OBSERVABILITY}: {len(names)} alerts "
             "and the dashboard; all agree with the files")


if __name__ == "__main__":
    try:
        main()
    except dc.CheckFailed as e:
        print(f"check_readme: FAIL: {e}", file=sys.stderr)
        sys.exit(1)
