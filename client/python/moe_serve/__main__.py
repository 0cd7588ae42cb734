"""python3 -m moe_serve: one forward, health or info from the command line.

    python3 -m moe_serve --target HOST:PORT --layer L --input x.npy --output y.npy
                         [--dtype bf16|fp16|fp32] [--output-dtype ...] [--routing-out ids.npy]
    python3 -m moe_serve --target HOST:PORT --health | --info
"""

import argparse
import sys
from typing import List, Optional

import numpy as np

from ._tensors import DTYPES, FloatArray
from .client import MoeClient, MoeError


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="moe_serve", description="moe.v1 client: one forward, health or info")
    parser.add_argument("--target", required=True, help="HOST:PORT")
    parser.add_argument("--layer", type=int)
    parser.add_argument("--input", help="input .npy, float16/32/64, [T, H] or [B, T, H]")
    parser.add_argument("--output", help="output .npy (float32, or float16 for an fp16 output)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="wire dtype (default: fp16 for a float16 input, else fp32)")
    parser.add_argument("--output-dtype", choices=sorted(DTYPES), help="wire dtype of the output (default: --dtype)")
    parser.add_argument("--routing-out", help="expert ids [tokens, top_k] (int32 .npy)")
    parser.add_argument("--routing-weights-out", help="routing weights [tokens, top_k] (.npy)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds")
    parser.add_argument("--health", action="store_true", help="print the health status")
    parser.add_argument("--info", action="store_true", help="print the model info")
    parser.add_argument("--tls", action="store_true", help="TLS with the system's roots")
    parser.add_argument("--tls-ca", help="PEM CA bundle the gateway's certificate chains to")
    parser.add_argument("--tls-cert", help="PEM client certificate (mTLS)")
    parser.add_argument("--tls-key", help="PEM private key of --tls-cert")
    parser.add_argument("--tls-server-name", help="name the gateway's certificate must carry")
    parser.add_argument("--token-file", help="send its token as `authorization: Bearer`")
    args = parser.parse_args(argv)
    with MoeClient(args.target, tls=args.tls, tls_ca=args.tls_ca, tls_cert=args.tls_cert,
                   tls_key=args.tls_key, tls_server_name=args.tls_server_name,
                   token_file=args.token_file) as client:
        try:
            if args.health:
                status = client.health()
                print(status)
                return 0 if status == "SERVING" else 1
            if args.info:
                print(client.info(), end="")
                return 0
            if args.layer is None or not args.input or not args.output:
                parser.error("forward needs --layer, --input and --output")
            x: FloatArray = np.load(args.input)
            want_routing = bool(args.routing_out or args.routing_weights_out)
            y, routing = client.forward(args.layer, x, dtype=args.dtype, output_dtype=args.output_dtype,
                                        return_routing=want_routing, timeout=args.timeout)
        except (MoeError, TypeError, ValueError) as e:  # the call's, or an input it does not take
            print(f"moe_serve: {e}", file=sys.stderr)
            return 1
    np.save(args.output, y)
    if args.routing_out and routing is not None:
        np.save(args.routing_out, routing.expert_ids)
    if args.routing_weights_out and routing is not None:
        np.save(args.routing_weights_out, routing.weights)
    return 0


if __name__ == "__main__":
    sys.exit(main())
