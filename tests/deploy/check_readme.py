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
    title are mentioned.

usage: check_readme.py [--bin-dir DIR] [--source-dir DIR]
"""

import json
import re
import shlex
import sys
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


def main():
    _, source, bindir = dc.parse_check_args()
    f = dc.Failures("check_readme")
    text = section(source / "README.md", "Deployment")
    if text is None:
        f.add('README.md has no "## Deployment" section')
        f.finish("")

    # Paths.
    paths = set(re.findall(r"(?<![\w/.])((?:deploy|docker|tests/deploy|scripts)/[\w./-]*[\w/])", text))
    for p in sorted(paths):
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
                f.check((source / words[words.index("-f") + 1]).is_file(), f"code block: no {line}")
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
    gw_cmd = " ".join(dc.as_argv(gpu["gateway"]["command"]))
    f.check(rows.get("gateway") and gw_cmd in code(rows["gateway"][2]),
            f"compose table: gateway command should read `{gw_cmd}`")
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
    env = gpu["gateway"].get("environment") or {}
    for var in sorted(set(k for k in env if k.startswith(("NCCL_", "CUDA_")))
                      | set(k for k in configmap["data"] if k.startswith(("NCCL_", "CUDA_")))):
        row = nccl_rows.get(var)
        if not f.check(row is not None, f"NCCL table: no row for {var}"):
            continue
        f.check(code(row[1]) == [str(env.get(var))], f"NCCL table: {var} compose value {code(row[1])}, file has "
                f"{env.get(var)}")
        f.check(code(row[2]) == [str(configmap["data"].get(var))], f"NCCL table: {var} Kubernetes value "
                f"{code(row[2])}, ConfigMap has {configmap['data'].get(var)}")

    # Variables, alerts, dashboard.
    for file in ("compose.yaml", "compose.cpu.yaml"):
        for var in sorted(set(re.findall(r"\$\{([A-Z_][A-Z0-9_]*)", (source / "deploy" / file).read_text()))):
            f.check(var in text, f"{file} reads ${{{var}}}, the README does not mention it")
    alerts = yaml.safe_load((source / "deploy" / "prometheus" / "alerts.yml").read_text())
    names = {r["alert"] for g in alerts["groups"] for r in g["rules"] if "alert" in r}
    mentioned = set(re.findall(r"\bMoe[A-Z]\w+", text))
    f.check(names == mentioned, f"alerts in alerts.yml {sorted(names)}, in the README {sorted(mentioned)}")
    title = json.loads((source / "deploy" / "grafana" / "dashboards" / "moe.json").read_text())["title"]
    f.check(f'"{title}"' in text, f'the dashboard is called "{title}"')
    f.finish(f"{len(paths)} paths, {commands} commands and flags, compose and NCCL tables, variables, "
             f"{len(names)} alerts agree with the files")


if __name__ == "__main__":
    try:
        main()
    except dc.CheckFailed as e:
        print(f"check_readme: FAIL: {e}", file=sys.stderr)
        sys.exit(1)
