"""Helpers shared by the tests/deploy checks: the binaries' real flags (parsed from --help),
argument lists and shell snippets checked against them, and compose files as compose resolves
them. Python 3 standard library + python3-yaml only."""

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

SOURCE_DIR = Path(__file__).resolve().parents[2]

# The binaries the images ship (docker/Dockerfile*, runtime stage).
BINARIES = ("moe-gateway", "moe-rank", "moe-client", "moe-ckpt", "moe-forward", "moe-cluster")
CLIENT_COMMANDS = ("forward", "health", "info", "load", "placement", "balance", "set-bias")
# Scripts the images ship next to the binaries (docker/).
SCRIPTS = ("moe-rank-probe",)


class CheckFailed(Exception):
    pass


class Failures:
    """Collects failures so one run reports all of them."""

    def __init__(self, name):
        self.name = name
        self.items = []

    def add(self, message):
        self.items.append(message)

    def check(self, condition, message):
        if not condition:
            self.add(message)
        return condition

    def finish(self, ok_message):
        if self.items:
            for item in self.items:
                print(f"{self.name}: FAIL: {item}", file=sys.stderr)
            print(f"{self.name}: {len(self.items)} failure(s)", file=sys.stderr)
            sys.exit(1)
        print(f"{self.name}: OK: {ok_message}")
        sys.exit(0)


def bin_dir(explicit=None):
    d = explicit or os.environ.get("MOE_BIN_DIR") or str(SOURCE_DIR / "build" / "bin")
    return Path(d).resolve()


def parse_check_args(add_arguments=None):
    """The command line every check shares (--bin-dir, --source-dir, plus what `add_arguments`
    adds to the parser); returns (args, source directory, binary directory)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--bin-dir", default=None)
    parser.add_argument("--source-dir", default=str(SOURCE_DIR))
    if add_arguments:
        add_arguments(parser)
    args = parser.parse_args()
    return args, Path(args.source_dir), bin_dir(args.bin_dir)


# ---- flags from --help --------------------------------------------------------------------------

class FlagSpec:
    def __init__(self, name, takes_value, required=False, default=None):
        self.name = name
        self.takes_value = takes_value
        self.required = required
        self.default = default


_HELP_CACHE = {}


def binary_flags(bindir, binary, subcommand=None):
    """{name: FlagSpec} of `binary [subcommand] --help`. Two help formats exist: core/flags.h
    ("flags:" section, booleans show "(default true|false)") and moe-ckpt's ("options:" section,
    value flags show an upper-case metavariable)."""
    key = (str(bindir), binary, subcommand)
    if key in _HELP_CACHE:
        return _HELP_CACHE[key]
    exe = Path(bindir) / binary
    if not exe.is_file():
        raise CheckFailed(f"{exe} does not exist (build the binaries first)")
    argv = [str(exe)] + ([subcommand] if subcommand else []) + ["--help"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise CheckFailed(f"{' '.join(argv)} exited {out.returncode}: {out.stderr.strip()}")
    flags = {}
    section = None
    for line in out.stdout.splitlines():
        if re.match(r"^(flags|options):\s*$", line):
            section = line.strip().rstrip(":")
            continue
        m = re.match(r"^\s+--([a-z0-9][a-z0-9-]*)(.*)$", line)
        if not m or section is None:
            continue
        name, rest = m.group(1), m.group(2)
        if section == "options":
            # "  --seed N                 random seed": one space, then the metavariable.
            takes_value = re.match(r"^ [A-Z][A-Z0-9_]*(\s|$)", rest) is not None
            default = None
        else:
            d = re.search(r"\(default ([^)]*)\)\s*$", rest)
            default = d.group(1) if d else None
            takes_value = default not in ("true", "false")
        flags[name] = FlagSpec(name, takes_value, "(required)" in rest, default)
    if not flags:
        raise CheckFailed(f"no flags parsed from {' '.join(argv)}")
    # Flags only the usage line names (moe-ckpt's --preset and --out): value flags, required
    # unless bracketed.
    usage = next((l for l in out.stdout.splitlines() if l.startswith("usage:")), "")
    depth = 0
    for token in re.findall(r"\[|\]|--[a-z0-9][a-z0-9-]*|[^\s\[\]]+", usage):
        if token == "[":
            depth += 1
        elif token == "]":
            depth -= 1
        elif token.startswith("--") and token[2:] not in flags:
            flags[token[2:]] = FlagSpec(token[2:], True, required=depth == 0)
    _HELP_CACHE[key] = flags
    return flags


def parse_argv(bindir, argv):
    """Checks one command line of a project binary against its --help. Returns
    (binary, subcommand, {flag: value}); raises CheckFailed with every problem found.
    Values may be placeholders ($VAR, $(VAR), ${VAR}); they are kept as written."""
    if not argv:
        raise CheckFailed("empty command")
    binary = os.path.basename(argv[0])
    if binary not in BINARIES:
        raise CheckFailed(f"'{argv[0]}' is not one of the image's binaries {BINARIES}")
    args = list(argv[1:])
    sub = None
    if binary == "moe-client":
        if not args or args[0] not in CLIENT_COMMANDS:
            raise CheckFailed(f"moe-client needs a command {CLIENT_COMMANDS}: {argv}")
        sub = args.pop(0)
    if args and args[0] in ("--help", "-h"):
        binary_flags(bindir, binary, sub)  # the binary exists and prints its usage
        return binary, sub, {"help": "true"}
    passthrough = []
    if binary == "moe-cluster" and "--" in args:
        i = args.index("--")
        args, passthrough = args[:i], args[i + 1:]
    specs = binary_flags(bindir, binary, sub)
    values = {}
    problems = []
    i = 0
    while i < len(args):
        a = args[i]
        if not a.startswith("--"):
            problems.append(f"unexpected positional argument '{a}'")
            i += 1
            continue
        name, eq, value = a[2:].partition("=")
        spec = specs.get(name)
        if spec is None:
            problems.append(f"unknown flag --{name}")
            i += 1
            continue
        if spec.takes_value and not eq:
            if i + 1 >= len(args) or (args[i + 1].startswith("--") and args[i + 1] != "--"):
                problems.append(f"--{name} needs a value")
                i += 1
                continue
            value = args[i + 1]
            i += 1
        elif not spec.takes_value and not eq:
            value = "true"
        if name in values:
            problems.append(f"--{name} given twice")
        values[name] = value
        i += 1
    for name, spec in specs.items():
        if spec.required and name not in values:
            problems.append(f"required flag --{name} missing")
    if passthrough:
        try:
            parse_argv(bindir, ["moe-gateway", "--checkpoint", "x"] + passthrough)
        except CheckFailed as e:
            problems.append(f"moe-cluster pass-through gateway flags: {e}")
    if problems:
        raise CheckFailed(f"{' '.join(argv)}: " + "; ".join(problems))
    return binary, sub, values


def flag_value(bindir, binary, values, name, subcommand=None):
    """The value a flag has: as given, else the --help default."""
    if name in values:
        return values[name]
    spec = binary_flags(bindir, binary, subcommand).get(name)
    return spec.default if spec else None


def strip_init(argv):
    """Drops an init wrapper (`tini --`) in front of a command."""
    argv = list(argv)
    if argv and os.path.basename(argv[0]) in ("tini", "tini-static", "docker-init"):
        argv = argv[1:]
        if argv and argv[0] == "--":
            argv = argv[1:]
    return argv


_SHELL_SPLIT = re.compile(r"\|\||&&|[|;\n]")


def _command_substitutions(script):
    """(script with each $(...) command substitution replaced by a placeholder word, [inner
    scripts]); $((...)) arithmetic is left alone."""
    out, inner, i = [], [], 0
    while i < len(script):
        if script.startswith("$(", i) and not script.startswith("$((", i):
            depth, j = 0, i + 1
            while j < len(script):
                if script[j] == "(":
                    depth += 1
                elif script[j] == ")":
                    depth -= 1
                    if depth == 0:
                        break
                j += 1
            inner.append(script[i + 2:j])
            out.append("__SUBSTITUTION__")
            i = j + 1
        else:
            out.append(script[i])
            i += 1
    return "".join(out), inner


def commands_in_shell(script):
    """Command lines of project binaries and scripts inside a shell snippet (sh -c "..."),
    including those in $(...) substitutions: splits on newlines, pipes, && / || and ;, drops
    `exec` and leading VAR=value words; backslash-newline continues a line."""
    script = re.sub(r"\\\n", " ", script)
    script, inner = _command_substitutions(script)
    found = []
    for sub in inner:
        found += commands_in_shell(sub)
    for part in _SHELL_SPLIT.split(script):
        part = part.strip()
        if not part or part.startswith("#"):
            continue
        try:
            words = shlex.split(part, comments=True)
        except ValueError as e:
            raise CheckFailed(f"cannot parse shell '{part}': {e}")
        while words and (words[0] == "exec" or re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0])):
            words = words[1:]
        if words and (os.path.basename(words[0]) in BINARIES or os.path.basename(words[0]) in SCRIPTS):
            found.append(words)
    return found


def port_for_ordinal(value, ordinal, script=None):
    """A port argument of a StatefulSet pod's command for pod ordinal `ordinal`: a number, or
    shell arithmetic "$((9500 + ordinal))" over ${POD_NAME##*-} and variables the script sets from
    it (ordinal="${POD_NAME##*-}"). Only + - * and parentheses."""
    value = value.strip()
    m = re.fullmatch(r"\$\(\((.*)\)\)", value)
    if not m:
        if not re.fullmatch(r"-?[0-9]+", value):
            raise CheckFailed(f"cannot evaluate port '{value}'")
        return int(value)
    expr = m.group(1).replace("${POD_NAME##*-}", str(ordinal))
    for var in re.findall(r"([A-Za-z_][A-Za-z0-9_]*)=\"?\$\{POD_NAME##\*-\}\"?", script or ""):
        expr = re.sub(rf"\$?\{{?\b{var}\b\}}?", str(ordinal), expr)
    if not re.fullmatch(r"[0-9+\-* ()]+", expr):
        raise CheckFailed(f"cannot evaluate port '{value}'")
    return int(eval(expr, {"__builtins__": {}}))  # digits, + - * ( ) only


def k8s_overlays(source):
    """Kustomize overlays of deploy/k8s: the other directories of deploy/ with a kustomization.yaml
    (kustomize refuses an overlay inside its base's directory)."""
    base = Path(source) / "deploy" / "k8s"
    return sorted(p.parent for p in (Path(source) / "deploy").glob("*/kustomization.y*ml") if p.parent != base)


def shell_script_of(argv):
    """The script of `sh -c SCRIPT` / `bash -c SCRIPT` (after an init wrapper), else None."""
    argv = strip_init(argv)
    if len(argv) >= 3 and os.path.basename(argv[0]) in ("sh", "bash") and argv[1] == "-c":
        return argv[2]
    return None


# ---- compose ------------------------------------------------------------------------------------

def compose_command():
    """docker-compose (v1, Debian's) or `docker compose` (v2) if that is what exists."""
    explicit = os.environ.get("DOCKER_COMPOSE")
    if explicit:
        return shlex.split(explicit)
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    raise CheckFailed("docker-compose not found (scripts/install-deps.sh installs it)")


def compose_config(compose_file, env=None):
    """The file as compose resolves it (`config`: variables interpolated, YAML anchors and merge
    keys expanded, relative paths made absolute). Works offline, without a Docker engine."""
    full_env = dict(os.environ)
    full_env.pop("DOCKER_HOST", None)
    full_env.update(env or {})
    out = subprocess.run(compose_command() + ["-f", str(compose_file), "config"], capture_output=True,
                         text=True, env=full_env, timeout=120)
    if out.returncode != 0:
        raise CheckFailed(f"compose config {compose_file} failed: {out.stderr.strip()}")
    return yaml.safe_load(out.stdout)


def as_argv(value):
    """compose command/entrypoint: a list, or a string compose splits like a shell."""
    if value is None:
        return []
    if isinstance(value, str):
        return shlex.split(value)
    return [str(v) for v in value]


def parse_volume(entry, compose_dir):
    """(source, target, read_only, kind) of a compose volume entry, short or long syntax;
    kind is "bind" (source: absolute host path) or "volume" (source: volume name)."""
    if isinstance(entry, dict):
        source = entry.get("source", "")
        target = entry["target"]
        read_only = bool(entry.get("read_only", False))
        kind = entry.get("type", "volume")
    else:
        parts = entry.split(":")
        if len(parts) == 1:
            return None, parts[0], False, "volume"
        source, target = parts[0], parts[1]
        mode = parts[2] if len(parts) > 2 else "rw"
        read_only = "ro" in mode.split(",")
        kind = "bind" if source.startswith(("/", ".", "~")) else "volume"
    if kind == "bind" and not os.path.isabs(source):
        source = os.path.normpath(os.path.join(compose_dir, source))
    return source, target, read_only, kind


def parse_port_binding(entry):
    """(host address or None = every interface, published, target) of a compose port entry."""
    if isinstance(entry, dict):
        published = entry.get("published")
        return (entry.get("host_ip") or None, str(published) if published is not None else None,
                int(entry["target"]))
    text = str(entry).split("/")[0]
    parts = text.rsplit(":", 2)
    if len(parts) == 3:
        return parts[0].strip("[]") or None, parts[1], int(parts[2])
    if len(parts) == 2:
        return None, parts[0], int(parts[1])
    return None, None, int(parts[0])


def compose_secret_mounts(spec, config):
    """[(container path, host file, secret name)] of a compose service's `secrets:` (short or
    long syntax; a relative target is under /run/secrets). Compose mounts them read-only."""
    out = []
    for entry in spec.get("secrets") or []:
        if isinstance(entry, str):
            source, target = entry, None
        else:
            source, target = entry["source"], entry.get("target")
        target = target or source
        path = target if target.startswith("/") else f"/run/secrets/{target}"
        secret = (config.get("secrets") or {}).get(source)
        if secret is None:
            raise CheckFailed(f"secret {source} is not defined in the file's top-level `secrets:`")
        out.append((path, secret.get("file"), source))
    return out


# ---- trust boundaries ---------------------------------------------------------------------------

# Flags that name a credential file (a certificate, key, CA or token).
CREDENTIAL_FLAGS = ("tls-cert", "tls-key", "tls-ca", "cluster-token-file", "api-token-file",
                    "admin-token-file", "token-file")


def gateway_security(bindir, values):
    """What a moe-gateway command line enforces: {tls, mtls, token, insecure, port, control_port}."""
    return {
        "tls": bool(values.get("tls-cert")),
        "mtls": bool(values.get("tls-ca")),
        "token": values.get("cluster-token-file") or None,
        "insecure": values.get("insecure-cluster", "false") == "true",
        "port": int(flag_value(bindir, "moe-gateway", values, "port")),
        "control_port": int(flag_value(bindir, "moe-gateway", values, "control-port")),
    }


def tls_client_problems(gw, values, what):
    """Problems of a client (moe-rank, moe-client) talking to a gateway with `gw`'s security."""
    problems = []
    uses_tls = any(values.get(f) for f in ("tls-ca", "tls-cert", "tls-key")) or values.get("tls") == "true"
    if gw["tls"] and not uses_tls:
        problems.append(f"{what} connects in plaintext to a TLS gateway (give --tls-ca)")
    if gw["tls"] and not values.get("tls-ca") and values.get("tls") != "true":
        problems.append(f"{what} does not say which CA to trust (--tls-ca)")
    if not gw["tls"] and uses_tls:
        problems.append(f"{what} speaks TLS to a plaintext gateway")
    if gw["mtls"] and not (values.get("tls-cert") and values.get("tls-key")):
        problems.append(f"{what} presents no client certificate to an mTLS gateway (--tls-cert/--tls-key)")
    return problems


def rank_auth_problems(gw, values, what):
    """Problems of a rank registering with a gateway of `gw`'s security (credentials only; that
    the files are the same is for the caller to check)."""
    problems = []
    if gw["insecure"]:
        problems.append("the gateway runs --insecure-cluster: anything that reaches the control port can "
                        "register as a rank")
    if not gw["token"] and not gw["mtls"]:
        problems.append("the gateway authenticates no rank (neither --cluster-token-file nor --tls-ca)")
    if gw["token"] and not values.get("cluster-token-file"):
        problems.append(f"{what} presents no cluster token (--cluster-token-file), the gateway requires one")
    return problems + tls_client_problems(gw, values, what)


def parse_port(entry):
    """(published, target) of a compose port entry, short or long syntax."""
    if isinstance(entry, dict):
        return (str(entry.get("published")) if entry.get("published") is not None else None,
                int(entry["target"]))
    text = str(entry).split("/")[0]
    parts = text.split(":")
    if len(parts) == 1:
        return None, int(parts[0])
    return parts[-2], int(parts[-1])


def dockerfile_instructions(path):
    """[(INSTRUCTION, arguments)] of a Dockerfile, continuation lines joined, comments dropped."""
    lines = Path(path).read_text().splitlines()
    out = []
    current = ""
    for line in lines:
        stripped = line.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        if current and stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        current += stripped
        word, _, rest = current.partition(" ")
        out.append((word.upper(), rest.strip()))
        current = ""
    if current:
        word, _, rest = current.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def exec_form(text):
    """The JSON array of an exec-form instruction (ENTRYPOINT ["a", "b"]), or None."""
    text = text.strip()
    if text.startswith("["):
        import json
        return json.loads(text)
    return None
