#!/usr/bin/python3
"""The compose-drift test: runs deploy/compose.cpu.yaml's services as local processes.

Reads the compose file as compose resolves it (`docker-compose config`: variables, anchors and
merge keys expanded) and runs every service of ours -- entrypoint (the Dockerfile's, unless the
service overrides it) + `command`, exactly as written -- with the binaries of the build tree:

  - container paths under a volume's mount point map to local directories (named volumes: a
    temporary directory each; bind mounts: the host path); the secrets come from a fresh
    scripts/make-certs.sh run into a temporary MOE_SECRETS_DIR, and each service's
    /run/secrets/<name> maps to its file;
  - each (service, container port) its command listens on (--port, --control-port,
    --metrics-port, or their --help defaults) gets a free local port, and `service:port` /
    `127.0.0.1:port` in arguments and health checks are rewritten to 127.0.0.1:<that port>;
  - services start in depends_on order and each condition is honoured the way compose does it:
    service_completed_successfully waits for the one-shot to exit 0, service_healthy runs the
    dependency's own healthcheck (mapped the same way) until it passes.

An alias that several services share on the compose network (the gateways' `gateway`) maps to
the list of all of them, as the name resolves in compose.

Then: every gateway turns SERVING; every rank's healthcheck and the image's HEALTHCHECK pass (the
latter with MOE_HEALTH_TLS_CA when the gateway serves TLS, and fails without it); clients connect
with the TLS flags of the gateway's own healthcheck, through the gateways' shared name and to
each gateway alone (the same bits); the trust boundaries hold on the running
system: the public port refuses plaintext, and a rank with the compose file's own command but
without its cluster token (or with a wrong one) is refused on the control port
(moe_auth_failures_total{plane="control"} counts it) while the real ranks stay up;
`moe-client forward` on random inputs equals `moe-forward` on the same checkpoint (bit-identical,
or relative L2 <= 1e-5); every Prometheus target of the mounted prometheus.yml is a service port
that serves moe_* metrics; `promtool check config` passes on the mounted config; Grafana's
provisioning points at mounted files. With several gateways, one is killed (SIGKILL): every call
through the shared name is still answered, bit-identically, and the gateway restarted as compose
would restart it gets every rank back and serves again. Finally every process gets SIGTERM in reverse start order
and must exit 0 within its stop_grace_period, as `docker compose down` would require.

Prometheus and Grafana are images, not our binaries: their containers are not run.

usage: compose_cpu_test.py [--compose FILE] [--bin-dir DIR] [--keep]
"""

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import deploy_common as dc  # noqa: E402

LOCAL = "127.0.0.1"
EXTERNAL_IMAGES = ("docker.io/prom/prometheus", "docker.io/grafana/grafana")


def log(message):
    print(f"[compose-cpu] {message}", flush=True)


def fail(message):
    raise dc.CheckFailed(message)


def free_port():
    with socket.socket() as s:
        s.bind((LOCAL, 0))
        return s.getsockname()[1]


def duration_s(value, default):
    """Compose durations as `config` prints them: 5s, 1m, 1m30s, 600s, 10m."""
    if value is None:
        return default
    total = 0.0
    for number, unit in re.findall(r"([0-9.]+)(ms|us|h|m|s)", str(value)):
        total += float(number) * {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6}[unit]
    return total


class Service:
    """One of our services, planned for a local run."""

    def __init__(self, name, spec):
        self.name = name
        self.spec = spec
        self.argv = []            # container argv (entrypoint wrapper stripped)
        self.local_argv = []      # argv to run here
        self.listen_ports = {}    # container port -> local port
        self.mounts = []          # (target, local source, read_only)
        self.process = None
        self.log_path = None
        self.binary = None
        self.values = {}


class ComposeRun:
    def __init__(self, args):
        self.args = args
        self.compose_file = Path(args.compose).resolve()
        self.compose_dir = self.compose_file.parent
        self.bindir = dc.bin_dir(args.bin_dir)
        self.scripts_dir = dc.SOURCE_DIR / "docker"
        self.work = Path(tempfile.mkdtemp(prefix="moe-compose-cpu-"))
        self.services = {}
        self.external = {}
        self.started = []
        self.healthy = set()
        self.client_tls = []         # moe-client TLS flags for the gateway (from its healthcheck)
        self.client_tls_values = {}
        self.env = dict(os.environ)
        self.env["PATH"] = f"{self.bindir}:{self.scripts_dir}:{self.env.get('PATH', '')}"

    # ---- planning --------------------------------------------------------------------------------

    def make_secrets(self):
        """A CA, the gateway's certificate and a cluster token, as docs/DEPLOYMENT.md makes them."""
        self.secrets_dir = self.work / "secrets"
        out = subprocess.run(["bash", str(dc.SOURCE_DIR / "scripts" / "make-certs.sh"), str(self.secrets_dir)],
                             capture_output=True, text=True, timeout=120)
        if out.returncode != 0:
            fail(f"scripts/make-certs.sh failed: {out.stdout}{out.stderr}")
        log(f"secrets: scripts/make-certs.sh {self.secrets_dir}")

    def plan(self):
        self.make_secrets()
        config = dc.compose_config(self.compose_file, {"MOE_SECRETS_DIR": str(self.secrets_dir)})
        self.config = config
        for name, spec in config["services"].items():
            image = str(spec.get("image", ""))
            if image.startswith(EXTERNAL_IMAGES):
                self.external[name] = spec
                continue
            svc = Service(name, spec)
            entrypoint = dc.as_argv(spec["entrypoint"]) if "entrypoint" in spec else self.image_entrypoint(spec)
            svc.argv = dc.strip_init(entrypoint + dc.as_argv(spec.get("command")))
            if not svc.argv:
                fail(f"service {name}: no command")
            try:
                svc.binary, _, svc.values = dc.parse_argv(self.bindir, svc.argv)
            except dc.CheckFailed as e:
                fail(f"service {name}: {e}")
            self.services[name] = svc
        if not self.services:
            fail("no services of ours in the compose file")

        # Volumes: named volumes become temporary directories, bind mounts stay.
        for svc in self.services.values():
            for entry in svc.spec.get("volumes", []):
                source, target, read_only, kind = dc.parse_volume(entry, self.compose_dir)
                if kind == "volume":
                    local = self.work / "volumes" / (source or f"anon-{svc.name}")
                    local.mkdir(parents=True, exist_ok=True)
                else:
                    local = Path(source)
                svc.mounts.append((target.rstrip("/"), str(local), read_only))
            # Secrets: compose bind-mounts each file read-only.
            for target, host, name in dc.compose_secret_mounts(svc.spec, config):
                if not host or not Path(host).is_file():
                    fail(f"service {svc.name}: secret {name} is {host}, not a file of scripts/make-certs.sh")
                if not Path(host).resolve().is_relative_to(self.secrets_dir.resolve()):
                    fail(f"service {svc.name}: secret {name} ({host}) is not under MOE_SECRETS_DIR")
                svc.mounts.append((target, host, True))
            svc.mounts.sort(key=lambda m: -len(m[0]))

        # Listening ports and their local replacements.
        for svc in self.services.values():
            for flag in ("port", "control-port", "metrics-port"):
                value = dc.flag_value(self.bindir, svc.binary, svc.values, flag)
                if value is not None and re.fullmatch(r"[0-9]+", value) and int(value) > 0:
                    svc.listen_ports[int(value)] = free_port()
            for entry in svc.spec.get("ports", []):
                _, target = dc.parse_port(entry)
                if target not in svc.listen_ports:
                    fail(f"service {svc.name} publishes container port {target}, but its command listens "
                         f"on {sorted(svc.listen_ports) or 'nothing'}")
            for entry in svc.spec.get("expose", []):
                if int(str(entry).split("/")[0]) not in svc.listen_ports:
                    fail(f"service {svc.name} exposes {entry}, but its command does not listen there")

        # The command lines to run here.
        for svc in self.services.values():
            svc.local_argv = [str(self.bindir / svc.argv[0])] + [self.map_arg(svc, a, i, svc.argv)
                                                                 for i, a in enumerate(svc.argv) if i > 0]
        self.check_mount_modes()

    def image_entrypoint(self, spec):
        build = spec.get("build")
        if not build:
            fail(f"service image {spec.get('image')} has no build: cannot tell its entrypoint")
        context = Path(build["context"] if isinstance(build, dict) else build)
        dockerfile = context / (build.get("dockerfile", "Dockerfile") if isinstance(build, dict) else "Dockerfile")
        entrypoint = []
        for instruction, rest in dc.dockerfile_instructions(dockerfile):
            if instruction == "FROM":
                entrypoint = []
            elif instruction == "ENTRYPOINT":
                entrypoint = dc.exec_form(rest) or ["/bin/sh", "-c", rest]
        self.dockerfile = dockerfile
        return entrypoint

    def map_path(self, svc, value):
        for target, local, _ in svc.mounts:
            if value == target or value.startswith(target + "/"):
                return local + value[len(target):]
        return value

    def network_names(self, name):
        """The names service `name` answers to on the compose network: its own and its aliases."""
        names = {name}
        networks = self.config["services"][name].get("networks") or {}
        for net in (networks.values() if isinstance(networks, dict) else []):
            names |= set((net or {}).get("aliases") or [])
        return names

    def map_address(self, svc, value):
        """service:port, 127.0.0.1:port, localhost:port -> 127.0.0.1:<local port>; an alias that
        several services share (the gateways' `gateway`) -> the list of all of them, which is
        what the name resolves to in compose (every flag that takes a gateway address takes a
        list). A comma-separated list maps entry by entry."""
        if "," in value:
            return ",".join(self.map_address(svc, v) for v in value.split(","))
        m = re.fullmatch(r"([A-Za-z0-9_.-]+):([0-9]+)", value)
        if not m:
            return value
        host, port = m.group(1), int(m.group(2))
        if host in (LOCAL, "localhost", "0.0.0.0"):
            owners = [svc]
        else:
            owners = [s for n, s in self.services.items() if host in self.network_names(n)]
        if not owners:
            if host in self.external or any(host in self.network_names(n) for n in self.config["services"]):
                return value
            fail(f"service {svc.name}: '{value}' names no service of this compose file")
        for owner in owners:
            if port not in owner.listen_ports:
                fail(f"service {svc.name}: '{value}' but {owner.name} listens on {sorted(owner.listen_ports)}")
        return ",".join(f"{LOCAL}:{owner.listen_ports[port]}" for owner in owners)

    def map_arg(self, svc, value, index, argv):
        previous = argv[index - 1] if index > 0 else ""
        if previous in ("--port", "--control-port", "--metrics-port") and re.fullmatch(r"[0-9]+", value) \
                and int(value) > 0:
            return str(svc.listen_ports[int(value)])
        if previous in ("--host", "--control-host", "--metrics-host") and value == "0.0.0.0":
            return LOCAL
        if value.startswith("--") and "=" in value:
            name, _, v = value.partition("=")
            return f"{name}={self.map_arg(svc, v, 1, [name, v])}"
        value = self.map_address(svc, value)
        return self.map_path(svc, value)

    def check_mount_modes(self):
        """The one-shot that writes the checkpoint mounts its volume read-write; every other
        service of ours reads it read-only."""
        for svc in self.services.values():
            writes = {self.map_path(svc, v) for k, v in svc.values.items() if k == "out"}
            for target, local, read_only in svc.mounts:
                written = any(w == local or w.startswith(local + "/") for w in writes)
                if written and read_only:
                    fail(f"service {svc.name} writes under {target} but mounts it read-only")
                if not written and not read_only:
                    fail(f"service {svc.name} mounts {target} read-write but does not write there: use :ro")

    # ---- running ---------------------------------------------------------------------------------

    def order(self):
        done, order = set(), []

        def visit(name, stack):
            if name in done:
                return
            if name in stack:
                fail(f"depends_on cycle: {' -> '.join(stack + [name])}")
            for dep in self.depends_on(name):
                if dep in self.services:
                    visit(dep, stack + [name])
            done.add(name)
            order.append(name)

        for name in self.services:
            visit(name, [])
        return order

    def depends_on(self, name):
        deps = self.services[name].spec.get("depends_on") or {}
        if isinstance(deps, list):
            return {d: {"condition": "service_started"} for d in deps}
        return deps

    def start(self, svc, log_name=None):
        svc.log_path = self.work / f"{log_name or svc.name}.log"
        log(f"start {svc.name}: {' '.join(svc.local_argv)}")
        env = dict(self.env)
        for key, value in (svc.spec.get("environment") or {}).items():
            env[key] = "" if value is None else str(value)
        with open(svc.log_path, "w") as out:
            svc.process = subprocess.Popen(svc.local_argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                           start_new_session=True)
        self.started.append(svc)

    def tail(self, svc, lines=30):
        if svc.log_path is None or not svc.log_path.exists():
            return ""
        text = svc.log_path.read_text(errors="replace").splitlines()
        return "\n".join(f"    [{svc.name}] {l}" for l in text[-lines:])

    def assert_running(self):
        for svc in self.started:
            if self.is_one_shot(svc):
                continue
            rc = svc.process.poll()
            if rc is not None:
                fail(f"service {svc.name} exited with {rc}\n{self.tail(svc)}")

    def is_one_shot(self, svc):
        if str(svc.spec.get("restart", "no")) not in ("no", "False", "false"):
            return False
        return any(self.depends_on(other).get(svc.name, {}).get("condition") == "service_completed_successfully"
                   for other in self.services)

    def healthcheck_argv(self, svc):
        """The service's healthcheck `test` mapped to this host, or None when it has none."""
        check = svc.spec.get("healthcheck") or {}
        test = check.get("test")
        if check.get("disable") or not test or test[0] == "NONE":
            return None
        if isinstance(test, str):
            test = ["CMD-SHELL", test]
        kind, rest = test[0], test[1:]
        if kind == "CMD":
            mapped = []
            for word in rest:
                if re.fullmatch(r"[0-9]+", word) and int(word) in svc.listen_ports:
                    mapped.append(str(svc.listen_ports[int(word)]))
                else:
                    mapped.append(self.map_path(svc, self.map_address(svc, word)))
            self.check_shell_commands(svc, [mapped] if os.path.basename(mapped[0]) in dc.BINARIES else [])
            return mapped
        if kind == "CMD-SHELL":
            script = rest[0]
            script = re.sub(r"\b((?:127\.0\.0\.1|localhost|[A-Za-z][A-Za-z0-9_-]*):[0-9]+)\b",
                            lambda m: self.map_address(svc, m.group(1)), script)
            for target, local, _ in svc.mounts:  # longest first
                script = re.sub(rf"(?<![\w/.-]){re.escape(target)}(?=$|[/\s'\"|;&)])", lambda m: local, script)
            self.check_shell_commands(svc, dc.commands_in_shell(script))
            return ["/bin/sh", "-c", script]
        fail(f"service {svc.name}: healthcheck test kind {kind}")

    def check_shell_commands(self, svc, commands):
        for argv in commands:
            if os.path.basename(argv[0]) in dc.BINARIES:
                try:
                    dc.parse_argv(self.bindir, argv)
                except dc.CheckFailed as e:
                    fail(f"service {svc.name} healthcheck: {e}")

    def run_check(self, argv, env=None):
        out = subprocess.run(argv, capture_output=True, text=True, env=env or self.env, timeout=30)
        return out.returncode, (out.stdout + out.stderr).strip()

    def wait_healthy(self, svc, why):
        if svc.name in self.healthy:
            return
        argv = self.healthcheck_argv(svc)
        if argv is None:
            fail(f"{why}, but {svc.name} has no healthcheck")
        check = svc.spec.get("healthcheck") or {}
        budget = (duration_s(check.get("start_period"), 0) + duration_s(check.get("interval"), 30)
                  * max(int(check.get("retries", 3)), 1) + 60)
        deadline = time.time() + budget
        last = ""
        while time.time() < deadline:
            self.assert_running()
            rc, last = self.run_check(argv)
            if rc == 0:
                log(f"{svc.name} healthy ({' '.join(argv)})")
                self.healthy.add(svc.name)
                return
            time.sleep(0.5)
        hint = ""
        if svc.binary == "moe-gateway":
            hint = (" (a gateway is SERVING only once its ranks have registered: a healthcheck that waits for "
                    "SERVING deadlocks ranks that depend on it being healthy)")
        fail(f"{why}: {svc.name} not healthy after {budget:.0f} s (last: rc {rc}, {last}){hint}\n{self.tail(svc)}")

    def run_all(self):
        for name in self.order():
            svc = self.services[name]
            for dep, cond in self.depends_on(name).items():
                condition = (cond or {}).get("condition", "service_started")
                if dep not in self.services:
                    fail(f"{name} depends on {dep}, which is not one of our services")
                dep_svc = self.services[dep]
                if condition == "service_completed_successfully":
                    if dep_svc.process is None or dep_svc.process.returncode != 0:
                        fail(f"{name} needs {dep} completed successfully")
                elif condition == "service_healthy":
                    self.wait_healthy(dep_svc, f"{name} depends on {dep} being healthy")
                elif condition != "service_started":
                    fail(f"{name}: unknown depends_on condition {condition}")
            self.start(svc)
            if self.is_one_shot(svc):
                try:
                    rc = svc.process.wait(timeout=600)
                except subprocess.TimeoutExpired:
                    fail(f"one-shot service {name} did not finish in 600 s\n{self.tail(svc)}")
                if rc != 0:
                    fail(f"one-shot service {name} exited {rc}\n{self.tail(svc)}")
                log(f"{name} completed")
            else:
                time.sleep(0.2)
                self.assert_running()

    # ---- checks of the running system ------------------------------------------------------------

    def gateways(self):
        gateways = [s for s in self.services.values() if s.binary == "moe-gateway"]
        if not gateways:
            fail("no moe-gateway service")
        return gateways

    def gateway(self):
        """The first gateway: the one whose checkpoint and client flags stand for all (the
        static check holds them to one command)."""
        return self.gateways()[0]

    def public_target(self, gw):
        return f"{LOCAL}:{gw.listen_ports[int(dc.flag_value(self.bindir, 'moe-gateway', gw.values, 'port'))]}"

    def metrics_address(self, svc):
        return f"{LOCAL}:{svc.listen_ports[int(svc.values['metrics-port'])]}"

    def gateway_client_tls(self, gw):
        """The TLS flags (mapped to this host) of the moe-client in the gateway's own healthcheck:
        what any client of this gateway needs."""
        argv = self.healthcheck_argv(gw) or []
        lines = dc.commands_in_shell(argv[2]) if argv[:2] == ["/bin/sh", "-c"] else [argv]
        for line in lines:
            if line and os.path.basename(line[0]) == "moe-client":
                _, _, values = dc.parse_argv(self.bindir, line)
                self.client_tls_values = values
                flags = []
                for name in ("tls-ca", "tls-cert", "tls-key", "tls-server-name"):
                    if values.get(name):
                        flags += [f"--{name}", values[name]]
                if values.get("tls") == "true":
                    flags.append("--tls")
                return flags
        return []

    def client(self, *args):
        out = subprocess.run([str(self.bindir / "moe-client")] + list(args) + self.client_tls, capture_output=True,
                             text=True, env=self.env, timeout=180)
        if out.returncode != 0:
            fail(f"moe-client {' '.join(args)} exited {out.returncode}: {out.stderr.strip()}")
        return out.stdout

    def wait_serving(self, gw, wait_s=180):
        target = self.public_target(gw)
        out = subprocess.run([str(self.bindir / "moe-client"), "health", "--target", target, "--wait-s", str(wait_s)]
                             + self.client_tls, capture_output=True, text=True, env=self.env, timeout=wait_s + 60)
        self.assert_running()
        if out.returncode != 0:
            fail(f"{gw.name} not SERVING: {out.stderr.strip()}\n{self.tail(gw)}")
        log(f"{gw.name} SERVING on {target}")

    def check_ready(self):
        gw = self.gateway()
        self.client_tls = self.gateway_client_tls(gw)
        # What a client in the compose network reaches at the gateways' shared name: all of them.
        self.target = ",".join(self.public_target(g) for g in self.gateways())
        for g in self.gateways():
            self.wait_serving(g)
        target = self.public_target(gw)
        ranks = [s for s in self.services.values() if s.binary == "moe-rank"]
        want = int(dc.flag_value(self.bindir, "moe-gateway", gw.values, "ranks"))
        if len(ranks) != want:
            fail(f"gateway --ranks {want}, but the file has {len(ranks)} rank services")
        claimed = sorted(int(s.values.get("rank", -1)) for s in ranks)
        if claimed != list(range(want)):
            fail(f"rank services claim --rank {claimed}, expected 0..{want - 1}")
        for svc in ranks:
            self.wait_healthy(svc, f"rank service {svc.name}")
        # The image's own HEALTHCHECK (readiness) on the gateway.
        hc = [rest for instruction, rest in dc.dockerfile_instructions(self.dockerfile) if instruction == "HEALTHCHECK"]
        if not hc:
            fail(f"{self.dockerfile} has no HEALTHCHECK")
        command = re.sub(r"^(--[a-z-]+=\S+\s+)*CMD\s+", "", hc[-1])
        env = dict(self.env)
        env["MOE_PORT"] = target.split(":")[1]
        tls = self.client_tls_values
        health_env = {"MOE_HEALTH_TLS_CA": tls.get("tls-ca"), "MOE_HEALTH_TLS_CERT": tls.get("tls-cert"),
                      "MOE_HEALTH_TLS_KEY": tls.get("tls-key")}
        health_env = {k: v for k, v in health_env.items() if v}
        rc, text = self.run_check(["/bin/sh", "-c", command], env=dict(env, **health_env))
        if rc != 0:
            fail(f"the image HEALTHCHECK '{command}' fails on a SERVING gateway with {health_env}: {text}")
        log(f"image HEALTHCHECK passes: {command} (with {', '.join(health_env) or 'no TLS variables'})")
        if health_env:
            rc, text = self.run_check(["/bin/sh", "-c", command], env=env)
            if rc == 0:
                fail(f"the image HEALTHCHECK passes without {', '.join(health_env)}: the gateway's public port "
                     "answers plaintext")
            log(f"image HEALTHCHECK without {', '.join(health_env)} fails (public port refuses plaintext)")

    def check_forward(self):
        info = json.loads(self.client("info", "--target", self.target, "--json"))
        layers = [int(l) for l in info["layers"]]
        hidden = int(info.get("hidden_size", info.get("hiddenSize")))
        gw = self.gateway()
        checkpoint = self.map_path(gw, gw.values["checkpoint"])
        rng = np.random.default_rng(int(os.environ.get("MOE_TEST_SEED", "20261129")))
        cases = [(layers[0], 7), (layers[-1], 1), (layers[len(layers) // 2], 33)]
        for layer, tokens in cases:
            x = rng.standard_normal((tokens, hidden)).astype(np.float32)
            x_path = self.work / f"x-{layer}-{tokens}.npy"
            np.save(x_path, x)
            y_path = self.work / f"y-{layer}-{tokens}.npy"
            ref_path = self.work / f"ref-{layer}-{tokens}.npy"
            self.client("forward", "--target", self.target, "--layer", str(layer), "--input", str(x_path),
                        "--output", str(y_path))
            out = subprocess.run([str(self.bindir / "moe-forward"), "--checkpoint", checkpoint, "--layer", str(layer),
                                  "--input", str(x_path), "--output", str(ref_path)],
                                 capture_output=True, text=True, env=self.env, timeout=300)
            if out.returncode != 0:
                fail(f"moe-forward failed: {out.stderr.strip()}")
            y, ref = np.load(y_path), np.load(ref_path)
            if y.shape != ref.shape:
                fail(f"layer {layer}: service output {y.shape}, moe-forward {ref.shape}")
            identical = np.array_equal(y.view(np.uint32), ref.view(np.uint32))
            rel = float(np.linalg.norm((y - ref).astype(np.float64)) / max(np.linalg.norm(ref.astype(np.float64)), 1e-30))
            if not identical and rel > 1e-5:
                fail(f"layer {layer}, {tokens} tokens: service vs moe-forward relative L2 {rel:.3e} > 1e-5")
            log(f"forward layer {layer}, {tokens} tokens: {'bit-identical' if identical else f'rel L2 {rel:.2e}'}"
                " to moe-forward")
            if len(self.gateways()) > 1 and tokens == cases[0][1]:
                for g in self.gateways():
                    alone = self.work / f"y-{layer}-{tokens}-{g.name}.npy"
                    self.client("forward", "--target", self.public_target(g), "--layer", str(layer), "--input",
                                str(x_path), "--output", str(alone))
                    if not np.array_equal(np.load(alone).view(np.uint32), y.view(np.uint32)):
                        fail(f"layer {layer}: {g.name} alone answers differently from the gateways together")
                log(f"forward layer {layer}, {tokens} tokens: each of {', '.join(g.name for g in self.gateways())} "
                    "alone answers bit-identically")
        self.forward_layers = {c[0] for c in cases}
        self.reference_case = cases[0]

    def control_refusals(self):
        """Control-plane refusals of all gateways (a rank tries every gateway it is given)."""
        total = 0
        for gw in self.gateways():
            text = self.scrape(self.metrics_address(gw))
            total += sum(v for l, v in self.samples(text, "moe_auth_failures_total") if l.get("plane") == "control")
        return total

    def check_ranks_up(self, gw, ranks, why):
        text = self.scrape(self.metrics_address(gw))
        up = {l["rank"]: v for l, v in self.samples(text, "moe_rank_up")}
        if len(up) != len(ranks) or any(v != 1 for v in up.values()):
            fail(f"{why}, {gw.name}'s moe_rank_up is {up}")
        return up

    def check_trust_boundaries(self):
        """On the running system: the public port refuses plaintext, and the control port refuses a
        rank that runs the file's own rank command without its cluster token or with a wrong one."""
        for gw in self.gateways():
            target = self.public_target(gw)
            out = subprocess.run([str(self.bindir / "moe-client"), "health", "--target", target],
                                 capture_output=True, text=True, env=self.env, timeout=30)
            if gw.values.get("tls-cert") and out.returncode == 0:
                fail(f"{gw.name} has --tls-cert, yet {target} answers a plaintext health check")
        ranks = [s for s in self.services.values() if s.binary == "moe-rank"]
        rank = ranks[0]
        wrong = self.work / "wrong-cluster-token"
        wrong.write_text("not-the-cluster-token\n")
        cases = [("no cluster token", None)]
        if "cluster-token-file" in rank.values:
            cases.append(("a wrong cluster token", str(wrong)))
        for what, token in cases:
            argv, skip = [], 0
            for i, a in enumerate(rank.local_argv):
                if skip:
                    skip -= 1
                    continue
                name = a[2:].partition("=")[0] if a.startswith("--") else None
                if name in ("cluster-token-file", "metrics-port", "exit-on-disconnect", "connect-timeout-s"):
                    skip = 0 if "=" in a or name == "exit-on-disconnect" else 1
                    if name == "cluster-token-file" and token:
                        argv += ["--cluster-token-file", token]
                    continue
                argv.append(a)
            argv += ["--connect-timeout-s", "5", "--exit-on-disconnect"]
            before = self.control_refusals()
            try:
                out = subprocess.run(argv, capture_output=True, text=True, env=self.env, timeout=120)
            except subprocess.TimeoutExpired:
                fail(f"a rank with {what} kept running for 120 s: {' '.join(argv)}")
            after = self.control_refusals()
            self.assert_running()
            if out.returncode == 0 or after <= before:
                fail(f"a rank with {what} was not refused (exit {out.returncode}, control-plane refusals "
                     f"{before:.0f} -> {after:.0f}): {' '.join(argv)}\n{out.stderr[-1500:]}")
            log(f"a rank with {what} is refused on the control port (exit {out.returncode}, "
                f"moe_auth_failures_total{{plane=\"control\"}} {before:.0f} -> {after:.0f})")
        # The real ranks are still the gateway's (SERVING: all of them up; a loaded host may have
        # made one miss heartbeats for a moment, so allow it to come back).
        for gw in self.gateways():
            self.client("health", "--target", self.public_target(gw), "--wait-s", "60")
            self.check_ranks_up(gw, ranks, "after the refused ranks")

    def check_gateway_failover(self, calls=12):
        """`docker kill` of one gateway costs no call made through the gateways' shared name: each
        is answered by another, bit-identically; the killed gateway, restarted as compose would
        (restart: unless-stopped), gets every rank back and serves again."""
        gateways = self.gateways()
        if len(gateways) < 2:
            log("one gateway: no failover to check")
            return
        victim = gateways[0]
        layer, tokens = self.reference_case
        x_path = self.work / f"x-{layer}-{tokens}.npy"
        want = np.load(self.work / f"y-{layer}-{tokens}.npy")
        os.killpg(victim.process.pid, signal.SIGKILL)
        victim.process.wait()
        for i in range(calls):
            y_path = self.work / f"y-failover-{i}.npy"
            self.client("forward", "--target", self.target, "--layer", str(layer), "--input", str(x_path),
                        "--output", str(y_path))
            if not np.array_equal(np.load(y_path).view(np.uint32), want.view(np.uint32)):
                fail(f"with {victim.name} killed, call {i} through {self.target} answered differently")
        log(f"{victim.name} killed: {calls} of {calls} calls through the shared name answered, bit-identically")
        self.started.remove(victim)
        begun = time.time()
        self.start(victim, f"{victim.name}-restarted")
        self.wait_serving(victim)
        serving_s = time.time() - begun
        self.check_ranks_up(victim, [s for s in self.services.values() if s.binary == "moe-rank"],
                            f"restarted {victim.name}")
        y_path = self.work / "y-restarted.npy"
        self.client("forward", "--target", self.public_target(victim), "--layer", str(layer), "--input",
                    str(x_path), "--output", str(y_path))
        if not np.array_equal(np.load(y_path).view(np.uint32), want.view(np.uint32)):
            fail(f"restarted {victim.name} answers differently")
        log(f"{victim.name} restarted: SERVING with every rank after {serving_s:.1f} s, answers bit-identically")

    def scrape(self, address):
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:
            return r.read().decode()

    @staticmethod
    def samples(text, name):
        out = []
        for line in text.splitlines():
            m = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})?\s+(\S+)$", line)
            if m:
                labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
                out.append((labels, float(m.group(2))))
        return out

    def check_metrics_and_prometheus(self):
        prom = [s for s in self.external.values() if str(s.get("image", "")).startswith("docker.io/prom/prometheus")]
        if len(prom) != 1:
            fail(f"expected one Prometheus service, found {len(prom)}")
        prom = prom[0]
        config_arg = next((a for a in dc.as_argv(prom.get("command")) if a.startswith("--config.file=")), None)
        if config_arg is None:
            fail("the Prometheus service does not pass --config.file")
        container_path = config_arg.split("=", 1)[1]
        host_path = None
        for entry in prom.get("volumes", []):
            source, target, _, kind = dc.parse_volume(entry, self.compose_dir)
            if kind == "bind" and (container_path == target or container_path.startswith(target.rstrip("/") + "/")):
                host_path = source + container_path[len(target.rstrip("/")):]
        if host_path is None or not Path(host_path).is_file():
            fail(f"Prometheus config {container_path} is not a mounted file (host path {host_path})")
        out = subprocess.run(["promtool", "check", "config", host_path], capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            fail(f"promtool check config {host_path}: {out.stdout}{out.stderr}")
        log(f"promtool check config {host_path}: ok")

        # Every scrape target that names one of our services is a port it listens on and serves
        # moe_* metrics; every metrics port of ours is scraped.
        config = yaml.safe_load(Path(host_path).read_text())
        scraped = set()
        for job in config.get("scrape_configs", []):
            targets = []
            for sc in job.get("static_configs", []):
                targets += sc.get("targets", [])
            for sd in job.get("dns_sd_configs", []):
                targets += [f"{n}:{sd['port']}" for n in sd.get("names", []) if n in self.config["services"]]
            for t in targets:
                host, port = t.rsplit(":", 1)
                if host in self.services:
                    svc = self.services[host]
                    if int(port) not in svc.listen_ports:
                        fail(f"Prometheus job {job['job_name']} scrapes {t}, but {host} listens on "
                             f"{sorted(svc.listen_ports)}")
                    text = self.scrape(f"{LOCAL}:{svc.listen_ports[int(port)]}")
                    if "moe_" not in text:
                        fail(f"{t} serves no moe_* metrics")
                    scraped.add((host, int(port)))
        for svc in self.services.values():
            metrics_port = dc.flag_value(self.bindir, svc.binary, svc.values, "metrics-port")
            if metrics_port is not None and int(metrics_port) > 0 and (svc.name, int(metrics_port)) not in scraped:
                fail(f"{svc.name} serves /metrics on {metrics_port}, but no Prometheus job scrapes it")
        log(f"Prometheus targets: {', '.join(f'{h}:{p}' for h, p in sorted(scraped))}")

        ranks = [s for s in self.services.values() if s.binary == "moe-rank"]
        ok = 0
        for gw in self.gateways():
            text = self.scrape(self.metrics_address(gw))
            ok += sum(v for l, v in self.samples(text, "moe_requests_total") if l.get("code") == "OK")
            up = self.check_ranks_up(gw, ranks, "after the forwards")
        if ok < 3:
            fail(f"the gateways' moe_requests_total{{code=\"OK\"}} add up to {ok} after 3 forwards")
        for svc in self.services.values():
            if svc.binary != "moe-rank":
                continue
            text = self.scrape(f"{LOCAL}:{svc.listen_ports[int(svc.values['metrics-port'])]}")
            ids = self.samples(text, "moe_rank_id")
            if not ids or int(ids[0][1]) != int(svc.values["rank"]):
                fail(f"{svc.name}: moe_rank_id {ids}, expected {svc.values['rank']}")
        log(f"metrics: {int(ok)} OK requests, ranks up {sorted(up)}, each rank reports its id")

    def check_grafana(self):
        for spec in self.external.values():
            if not str(spec.get("image", "")).startswith("docker.io/grafana/grafana"):
                continue
            mounts = []
            for entry in spec.get("volumes", []):
                source, target, _, kind = dc.parse_volume(entry, self.compose_dir)
                if kind == "bind":
                    mounts.append((target.rstrip("/"), source))

            def host(path):
                for target, source in sorted(mounts, key=lambda m: -len(m[0])):
                    if path == target or path.startswith(target + "/"):
                        return Path(source + path[len(target):])
                return None

            provisioning = host("/etc/grafana/provisioning")
            if provisioning is None:
                fail("Grafana: /etc/grafana/provisioning is not mounted")
            dashboards = 0
            for f in sorted((provisioning / "dashboards").glob("*.y*ml")):
                for provider in yaml.safe_load(f.read_text()).get("providers", []):
                    path = host(provider["options"]["path"])
                    if path is None or not any(path.glob("*.json")):
                        fail(f"Grafana provider {provider['name']}: {provider['options']['path']} holds no "
                             "mounted dashboard")
                    dashboards += len(list(path.glob("*.json")))
            for f in sorted((provisioning / "datasources").glob("*.y*ml")):
                for ds in yaml.safe_load(f.read_text()).get("datasources", []):
                    m = re.match(r"https?://([^:/]+):([0-9]+)", ds.get("url", ""))
                    if not m or m.group(1) not in self.external:
                        fail(f"Grafana datasource {ds.get('name')}: {ds.get('url')} is not a service of the file")
            home = (spec.get("environment") or {}).get("GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH")
            if home and (host(home) is None or not host(home).is_file()):
                fail(f"Grafana home dashboard {home} is not a mounted file")
            log(f"Grafana: {dashboards} provisioned dashboard(s), datasource and home dashboard mounted")

    # ---- stopping --------------------------------------------------------------------------------

    def stop(self, strict=True):
        problems = []
        for svc in reversed(self.started):
            p = svc.process
            if p is None or p.poll() is not None:
                if p is not None and not self.is_one_shot(svc) and strict:
                    problems.append(f"{svc.name} had already exited with {p.returncode}")
                continue
            grace = duration_s(svc.spec.get("stop_grace_period"), 10)
            p.send_signal(signal.SIGTERM)
            try:
                rc = p.wait(timeout=grace)
                if rc != 0:
                    problems.append(f"{svc.name} exited {rc} on SIGTERM\n{self.tail(svc)}")
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
                problems.append(f"{svc.name} still running {grace:.0f} s after SIGTERM (stop_grace_period)")
        if strict and problems:
            fail("; ".join(problems))
        if strict:
            log("every service stopped cleanly on SIGTERM (exit 0)")

    def cleanup(self):
        if self.args.keep:
            log(f"kept {self.work}")
        else:
            shutil.rmtree(self.work, ignore_errors=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compose", default=str(dc.SOURCE_DIR / "deploy" / "compose.cpu.yaml"))
    parser.add_argument("--bin-dir", default=None)
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory (logs, volumes)")
    args = parser.parse_args()
    run = ComposeRun(args)
    ok = False
    try:
        run.plan()
        log(f"services: {', '.join(run.order())}; not run (images): {', '.join(run.external) or 'none'}")
        run.run_all()
        run.check_ready()
        run.check_forward()
        run.check_metrics_and_prometheus()
        run.check_trust_boundaries()
        run.check_gateway_failover()
        run.check_grafana()
        run.stop(strict=True)
        ok = True
    except dc.CheckFailed as e:
        print(f"[compose-cpu] FAIL: {e}", file=sys.stderr)
    finally:
        run.stop(strict=False)
        if not ok:
            for svc in run.started:
                print(run.tail(svc, 15), file=sys.stderr)
        run.cleanup()
    print("[compose-cpu] PASS" if ok else "[compose-cpu] FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
