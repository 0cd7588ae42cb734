#!/usr/bin/python3
"""Offline checks of docker/Dockerfile (GPU) and docker/Dockerfile.cpu (no Docker engine here).

  - stages: FROM images (after ARG substitution) are the CUDA 13 devel/runtime Ubuntu 24.04 images
    and debian:12 / debian:12-slim; the runtime stage copies from the build stage;
  - the build stage installs every package of scripts/install-deps.sh's "build" and "service
    stack" groups (the two lists stay in step);
  - the build context: each COPY source exists and is not excluded by .dockerignore (nor is any
    git-tracked file under it), and the COPY'd directories are everything the top-level
    CMakeLists.txt adds (so the image builds what the tree builds);
  - the configure step's -D options are options of the project (or CMake's), the --target names
    are executables of the project, and the runtime stage ships exactly those binaries;
  - runtime: numeric non-root USER 10001, EXPOSE 50051 9400 and not the gateway's control port
    (`docker run -P` publishes every EXPOSEd port), tini ENTRYPOINT, a CMD;
  - the HEALTHCHECK, run under /bin/sh with a stub moe-client: plaintext
    `moe-client health --target 127.0.0.1:50051` by default, MOE_PORT moves it, MOE_HEALTH_TLS_CA
    adds --tls-ca and MOE_HEALTH_TLS_CERT/KEY a client certificate (paths with spaces intact),
    every call parses against moe-client's --help, and moe-client's exit 2 becomes 1;
  - docker/runtime-packages.sh, run on the build tree's binaries, names installed packages that
    own every library they load (the runtime stage installs that list);
  - --configure: the build stage's sources (exactly the COPY'd paths, .dockerignore applied) are
    configured here with the Dockerfile's own cmake command; the CPU image's always, the GPU
    image's when /usr/local/cuda/bin/nvcc exists (it must print "CUDA backend: ON").

usage: check_docker.py [--bin-dir DIR] [--source-dir DIR] [--configure]
"""

import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import deploy_common as dc  # noqa: E402

EXPECTED_FROM = {
    "Dockerfile": ("nvidia/cuda:13.0.0-devel-ubuntu24.04", "nvidia/cuda:13.0.0-runtime-ubuntu24.04"),
    "Dockerfile.cpu": ("debian:12", "debian:12-slim"),
}


def install_deps_groups(source):
    """{group comment: [packages]} of scripts/install-deps.sh's PACKAGES array."""
    text = (source / "scripts" / "install-deps.sh").read_text()
    body = re.search(r"PACKAGES=\((.*?)\n\)", text, re.S).group(1)
    groups, current = {}, None
    for line in body.splitlines():
        line = line.strip()
        if line.startswith("#"):
            current = line.lstrip("# ").strip()
            groups[current] = []
        elif line and current:
            groups[current] += line.split()
    return groups


class DockerIgnore:
    def __init__(self, path):
        self.rules = []
        if path.exists():
            for line in path.read_text().splitlines():
                line = line.strip()
                if not line or line.startswith("#"):
                    continue
                negate = line.startswith("!")
                pattern = line.lstrip("!").strip("/")
                self.rules.append((negate, pattern))

    def ignored(self, rel):
        """Docker's rule: the last matching pattern wins; a pattern matching a parent directory
        excludes what is under it."""
        parts = rel.split("/")
        result = False
        for negate, pattern in self.rules:
            for i in range(1, len(parts) + 1):
                prefix = "/".join(parts[:i])
                regex = re.escape(pattern).replace(r"\*\*/", "(.*/)?").replace(r"\*\*", ".*") \
                    .replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
                if re.fullmatch(regex, prefix):
                    result = not negate
                    break
        return result


def stages(instructions):
    """[(from image, alias, [instructions])], ARGs before the first FROM substituted."""
    args, out = {}, []
    for instruction, rest in instructions:
        if instruction == "ARG" and not out:
            name, _, default = rest.partition("=")
            args[name] = default
            continue
        if instruction == "FROM":
            words = rest.split()
            image = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), ""), words[0])
            alias = words[2] if len(words) > 2 and words[1].upper() == "AS" else None
            out.append((image, alias, []))
        elif out:
            out[-1][2].append((instruction, rest))
    return out


def apt_packages(run_text):
    packages = set()
    for m in re.finditer(r"apt-get install ([^&;|]*)", run_text):
        packages |= {w for w in m.group(1).split() if not w.startswith("-") and not w.startswith("$")}
    return packages


class Checker:
    def __init__(self, source, bindir, configure):
        self.source = source
        self.bindir = bindir
        self.configure = configure
        self.f = dc.Failures("check_docker")
        self.ignore = DockerIgnore(source / ".dockerignore")
        self.tracked = subprocess.run(["git", "-C", str(source), "ls-files"], capture_output=True, text=True
                                      ).stdout.split()
        self.notes = []

    def cmake_subdirs(self):
        text = (self.source / "CMakeLists.txt").read_text()
        dirs = set(re.findall(r"add_subdirectory\((\w+)\)", text))
        for m in re.finditer(r"foreach\(\w+ ([^)]*)\)", text):
            dirs |= set(m.group(1).split())
        return dirs

    def project_options(self):
        options = set()
        for path in [self.source / "CMakeLists.txt"] + list((self.source / "cmake").glob("*.cmake")):
            options |= set(re.findall(r"option\((\w+)", path.read_text()))
            options |= set(re.findall(r"set\((\w+) [^)]* CACHE ", path.read_text()))
        return options

    def project_executables(self):
        names = set()
        for path in self.source.rglob("CMakeLists.txt"):
            if "build" in path.relative_to(self.source).parts[0]:
                continue
            text = path.read_text()
            names |= set(re.findall(r"add_executable\(([\w-]+)", text))
            names |= set(re.findall(r"moe_add_tool\(([\w-]+)", text))
        return names

    def check_file(self, name):
        path = self.source / "docker" / name
        where = f"docker/{name}"
        st = stages(dc.dockerfile_instructions(path))
        f = self.f
        if not f.check(len(st) == 2, f"{where}: {len(st)} stages, expected build + runtime"):
            return
        (build_from, build_alias, build), (run_from, _, runtime) = st
        f.check((build_from, run_from) == EXPECTED_FROM[name],
                f"{where}: FROM {build_from} / {run_from}, expected {EXPECTED_FROM[name]}")
        f.check(all("--mount" not in rest for i, rest in build + runtime if i == "RUN"),
                f"{where}: RUN --mount needs BuildKit; keep the file valid for plain docker build")

        # Packages: the build stage mirrors install-deps.sh's build and service-stack groups.
        groups = install_deps_groups(self.source)
        wanted = set()
        for group, packages in groups.items():
            if group.startswith("build") or group.startswith("service stack"):
                wanted |= set(packages)
        f.check(bool(wanted), "scripts/install-deps.sh: no 'build' / 'service stack' groups found")
        installed = set()
        for instruction, rest in build:
            if instruction == "RUN":
                installed |= apt_packages(rest)
        missing = sorted(wanted - installed)
        f.check(not missing, f"{where}: the build stage does not install {missing} (scripts/install-deps.sh)")

        # Sources.
        copied = []
        for instruction, rest in build:
            if instruction == "COPY" and "--from" not in rest:
                words = shlex.split(rest)
                copied += [w.rstrip("/") for w in words[:-1]]
        for src in copied:
            p = self.source / src
            f.check(p.exists(), f"{where}: COPY {src}: not in the repository")
            f.check(not self.ignore.ignored(src), f"{where}: COPY {src} is excluded by .dockerignore")
            under = [t for t in self.tracked if t == src or t.startswith(src + "/")]
            excluded = [t for t in under if self.ignore.ignored(t)]
            f.check(not excluded, f"{where}: .dockerignore drops tracked files the build copies: {excluded[:5]}")
        top = {c.split("/")[0] for c in copied}
        needed = {"CMakeLists.txt", "cmake"} | {d for d in self.cmake_subdirs() if d != "tests"}
        f.check(needed <= top, f"{where}: the build does not COPY {sorted(needed - top)} (the top-level "
                "CMakeLists.txt adds them)")
        for instruction, rest in runtime:
            if instruction == "COPY" and "--from" not in rest:
                for src in shlex.split(rest)[:-1]:
                    f.check((self.source / src).exists() and not self.ignore.ignored(src),
                            f"{where}: runtime COPY {src} is missing or excluded by .dockerignore")

        # Configure and build commands.
        build_run = " ".join(rest for i, rest in build if i == "RUN" and "cmake -S" in rest)
        configure = re.search(r"(cmake -S .*?)(?:\||&&)", build_run)
        f.check(configure is not None, f"{where}: no cmake configure step")
        defines = re.findall(r"-D(\w+)=", build_run)
        options = self.project_options()
        for d in defines:
            f.check(d in options or d.startswith("CMAKE_"), f"{where}: -D{d} is not an option of the project")
        f.check("MOE_BUILD_TESTS" in defines, f"{where}: the image build should skip the tests (-DMOE_BUILD_TESTS=OFF)")
        cuda = re.search(r"-DMOE_ENABLE_CUDA=(\w+)", build_run)
        f.check(cuda is not None and cuda.group(1) == ("ON" if name == "Dockerfile" else "OFF"),
                f"{where}: MOE_ENABLE_CUDA should be {'ON' if name == 'Dockerfile' else 'OFF'}")
        targets = re.search(r"--target ([\w\s-]+?)(?:$|&&|\\)", build_run)
        targets = targets.group(1).split() if targets else []
        # The GPU image also builds the CUDA plugin the binaries load (transport/cuda_plugin.h).
        plugin = ["moe_cuda_plugin"] if name == "Dockerfile" else []
        f.check(sorted(targets) == sorted(list(dc.BINARIES) + plugin),
                f"{where}: builds {targets}, expected {list(dc.BINARIES) + plugin}")
        executables = self.project_executables()
        for t in targets:
            f.check(t in executables or t in plugin, f"{where}: --target {t} is not an executable of the project")
        staged = re.search(r"for b in ([\w\s.-]+); do", " ".join(rest for i, rest in build if i == "RUN"))
        staged_names = staged.group(1).split() if staged else []
        expected = sorted(t for t in targets if t not in plugin) + (["libmoe_cuda_plugin.so"] if plugin else [])
        f.check(staged is not None and sorted(staged_names) == sorted(expected),
                f"{where}: the files staged for the runtime ({staged_names}) differ from the ones built ({expected})")

        # Runtime stage.
        instr = {}
        for i, rest in runtime:
            instr.setdefault(i, []).append(rest)
        f.check(any("--from=" + (build_alias or "0") in r for r in instr.get("COPY", [])),
                f"{where}: the runtime copies nothing from the build stage")
        # OCI labels: the version is the project's, the revision the commit the binaries report.
        labels = dict(re.findall(r'(org\.opencontainers\.image\.\w+)="([^"]*)"', " ".join(instr.get("LABEL", []))))
        args = dict(a.split("=", 1) for a in instr.get("ARG", []) if "=" in a)
        version = re.search(r"project\([^)]*VERSION (\d+\.\d+\.\d+)", (self.source / "CMakeLists.txt").read_text())
        f.check(labels.get("org.opencontainers.image.version") == "${MOE_VERSION}" and version is not None
                and args.get("MOE_VERSION") == version.group(1),
                f"{where}: LABEL org.opencontainers.image.version must be ${{MOE_VERSION}}, its ARG default the "
                f"project's VERSION ({version.group(1) if version else '?'}), not {args.get('MOE_VERSION')}")
        for key in ("title", "description", "licenses"):
            f.check(labels.get(f"org.opencontainers.image.{key}"), f"{where}: no LABEL org.opencontainers.image.{key}")
        f.check(labels.get("org.opencontainers.image.revision") == "${MOE_COMMIT}",
                f"{where}: LABEL org.opencontainers.image.revision must be ${{MOE_COMMIT}}")
        f.check("-DMOE_GIT_COMMIT=${MOE_COMMIT}" in build_run,
                f"{where}: the build must pass -DMOE_GIT_COMMIT=${{MOE_COMMIT}} (the context has no .git)")
        user = (instr.get("USER") or [""])[-1].split(":")[0]
        f.check(user == "10001", f"{where}: USER {user}, expected the numeric uid 10001")
        f.check(any("10001" in r and "useradd" in r for r in instr.get("RUN", [])),
                f"{where}: no user with uid 10001 is created")
        exposed = set(" ".join(instr.get("EXPOSE", [])).split())
        f.check({"50051", "9400"} <= exposed, f"{where}: EXPOSE {sorted(exposed)}, expected 50051 9400")
        control = dc.binary_flags(self.bindir, "moe-gateway")["control-port"].default
        f.check(control not in exposed, f"{where}: EXPOSE {control}, the gateway's control port: `docker run -P` "
                "would publish it; keep it off published ports")
        hc = (instr.get("HEALTHCHECK") or [""])[-1]
        self.check_healthcheck(where, hc)
        entry = dc.exec_form((instr.get("ENTRYPOINT") or ["[]"])[-1]) or []
        f.check(bool(entry) and os.path.basename(entry[0]) == "tini", f"{where}: ENTRYPOINT {entry}, expected tini")
        cmd = dc.exec_form((instr.get("CMD") or ["[]"])[-1]) or []
        if f.check(bool(cmd), f"{where}: no CMD"):
            try:
                dc.parse_argv(self.bindir, cmd)
            except dc.CheckFailed as e:
                f.add(f"{where}: CMD {e}")
        f.check("tini" in " ".join(instr.get("RUN", [])), f"{where}: the runtime stage does not install tini")
        return configure.group(1).strip() if configure else None, copied

    def check_healthcheck(self, where, hc):
        """Runs the HEALTHCHECK's command under /bin/sh with a stub moe-client, for the default
        environment and the TLS variables."""
        f = self.f
        command = re.sub(r"^(--[a-z-]+=\S+\s+)*CMD\s+", "", hc)
        if not f.check(command != hc and "moe-client health" in command,
                       f"{where}: HEALTHCHECK should be `CMD moe-client health ...` (shell form)"):
            return
        cases = [
            ({}, ["--target", "127.0.0.1:50051"], 0),
            ({"MOE_PORT": "6000"}, ["--target", "127.0.0.1:6000"], 0),
            ({"MOE_HEALTH_TLS_CA": "/run/secrets/my ca.pem"},
             ["--target", "127.0.0.1:50051", "--tls-ca", "/run/secrets/my ca.pem"], 0),
            ({"MOE_PORT": "6001", "MOE_HEALTH_TLS_CA": "/s/ca.pem", "MOE_HEALTH_TLS_CERT": "/s/client.pem",
              "MOE_HEALTH_TLS_KEY": "/s/client.key"},
             ["--target", "127.0.0.1:6001", "--tls-ca", "/s/ca.pem", "--tls-cert", "/s/client.pem",
              "--tls-key", "/s/client.key"], 0),
        ]
        stubs = Path(tempfile.mkdtemp(prefix="moe-healthcheck-"))
        try:
            log = stubs / "calls"
            stub = stubs / "moe-client"
            stub.write_text(f'#!/bin/sh\nprintf "%s\\0" "$@" > "{log}"\nexit "${{STUB_RC:-0}}"\n')
            stub.chmod(0o755)
            base = {"PATH": f"{stubs}:/usr/bin:/bin"}
            for env, want, _ in cases:
                out = subprocess.run(["/bin/sh", "-c", command], env=dict(base, **env), capture_output=True, text=True,
                                     timeout=30)
                got = log.read_text().rstrip("\0").split("\0") if log.exists() else []
                log.unlink(missing_ok=True)
                if not f.check(out.returncode == 0, f"{where}: HEALTHCHECK with {env or 'no variables'} exited "
                               f"{out.returncode}: {out.stderr.strip()}"):
                    continue
                f.check(got[:1] == ["health"] and sorted(zip(got[1::2], got[2::2])) == sorted(zip(want[::2], want[1::2]))
                        and len(got) == len(want) + 1,
                        f"{where}: HEALTHCHECK with {env or 'no variables'} runs moe-client {got}, expected "
                        f"health {want}")
                try:
                    dc.parse_argv(self.bindir, ["moe-client"] + got)
                except dc.CheckFailed as e:
                    f.add(f"{where}: HEALTHCHECK: {e}")
            out = subprocess.run(["/bin/sh", "-c", command], env=dict(base, STUB_RC="2"), capture_output=True,
                                 text=True, timeout=30)
            f.check(out.returncode == 1, f"{where}: HEALTHCHECK exits {out.returncode} when moe-client exits 2 "
                    "(Docker reserves 2; map failures to 1)")
        finally:
            shutil.rmtree(stubs, ignore_errors=True)

    def runtime_packages(self):
        script = self.source / "docker" / "runtime-packages.sh"
        # "//abs/path": the per-binary headers ldd prints ("//abs/path/moe-gateway:") then sort
        # before every /lib path, as a build tree under /builds or /ci would; the script must skip
        # them (it once stopped at the first one and printed nothing).
        bins = ["/" + str((self.bindir / b).resolve()) for b in dc.BINARIES]
        out = subprocess.run([str(script)] + bins, capture_output=True, text=True, timeout=120)
        if not self.f.check(out.returncode == 0, f"runtime-packages.sh failed: {out.stderr.strip()}"):
            return
        packages = out.stdout.split()
        if not self.f.check(bool(packages), f"runtime-packages.sh printed no packages; stderr: {out.stderr.strip()}"):
            return
        for p in packages:
            q = subprocess.run(["dpkg-query", "-W", "-f=${Status}", p], capture_output=True, text=True)
            self.f.check("install ok installed" in q.stdout, f"runtime-packages.sh names {p}, which is not installed")
        for must in ("libc6", "libstdc++6"):
            self.f.check(must in packages, f"runtime-packages.sh misses {must}: {packages}")
        self.f.check(any(p.startswith("libgrpc++") for p in packages), f"runtime-packages.sh misses gRPC: {packages}")
        self.notes.append(f"runtime packages here: {' '.join(packages)}")

    def configure_stage(self, name, command, copied):
        """Configures exactly the build context the Dockerfile copies, with its cmake command."""
        work = Path(tempfile.mkdtemp(prefix="moe-docker-configure-"))
        try:
            src = work / "src"
            src.mkdir()
            for c in copied:
                for t in self.tracked:
                    if (t == c or t.startswith(c + "/")) and not self.ignore.ignored(t):
                        dst = src / t
                        dst.parent.mkdir(parents=True, exist_ok=True)
                        shutil.copy2(self.source / t, dst)
                # Untracked sources other engineers have not committed yet count as the tree.
                p = self.source / c
                if p.is_dir():
                    for q in p.rglob("*"):
                        rel = str(q.relative_to(self.source))
                        if q.is_file() and not self.ignore.ignored(rel) and not (src / rel).exists():
                            (src / rel).parent.mkdir(parents=True, exist_ok=True)
                            shutil.copy2(q, src / rel)
            argv = shlex.split(re.sub(r"\$\{(\w+)\}", lambda m: {"CUDA_ARCHITECTURES": "90"}.get(m.group(1), ""),
                                      command))
            out = subprocess.run(argv, cwd=src, capture_output=True, text=True, timeout=600)
            if not self.f.check(out.returncode == 0, f"docker/{name}: configure failed: {out.stderr[-2000:]}"):
                return
            if name == "Dockerfile":
                self.f.check("CUDA backend: ON" in out.stdout, f"docker/{name}: configure did not enable CUDA")
            targets = subprocess.run(["ninja", "-C", str(src / "build"), "-t", "targets", "all"],
                                     capture_output=True, text=True).stdout
            for b in dc.BINARIES:
                self.f.check(re.search(rf"(^|/)bin/{re.escape(b)}:", targets, re.M) is not None,
                             f"docker/{name}: the configured build has no target bin/{b}")
            self.notes.append(f"{name} build stage configured offline")
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def run(self):
        for name in ("Dockerfile", "Dockerfile.cpu"):
            result = self.check_file(name)
            if self.configure and result and result[0]:
                if name == "Dockerfile" and not Path("/usr/local/cuda/bin/nvcc").exists():
                    self.notes.append("Dockerfile (CUDA) not configured: no /usr/local/cuda/bin/nvcc here")
                else:
                    self.configure_stage(name, *result)
        self.runtime_packages()
        self.f.finish("; ".join(["both Dockerfiles consistent with the tree"] + self.notes))


def main():
    args, source, bindir = dc.parse_check_args(
        lambda parser: parser.add_argument("--configure", action="store_true"))
    try:
        Checker(source, bindir, args.configure).run()
    except dc.CheckFailed as e:
        print(f"check_docker: FAIL: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
