#!/usr/bin/python3
"""Static checks of deploy/compose.yaml (8-GPU host) and deploy/compose.cpu.yaml, as compose
resolves them (`docker-compose config`, offline). compose.cpu.yaml is also run for real by
compose_cpu_test.py; compose.yaml cannot run here (no GPU, no Docker), so this is its check:

  - every service of ours runs an image binary with flags its --help knows;
  - one or more gateway services run one command (same model, ranks, transport, credentials);
    each waits for as many ranks (--ranks) as there are rank services, which claim --rank 0..N-1
    once each and whose --gateway (service names, or the alias the gateways share) reaches every
    gateway on its control port; no two services publish the same host port;
  - GPU file: the gateway and each rank reserve exactly one distinct GPU (driver nvidia,
    capabilities [gpu]); ipc: host and a shm_size; the documented NCCL_* knobs are set;
    --transport defaults to nccl and follows MOE_TRANSPORT;
  - the checkpoint is mounted read-only where --checkpoint points (ranks read the gateway's path);
  - published ports are ports the command listens on; /metrics is published on 127.0.0.1 only;
  - trust boundaries: the ranks' --gateway is the gateway service on its --control-port, which no
    service publishes; the gateway authenticates ranks (no --insecure-cluster; a cluster token
    and/or mTLS) and every rank carries that credential (the same token file, or a client
    certificate); the gateway serves TLS on its public port and every client of it (ranks, health
    checks) verifies it with --tls-ca (and brings a client certificate under mTLS);
  - secrets: every credential file (--tls-*, --*token-file) is a compose `secret` (mounted
    read-only under /run/secrets) of the service that reads it, every secret a service mounts is
    used by it (ranks never get the gateway's key), and their files lie in ${MOE_SECRETS_DIR};
    with the files of scripts/make-certs.sh there, the CA each client trusts signed the gateway's
    certificate, that certificate names the host each client connects to, and the key is the
    certificate's;
  - ranks depend on the gateway being healthy, and the health checks are the ones
    compose_cpu_test.py exercises on the CPU file (the gateway's accepts NOT_SERVING: it only turns
    SERVING after the ranks registered, so a SERVING check would deadlock);
  - the mounted Prometheus config scrapes the gateway's and every rank's --metrics-port.

usage: check_compose.py [--bin-dir DIR] [--source-dir DIR]
"""

import re
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import deploy_common as dc  # noqa: E402

NCCL_KNOBS = ("NCCL_DEBUG", "NCCL_SOCKET_IFNAME", "NCCL_IB_DISABLE", "NCCL_P2P_LEVEL", "NCCL_SHM_DISABLE",
              "NCCL_NVLS_ENABLE", "CUDA_DEVICE_MAX_CONNECTIONS")


def normalized_healthcheck(spec):
    test = (spec.get("healthcheck") or {}).get("test")
    if not test:
        return None
    text = " ".join(test) if isinstance(test, list) else test
    return re.sub(r"[0-9]+", "N", text)


class ComposeFile:
    def __init__(self, path, bindir, f, env=None, source=None):
        self.path = path
        self.bindir = bindir
        self.f = f
        self.env = dict(env or {})
        self.source = source or dc.SOURCE_DIR
        self.config = dc.compose_config(path, env)
        self.services = {}
        self.external = {}
        for name, spec in self.config["services"].items():
            image = str(spec.get("image", ""))
            if image.startswith(("docker.io/prom/prometheus", "docker.io/grafana/grafana")):
                self.external[name] = spec
                continue
            argv = dc.strip_init(dc.as_argv(spec.get("entrypoint")) + dc.as_argv(spec.get("command")))
            try:
                binary, _, values = dc.parse_argv(bindir, argv)
            except dc.CheckFailed as e:
                f.add(f"{path.name} service {name}: {e}")
                continue
            self.services[name] = (spec, binary, values)

    def listen_ports(self, name):
        spec, binary, values = self.services[name]
        ports = set()
        for flag in ("port", "control-port", "metrics-port"):
            v = dc.flag_value(self.bindir, binary, values, flag)
            if v is not None and re.fullmatch(r"[0-9]+", v) and int(v) > 0:
                ports.add(int(v))
        return ports

    def healthcheck_commands(self, name):
        """Command lines of project binaries in a service's healthcheck."""
        spec = self.services[name][0]
        test = (spec.get("healthcheck") or {}).get("test")
        if not test or test[0] == "NONE":
            return []
        if isinstance(test, str):
            test = ["CMD-SHELL", test]
        lines = dc.commands_in_shell(test[1]) if test[0] == "CMD-SHELL" else [test[1:]]
        return [l for l in lines if l and l[0] in dc.BINARIES]

    def secret_mounts(self, name):
        try:
            return dc.compose_secret_mounts(self.services[name][0], self.config)
        except dc.CheckFailed as e:
            self.f.add(f"{self.path.name} service {name}: {e}")
            return []

    def credential(self, name, path, what):
        """The host file of credential `path` in service `name`: must be one of its secrets."""
        for target, host, _ in self.secret_mounts(name):
            if path == target:
                return host
        self.f.add(f"{self.path.name} service {name}: {what} {path} is not one of the service's compose "
                   "secrets (mounted read-only under /run/secrets)")
        return None

    def of(self, binary):
        return {n: s for n, s in self.services.items() if s[1] == binary}

    def aliases(self, name):
        """The names service `name` answers to on the compose network: its own and its aliases."""
        spec = self.services[name][0] if name in self.services else self.external.get(name, {})
        networks = spec.get("networks") or {}
        names = {name}
        for net in (networks.values() if isinstance(networks, dict) else []):
            names |= set((net or {}).get("aliases") or [])
        return names

    def reached(self, host):
        """The services a client reaches at `host` (a service name or a shared alias)."""
        return {n for n in list(self.services) + list(self.external) if host in self.aliases(n)}

    def check(self, gpu):
        f, where = self.f, self.path.name
        gateways = self.of("moe-gateway")
        ranks = self.of("moe-rank")
        if not f.check(len(gateways) >= 1, f"{where}: no gateway service"):
            return
        gw_names = sorted(gateways)
        gw_name = gw_names[0]
        gw_values = gateways[gw_name][2]
        # Gateways over one rank pool run one command: the same model, ranks, transport and
        # credentials; they differ only in their container (and published ports).
        for other in gw_names[1:]:
            f.check(gateways[other][2] == gw_values, f"{where}: gateway services {gw_name} and {other} run "
                    "different commands (gateways sharing ranks must serve the same model the same way)")
        gw = dc.gateway_security(self.bindir, gw_values)
        gw_port = gw["control_port"]
        want = int(gw_values.get("ranks", "1"))
        f.check(len(ranks) == want, f"{where}: gateway --ranks {want}, {len(ranks)} rank services")
        claimed = sorted(int(v.get("rank", "-1")) for _, _, v in ranks.values())
        f.check(claimed == list(range(want)), f"{where}: ranks claim {claimed}, expected 0..{want - 1}")
        checkpoint = gw_values.get("checkpoint", "")
        published = {}
        for name, (spec, binary, values) in self.services.items():
            sw = f"{where} service {name}"
            metrics_port = dc.flag_value(self.bindir, binary, values, "metrics-port")
            for entry in spec.get("ports", []):
                host_ip, host_port, target = dc.parse_port_binding(entry)
                if host_port:
                    key = (host_ip or "0.0.0.0", host_port)
                    f.check(key not in published, f"{sw}: publishes host port {host_port}, as does "
                            f"{published.get(key)}")
                    published[key] = name
                f.check(target in self.listen_ports(name), f"{sw}: publishes {target}, listens on "
                        f"{sorted(self.listen_ports(name))}")
                if binary == "moe-gateway":
                    f.check(target != gw["control_port"], f"{sw}: publishes the control port {target}: ranks "
                            "reach it on the compose network; keep it off published ports")
                if metrics_port is not None and str(target) == str(metrics_port):
                    f.check(host_ip in ("127.0.0.1", "::1", "localhost"), f"{sw}: publishes /metrics ({target}) "
                            f"on {host_ip or 'every interface'}; publish it on 127.0.0.1 only")
            if binary == "moe-rank":
                # Every gateway must get every rank: the rank's --gateway entries (service names
                # or an alias they share) reach each gateway on its control port.
                reached = set()
                for entry in values.get("gateway", "").split(","):
                    m = re.fullmatch(r"([A-Za-z0-9_.-]+):([0-9]+)", entry)
                    if f.check(m is not None and int(m.group(2)) == gw_port and self.reached(m.group(1)),
                               f"{sw}: --gateway entry {entry!r} is no gateway service (or alias) on its "
                               f"control port {gw_port}"):
                        reached |= self.reached(m.group(1))
                f.check(reached == set(gw_names), f"{sw}: --gateway {values.get('gateway')} reaches "
                        f"{sorted(reached)}, the gateways are {gw_names}")
                for problem in dc.rank_auth_problems(gw, values, "the rank"):
                    f.add(f"{sw}: {problem}")
                deps = spec.get("depends_on") or {}
                f.check(any(g in deps for g in gw_names) and all(
                    (deps.get(g) or {}).get("condition") == "service_healthy" for g in gw_names if g in deps),
                        f"{sw}: should depend on the gateways with condition service_healthy")
                f.check((spec.get("healthcheck") or {}).get("test") not in (None, ["NONE"]),
                        f"{sw}: no healthcheck (the image's is the gateway's)")
            if binary in ("moe-gateway", "moe-rank"):
                path = values.get("checkpoint", checkpoint)
                mounts = [dc.parse_volume(v, self.path.parent) for v in spec.get("volumes", [])]
                covering = [m for m in mounts if path == m[1] or path.startswith(m[1].rstrip("/") + "/")]
                if f.check(bool(covering), f"{sw}: checkpoint {path} is not on a mounted volume"):
                    f.check(all(m[2] for m in covering), f"{sw}: checkpoint volume is not read-only")
            if gpu and binary in ("moe-gateway", "moe-rank"):
                f.check(spec.get("ipc") == "host", f"{sw}: needs ipc: host (NCCL shared memory between containers)")
                f.check(bool(spec.get("shm_size")), f"{sw}: no shm_size")
                env = spec.get("environment") or {}
                for knob in NCCL_KNOBS:
                    f.check(knob in env, f"{sw}: {knob} is not set")
        if gpu:
            f.check(gw_values.get("transport") == "nccl", f"{where}: gateway --transport "
                    f"{gw_values.get('transport')}, expected nccl")
            gpus = {}
            for name, (spec, binary, _) in self.services.items():
                if binary not in ("moe-gateway", "moe-rank"):
                    continue
                devices = (((spec.get("deploy") or {}).get("resources") or {}).get("reservations") or {}).get("devices")
                ok = (isinstance(devices, list) and len(devices) == 1 and devices[0].get("driver") == "nvidia"
                      and "gpu" in (devices[0].get("capabilities") or []) and len(devices[0].get("device_ids") or []) == 1)
                if f.check(ok, f"{where} service {name}: needs exactly one GPU (driver nvidia, device_ids [n], "
                           f"capabilities [gpu]), has {devices}"):
                    gpus.setdefault(str(devices[0]["device_ids"][0]), []).append(name)
            for gpu_id, names in gpus.items():
                f.check(len(names) == 1, f"{where}: GPU {gpu_id} reserved by {names}")
        for name in gw_names:
            self.check_secrets(name, gw)
        self.check_prometheus()
        return gw_name

    def check_secrets(self, gw_name, gw):
        """Credential files are the services' own read-only secrets, shared where they must be, and
        with make-certs.sh's files they form a working chain of trust."""
        f, where = self.f, self.path.name
        gw_values = self.services[gw_name][2]
        f.check(gw["tls"], f"{where}: the gateway serves its public port in plaintext (give --tls-cert/--tls-key)")
        used = {}    # service -> container paths its command and health checks read
        hosts = {}   # (service, flag) -> host file
        for name, (spec, binary, values) in self.services.items():
            lines = [(binary, values, "command")]
            for argv in self.healthcheck_commands(name):
                try:
                    b, _, v = dc.parse_argv(self.bindir, argv)
                except dc.CheckFailed as e:
                    f.add(f"{where} service {name} healthcheck: {e}")
                    continue
                lines.append((b, v, "healthcheck"))
            used[name] = set()
            for b, v, what in lines:
                for flag in dc.CREDENTIAL_FLAGS:
                    if v.get(flag):
                        used[name].add(v[flag])
                        hosts[(name, what, flag)] = self.credential(name, v[flag], f"{what} --{flag}")
                if b == "moe-client":
                    for problem in dc.tls_client_problems(gw, v, f"the {what} (moe-client)"):
                        f.add(f"{where} service {name}: {problem}")
                    m = re.fullmatch(r"([A-Za-z0-9_.-]+):([0-9]+)", v.get("target", ""))
                    f.check(m is not None and int(m.group(2)) != gw["control_port"],
                            f"{where} service {name}: {what} --target {v.get('target')} (the control port serves "
                            "only RankControl)")
            for target, host, secret in self.secret_mounts(name):
                f.check(target in used[name], f"{where} service {name}: mounts secret {secret} at {target} but "
                        "never reads it (give each service only the secrets it uses)")
        # The ranks present the gateway's token.
        gw_token = hosts.get((gw_name, "command", "cluster-token-file"))
        for name, (_, binary, _) in self.services.items():
            if binary == "moe-rank" and gw_token and (name, "command", "cluster-token-file") in hosts:
                token = hosts[(name, "command", "cluster-token-file")]
                f.check(token == gw_token, f"{where} service {name}: its cluster token {token} is not the "
                        f"gateway's {gw_token}")
        # ${MOE_SECRETS_DIR} moves every secret.
        moved = dc.compose_config(self.path, dict(self.env, MOE_SECRETS_DIR="/moe-secrets-dir-check"))
        for secret, spec in (moved.get("secrets") or {}).items():
            f.check(str(spec.get("file", "")).startswith("/moe-secrets-dir-check/"),
                    f"{where}: secret {secret} ({spec.get('file')}) does not follow MOE_SECRETS_DIR")
        # With make-certs.sh's files: the chain of trust works.
        with tempfile.TemporaryDirectory(prefix="moe-compose-certs-") as tmp:
            out = subprocess.run(["bash", str(self.source / "scripts" / "make-certs.sh"), tmp],
                                 capture_output=True, text=True, timeout=120)
            if not f.check(out.returncode == 0, f"scripts/make-certs.sh failed: {out.stderr.strip()}"):
                return
            real = ComposeFile(self.path, self.bindir, dc.Failures("unused"), dict(self.env, MOE_SECRETS_DIR=tmp),
                               self.source)
            real_hosts = {}
            for name in real.services:
                for target, host, secret in real.secret_mounts(name):
                    f.check(Path(host).is_file(), f"{where}: secret {secret} reads {host}, which "
                            "scripts/make-certs.sh does not write")
                    real_hosts[(name, target)] = host
            cert = real_hosts.get((gw_name, gw_values.get("tls-cert")))
            key = real_hosts.get((gw_name, gw_values.get("tls-key")))
            if not (cert and key and Path(cert).is_file() and Path(key).is_file()):
                return
            pub_cert = subprocess.run(["openssl", "x509", "-in", cert, "-noout", "-pubkey"], capture_output=True,
                                      text=True).stdout
            pub_key = subprocess.run(["openssl", "pkey", "-in", key, "-pubout"], capture_output=True, text=True).stdout
            f.check(pub_cert and pub_cert == pub_key, f"{where}: the gateway's --tls-key is not the key of its "
                    "--tls-cert")
            for name, (spec, binary, values) in self.services.items():
                clients = [("command", values, binary)] + [
                    ("healthcheck", dc.parse_argv(self.bindir, a)[2], a[0]) for a in self.healthcheck_commands(name)]
                for what, v, b in clients:
                    if b not in ("moe-rank", "moe-client") or not v.get("tls-ca"):
                        continue
                    ca = real_hosts.get((name, v["tls-ca"]))
                    if not ca:
                        continue
                    ok = subprocess.run(["openssl", "verify", "-CAfile", ca, cert], capture_output=True, text=True)
                    f.check(ok.returncode == 0, f"{where} service {name}: the {what}'s --tls-ca did not sign the "
                            f"gateway's certificate: {ok.stdout.strip()} {ok.stderr.strip()}")
                    addresses = v.get("gateway") if b == "moe-rank" else v.get("target")
                    for address in (addresses or "").split(","):
                        host = v.get("tls-server-name") or address.rsplit(":", 1)[0]
                        check = "-checkip" if re.fullmatch(r"[0-9.]+|[0-9a-fA-F:]+", host) else "-checkhost"
                        named = subprocess.run(["openssl", "x509", "-in", cert, "-noout", check, host],
                                               capture_output=True, text=True)
                        f.check(named.returncode == 0 and "does match" in named.stdout,
                                f"{where} service {name}: the {what} verifies the name {host}, which the gateway "
                                f"certificate of scripts/make-certs.sh does not carry")

    def check_prometheus(self):
        f, where = self.f, self.path.name
        proms = [s for s in self.external.values() if str(s.get("image", "")).startswith("docker.io/prom/prometheus")]
        if not f.check(len(proms) == 1, f"{where}: expected one Prometheus service"):
            return
        config_arg = next((a for a in dc.as_argv(proms[0].get("command")) if a.startswith("--config.file=")), "")
        container_path = config_arg.partition("=")[2]
        host = None
        for v in proms[0].get("volumes", []):
            source, target, _, kind = dc.parse_volume(v, self.path.parent)
            if kind == "bind" and container_path.startswith(target.rstrip("/") + "/"):
                host = Path(source + container_path[len(target.rstrip("/")):])
        if not f.check(host is not None and host.is_file(), f"{where}: Prometheus config {container_path} not mounted"):
            return
        config = yaml.safe_load(host.read_text())
        scraped = set()
        for job in config.get("scrape_configs", []):
            for sc in job.get("static_configs", []):
                scraped |= set(sc.get("targets", []))
            for sd in job.get("dns_sd_configs", []):
                scraped |= {f"{n}:{sd['port']}" for n in sd.get("names", [])}
        for name, (spec, binary, values) in self.services.items():
            mp = dc.flag_value(self.bindir, binary, values, "metrics-port")
            if mp is not None and int(mp) > 0:
                f.check(f"{name}:{mp}" in scraped, f"{where}: {name} serves /metrics on {mp}, Prometheus does "
                        f"not scrape {name}:{mp}")


def main():
    _, source, bindir = dc.parse_check_args()
    f = dc.Failures("check_compose")
    try:
        gpu = ComposeFile(source / "deploy" / "compose.yaml", bindir, f, source=source)
        gpu.check(gpu=True)
        cpu = ComposeFile(source / "deploy" / "compose.cpu.yaml", bindir, f, source=source)
        cpu.check(gpu=False)
        # The GPU file's health checks are the ones the CPU drift test runs (ports aside).
        for binary in ("moe-gateway", "moe-rank"):
            g = {normalized_healthcheck(s[0]) for s in gpu.of(binary).values()}
            c = {normalized_healthcheck(s[0]) for s in cpu.of(binary).values()}
            f.check(g == c and len(g) == 1, f"{binary} healthchecks differ between compose.yaml {g} and "
                    f"compose.cpu.yaml {c} (only the CPU file's run in compose_cpu_test.py)")
        # MOE_TRANSPORT switches the GPU file's transport.
        grpc = ComposeFile(source / "deploy" / "compose.yaml", bindir, f, env={"MOE_TRANSPORT": "grpc"}, source=source)
        f.check(all(values.get("transport") == "grpc" for _, _, values in grpc.of("moe-gateway").values()),
                "MOE_TRANSPORT=grpc does not reach the gateway's --transport")
    except dc.CheckFailed as e:
        f.add(str(e))
    f.finish(f"compose.yaml: {len(gpu.of('moe-gateway'))} gateway(s) + {len(gpu.of('moe-rank'))} ranks on distinct "
             f"GPUs; compose.cpu.yaml: {len(cpu.of('moe-gateway'))} gateway(s) + {len(cpu.of('moe-rank'))} ranks; flags, ranks, mounts, ports, control port, credentials, secrets, TLS, health checks and scrape "
             "targets agree")


if __name__ == "__main__":
    main()
