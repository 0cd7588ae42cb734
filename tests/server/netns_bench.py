#!/usr/bin/python3
"""Several hosts with real network stacks: a gateway and its ranks, each in a network namespace
this script creates (veth pairs, addresses only inside the namespaces, a tbf rate limit on each
link, both ways), torn down at the end, whatever happens.

On a Kimi K3-shaped layer (hidden 7168, latent 3584, 896 experts, top-16; the experts' hidden
size cut to keep the weights small: what crosses the network does not depend on it) it measures:
  - bytes per token between the gateway and the ranks, three ways: the model (each token's latent
    row, bf16, once to every rank hosting one of its experts (rank dedup) with its local expert
    ids and gates; an fp64 partial sum back from each), what the transports counted (the ranks'
    moe_transport_*_bytes_total), and what crossed the veths (the kernel's interface counters:
    TCP/IP, HTTP/2 and gRPC framing, heartbeats);
  - the step latency (p50 of the calls, and of the gateway's step time) at 10 and 25 Gbit/s and
    without a limit;
  - and checks every result bit for bit against moe-forward (the in-process layer).

Needs root (ip netns, tc). Without it, exits 77 (ctest: skipped), never counted as passed.

usage: netns_bench.py --bin-dir DIR [--ranks 4] [--tokens 64] [--requests 12] [--json FILE]
"""

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

SKIP = 77
HIDDEN, LATENT, EXPERTS, TOP_K = 7168, 3584, 896, 16


def sh(*argv, check=True, capture=False):
    return subprocess.run(argv, check=check, text=True,
                          stdout=subprocess.PIPE if capture else None,
                          stderr=subprocess.PIPE if capture else None)


class Topology:
    """A gateway namespace and one per rank, each rank joined to the gateway by a veth pair."""

    def __init__(self, ranks, tag):
        self.tag = tag
        self.gw = f"moegw{tag}"
        self.ranks = [f"moer{i}{tag}" for i in range(ranks)]
        self.links = []  # (gateway-side device, rank-side device, rank namespace)

    def create(self):
        sh("ip", "netns", "add", self.gw)
        sh("ip", "-n", self.gw, "link", "set", "lo", "up")
        for i, ns in enumerate(self.ranks):
            sh("ip", "netns", "add", ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            g, r = f"vg{i}{self.tag}"[:15], f"vr{i}{self.tag}"[:15]
            sh("ip", "link", "add", g, "netns", self.gw, "type", "veth", "peer", "name", r, "netns", ns)
            sh("ip", "-n", self.gw, "addr", "add", f"10.77.{i}.1/24", "dev", g)
            sh("ip", "-n", ns, "addr", "add", f"10.77.{i}.2/24", "dev", r)
            sh("ip", "-n", self.gw, "link", "set", g, "up")
            sh("ip", "-n", ns, "link", "set", r, "up")
            self.links.append((g, r, ns))

    def limit(self, rate):
        """tbf at `rate` (e.g. "10gbit") on both ends of every link; None removes the limits."""
        for g, r, ns in self.links:
            for netns, dev in ((self.gw, g), (ns, r)):
                sh("ip", "netns", "exec", netns, "tc", "qdisc", "del", "dev", dev, "root", check=False,
                   capture=True)
                if rate:
                    # burst: a few ms at the rate, so the bucket never throttles below it
                    sh("ip", "netns", "exec", netns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                       "rate", rate, "burst", "4mb", "latency", "50ms")

    def wire_bytes(self):
        """Bytes the gateway's veths sent and received, all links."""
        total = 0
        for g, _, _ in self.links:
            out = sh("ip", "netns", "exec", self.gw, "cat", f"/sys/class/net/{g}/statistics/tx_bytes",
                     capture=True).stdout
            inn = sh("ip", "netns", "exec", self.gw, "cat", f"/sys/class/net/{g}/statistics/rx_bytes",
                     capture=True).stdout
            total += int(out) + int(inn)
        return total

    def destroy(self):
        for ns in [self.gw] + self.ranks:
            subprocess.run(["ip", "netns", "del", ns], stderr=subprocess.DEVNULL)


def metric_sum(text, name):
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin-dir", required=True)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--json")
    args = ap.parse_args()
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        print("netns_bench: needs root with ip and tc (network namespaces): skipped")
        return SKIP
    probe = subprocess.run(["ip", "netns", "add", f"moeprobe{os.getpid()}"], capture_output=True)
    if probe.returncode != 0:
        print(f"netns_bench: cannot create a network namespace ({probe.stderr.decode().strip()}): skipped")
        return SKIP
    subprocess.run(["ip", "netns", "del", f"moeprobe{os.getpid()}"])

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(args.bin_dir)), "python"))
    import grpc  # noqa: E402
    from moe.v1 import moe_pb2, moe_pb2_grpc  # noqa: E402

    tmp = tempfile.mkdtemp(prefix="moe-netns-")
    topo = Topology(args.ranks, os.getpid() % 100000)
    procs = []
    failures = []
    try:
        ckpt = os.path.join(tmp, "k3-wire")
        sh(os.path.join(args.bin_dir, "moe-ckpt"), "--preset", "kimi-k3", "--out", ckpt, "--layers", "1",
           "--expert-hidden", "64", "--quiet", "--seed", "5", capture=True)
        token = os.path.join(tmp, "cluster-token")
        with open(token, "w") as f:
            f.write(os.urandom(16).hex())
        topo.create()
        port, control = 50051, 50052
        log = lambda name: open(os.path.join(tmp, f"{name}.log"), "w")  # noqa: E731
        procs.append(subprocess.Popen(
            ["ip", "netns", "exec", topo.gw, os.path.join(args.bin_dir, "moe-gateway"), "--checkpoint", ckpt,
             "--ranks", str(args.ranks), "--host", "0.0.0.0", "--port", str(port), "--control-port", str(control),
             "--cluster-token-file", token, "--threads", "1", "--max-wait-us", "0"],
            stdout=subprocess.DEVNULL, stderr=log("gateway")))
        for i, ns in enumerate(topo.ranks):
            procs.append(subprocess.Popen(
                ["ip", "netns", "exec", ns, os.path.join(args.bin_dir, "moe-rank"), "--gateway",
                 f"10.77.{i}.1:{control}", "--rank", str(i), "--cluster-token-file", token, "--threads", "1",
                 "--metrics-port", "9400", "--metrics-host", "127.0.0.1"],
                stdout=subprocess.DEVNULL, stderr=log(f"rank{i}")))
        # The client runs in the gateway's namespace: its calls do not cross the veths.
        env = dict(os.environ)
        client = [os.path.join(args.bin_dir, "moe-client")]
        health = sh("ip", "netns", "exec", topo.gw, *client, "health", "--target", f"127.0.0.1:{port}",
                    "--wait-s", "180", check=False, capture=True)
        if "SERVING" not in health.stdout:
            raise RuntimeError(f"gateway not serving: {health.stdout} {health.stderr}\n" +
                               open(os.path.join(tmp, "gateway.log")).read())

        # Inputs and the in-process reference.
        rng = np.random.default_rng(7)
        inputs = [rng.standard_normal((args.tokens, HIDDEN)).astype(np.float32) for _ in range(3)]
        expected = []
        for i, x in enumerate(inputs):
            xi, yi = os.path.join(tmp, f"x{i}.npy"), os.path.join(tmp, f"y{i}.npy")
            np.save(xi, x)
            sh(os.path.join(args.bin_dir, "moe-forward"), "--checkpoint", ckpt, "--layer", "1", "--input", xi,
               "--output", yi, capture=True)
            expected.append(np.load(yi))

        def run_calls():
            """args.requests calls from inside the gateway's namespace; their latencies."""
            script = f"""
import sys, time, json, numpy as np
sys.path.insert(0, {os.path.join(os.path.dirname(os.path.abspath(args.bin_dir)), 'python')!r})
import grpc
from moe.v1 import moe_pb2, moe_pb2_grpc
ch = grpc.insecure_channel('127.0.0.1:{port}', options=[('grpc.max_send_message_length', 1 << 30),
                                                     ('grpc.max_receive_message_length', 1 << 30)])
stub = moe_pb2_grpc.MoeServiceStub(ch)
out = []
for i in range({args.requests}):
    x = np.load({tmp!r} + '/x%d.npy' % (i % 3))
    req = moe_pb2.ForwardRequest(layer=1, return_routing=True, output_dtype=moe_pb2.FP32,
        hidden_states=moe_pb2.Tensor(dtype=moe_pb2.FP32, shape=list(x.shape), data=x.tobytes()))
    t = time.perf_counter()
    r = stub.Forward(req, timeout=120)
    ms = (time.perf_counter() - t) * 1e3
    y = np.frombuffer(r.output.data, dtype=np.float32).reshape(x.shape)
    np.save({tmp!r} + '/got%d.npy' % i, y)
    out.append({{'ms': ms, 'step_us': r.timing.step_us, 'ids': list(r.routing.expert_ids)}})
print(json.dumps(out))
"""
            res = sh("ip", "netns", "exec", topo.gw, sys.executable, "-c", script, capture=True)
            return json.loads(res.stdout)

        def rank_bytes():
            total = 0.0
            for ns in topo.ranks:
                text = sh("ip", "netns", "exec", ns, "curl", "-s", "--max-time", "5",
                          "http://127.0.0.1:9400/metrics", capture=True).stdout
                total += metric_sum(text, "moe_transport_gateway_to_rank_bytes_total")
                total += metric_sum(text, "moe_transport_rank_to_gateway_bytes_total")
            return total

        per_rank = EXPERTS // args.ranks
        rows = []
        for rate in (None, "25gbit", "10gbit"):
            topo.limit(rate)
            run_calls()  # warm, and the connections past slow start
            counted0, wire0 = rank_bytes(), topo.wire_bytes()
            calls = run_calls()
            counted, wire = rank_bytes() - counted0, topo.wire_bytes() - wire0
            for i, c in enumerate(calls):
                got = np.load(os.path.join(tmp, f"got{i}.npy"))
                if not np.array_equal(got, expected[i % 3]):
                    failures.append(f"{rate or 'unlimited'} call {i}: result differs from moe-forward")
            # The model: per token, each distinct rank of its top-k gets its latent row (bf16)
            # with 8 bytes per choice (id, gate) and 4 of row offset, and returns an fp64 row.
            model = 0
            visits = 0
            for c in calls:
                ids = np.array(c["ids"]).reshape(args.tokens, TOP_K)
                for row in ids:
                    hit = {}
                    for e in row:
                        hit[e // per_rank] = hit.get(e // per_rank, 0) + 1
                    visits += len(hit)
                    model += sum(LATENT * 2 + 8 * n + 4 + LATENT * 8 for n in hit.values())
            tokens = args.tokens * len(calls)
            rows.append({
                "link": rate or "unlimited", "tokens_per_call": args.tokens,
                "model_bytes_per_token": model / tokens, "counted_bytes_per_token": counted / tokens,
                "wire_bytes_per_token": wire / tokens, "ranks_per_token": visits / tokens,
                "call_ms_p50": statistics.median(c["ms"] for c in calls),
                "step_ms_p50": statistics.median(c["step_us"] for c in calls) / 1e3,
            })
        topo.limit(None)
        print(f"netns bench: Kimi K3-shaped layer (hidden {HIDDEN}, latent {LATENT}, {EXPERTS} experts, top-{TOP_K}), "
              f"{args.ranks} ranks in namespaces of their own, {args.tokens} tokens per call, "
              f"{args.requests} calls per row; every result bit-identical to moe-forward: "
              f"{'no' if failures else 'yes'}")
        print(f"{'link':>10} {'ranks/token':>11} {'model B/token':>14} {'counted B/token':>16} "
              f"{'wire B/token':>13} {'call ms p50':>12} {'step ms p50':>12}")
        for r in rows:
            print(f"{r['link']:>10} {r['ranks_per_token']:>11.2f} {r['model_bytes_per_token']:>14.0f} "
                  f"{r['counted_bytes_per_token']:>16.0f} {r['wire_bytes_per_token']:>13.0f} "
                  f"{r['call_ms_p50']:>12.1f} {r['step_ms_p50']:>12.1f}")
        for r in rows:
            # The transports' count is the model plus protobuf framing (a few bytes per message).
            if not (0.99 * r["model_bytes_per_token"] <= r["counted_bytes_per_token"] <=
                    1.05 * r["model_bytes_per_token"]):
                failures.append(f"{r['link']}: counted {r['counted_bytes_per_token']:.0f} B/token, "
                                f"the model {r['model_bytes_per_token']:.0f}")
            if r["wire_bytes_per_token"] < r["counted_bytes_per_token"]:
                failures.append(f"{r['link']}: fewer bytes on the wire than the transports counted")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"ranks": args.ranks, "rows": rows}, f, indent=1)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        topo.destroy()
        left = [ns for ns in [topo.gw] + topo.ranks
                if ns in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout]
        if left:
            failures.append(f"namespaces left behind: {left}")
        shutil.rmtree(tmp, ignore_errors=True)
    for f in failures:
        print(f"netns_bench: FAIL: {f}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
