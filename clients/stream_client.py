#!/usr/bin/env python3
"""Stream a completion from a running specserve server over gRPC and print it as it arrives.

    python clients/stream_client.py "def fibonacci(n):" --max-tokens 64 --spec-method ngram
    python clients/stream_client.py "Hello" --url localhost:8001 --temperature 0.8 --seed 1
    python clients/stream_client.py "def add(a, b):" --model llm_vip     # a service tier's ensemble

Prints the text piece by piece, then the finish reason and the speculative-decoding stats.
"""

from __future__ import annotations

import argparse
import json
import sys

from specserve.triton.client import CompletionError, StreamClient


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("prompt")
    p.add_argument("--url", default="localhost:8001", help="the server's gRPC address")
    p.add_argument("--model", default="llm", help="the ensemble: llm (default tier) or llm_<tier>")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--spec-method", default=None, help="none, ngram, … (default: the server's)")
    args = p.parse_args(argv)
    params = {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p,
              "top_k": args.top_k}
    if args.seed is not None:
        params["seed"] = args.seed
    if args.spec_method:
        params["spec_method"] = args.spec_method
    client = StreamClient(args.url, args.model)
    try:
        out = client.generate(args.prompt, params, on_chunk=lambda piece: print(piece, end="", flush=True))
    except CompletionError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        client.close()
    print(f"\n--- finish_reason={out.finish_reason} tokens={out.num_output_tokens} "
          f"ttft={out.ttft_s * 1000:.0f} ms total={out.total_s * 1000:.0f} ms")
    print("spec_stats:", json.dumps(out.spec_stats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
