#!/usr/bin/python3
"""Static checks of deploy/compose.yaml (8-GPU host) and deploy/compose.cpu.yaml, as compose
resolves them (`docker-compose config`, offline). compose.cpu.yaml is also run for real by
compose_cpu_test.py; compose.yaml cannot run here (no GPU, no Docker), so this is its check:

  - every service of ours runs an image binary with flags its --help knows;
  - the gateway waits for as many ranks (--ranks) as there are rank services, which claim
    --rank 0..N-1 once each and reach the gateway at service:port where it listens;
  - GPU file: the gateway and each rank reserve exactly one distinct GPU (driver nvidia,
    capabilities [gpu]); ipc: host and a shm_size; the documented NCCL_* knobs are set;
    --transport defaults to nccl and follows MOE_TRANSPORT;
  - the checkpoint is mounted read-only where --checkpoint points (ranks read the gateway's path);
  - published ports are ports the command listens on;
  - ranks depend on the gateway being healthy, and the health checks are the ones
    compose_cpu_test.py exercises on the CPU file (the gateway's accepts NOT_SERVING: it only turns
    SERVING after the ranks registered, so a SERVING check would deadlock);
  - the mounted Prometheus config scrapes the gateway's and every rank's --metrics-port.

usage: check_compose.py [--bin-dir DIR] [--source-dir DIR]
"""

import re
import sys
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
    def __init__(self, path, bindir, f, env=None):
        self.path = path
        self.bindir = bindir
        self.f = f
        self.config = dc.compose_config(path, env)
        self.services = {}
        self.external = {}
        for name, spec in self.config["services"].items():
            image = str(spec.get("image", ""))
            if image.startswith(("prom/prometheus", "grafana/grafana")):
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
        for flag in ("port", "metrics-port"):
            v = dc.flag_value(self.bindir, binary, values, flag)
            if v is not None and re.fullmatch(r"[0-9]+", v) and int(v) > 0:
                ports.add(int(v))
        return ports

    def of(self, binary):
        return {n: s for n, s in self.services.items() if s[1] == binary}

    def check(self, gpu):
        f, where = self.f, self.path.name
        gateways = self.of("moe-gateway")
        ranks = self.of("moe-rank")
        if not f.check(len(gateways) == 1, f"{where}: {len(gateways)} gateway services, expected 1"):
            return
        (gw_name, (gw_spec, _, gw_values)), = gateways.items()
        gw_port = int(dc.flag_value(self.bindir, "moe-gateway", gw_values, "port"))
        want = int(gw_values.get("ranks", "1"))
        f.check(len(ranks) == want, f"{where}: gateway --ranks {want}, {len(ranks)} rank services")
        claimed = sorted(int(v.get("rank", "-1")) for _, _, v in ranks.values())
        f.check(claimed == list(range(want)), f"{where}: ranks claim {claimed}, expected 0..{want - 1}")
        checkpoint = gw_values.get("checkpoint", "")
        for name, (spec, binary, values) in self.services.items():
            sw = f"{where} service {name}"
            for entry in spec.get("ports", []):
                _, target = dc.parse_port(entry)
                f.check(target in self.listen_ports(name), f"{sw}: publishes {target}, listens on "
                        f"{sorted(self.listen_ports(name))}")
            if binary == "moe-rank":
                m = re.fullmatch(r"([A-Za-z0-9_.-]+):([0-9]+)", values.get("gateway", ""))
                f.check(m is not None and m.group(1) == gw_name and int(m.group(2)) == gw_port,
                        f"{sw}: --gateway {values.get('gateway')}, the gateway is {gw_name}:{gw_port}")
                dep = (spec.get("depends_on") or {}).get(gw_name) or {}
                f.check(dep.get("condition") == "service_healthy",
                        f"{sw}: should depend on {gw_name} with condition service_healthy")
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
        self.check_prometheus()
        return gw_name

    def check_prometheus(self):
        f, where = self.f, self.path.name
        proms = [s for s in self.external.values() if str(s.get("image", "")).startswith("prom/prometheus")]
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
        gpu = ComposeFile(source / "deploy" / "compose.yaml", bindir, f)
        gpu.check(gpu=True)
        cpu = ComposeFile(source / "deploy" / "compose.cpu.yaml", bindir, f)
        cpu.check(gpu=False)
        # The GPU file's health checks are the ones the CPU drift test runs (ports aside).
        for binary in ("moe-gateway", "moe-rank"):
            g = {normalized_healthcheck(s[0]) for s in gpu.of(binary).values()}
            c = {normalized_healthcheck(s[0]) for s in cpu.of(binary).values()}
            f.check(g == c and len(g) == 1, f"{binary} healthchecks differ between compose.yaml {g} and "
                    f"compose.cpu.yaml {c} (only the CPU file's run in compose_cpu_test.py)")
        # MOE_TRANSPORT switches the GPU file's transport.
        grpc = ComposeFile(source / "deploy" / "compose.yaml", bindir, f, env={"MOE_TRANSPORT": "grpc"})
        (_, (_, _, values)), = grpc.of("moe-gateway").items()
        f.check(values.get("transport") == "grpc", "MOE_TRANSPORT=grpc does not reach the gateway's --transport")
    except dc.CheckFailed as e:
        f.add(str(e))
    f.finish(f"compose.yaml: gateway + {len(gpu.of('moe-rank'))} ranks on distinct GPUs; compose.cpu.yaml: gateway + "
             f"{len(cpu.of('moe-rank'))} ranks; flags, ranks, mounts, ports, health checks and scrape targets agree")


if __name__ == "__main__":
    main()
