"""``vericache serve``: the gateway's command (the OpenAI-compatible server, or a remote role)."""

from __future__ import annotations

import argparse

from vericache.engine.config import EngineConfig, add_engine_args


def _cmd_serve(args: argparse.Namespace) -> int:
    config = EngineConfig.from_args(args)
    if args.role == "verifier":
        from vericache.serving.verifier_role import run_verifier

        run_verifier(config, args.host, args.grpc_port, args.prefix_store, args.store_prefixes,
                     args.metrics_port, trace=args.trace)
        return 0
    if args.role == "drafter" and not args.verifier:
        raise ValueError("--role drafter needs --verifier grpc://host:port")
    try:  # deferred: ``vericache --help`` works without the serve extra
        from vericache_gateway.server import serve
    except ImportError as exc:
        raise ValueError(f"the gateway needs the 'serve' extra (pip install 'vericache[serve]'): {exc}") from None
    serve(config, host=args.host, port=args.port, api_key=args.api_key, backend=args.backend,
          triton_url=args.triton_url, prefix_store=args.prefix_store, prefix_link=args.prefix_link,
          verifier=args.verifier if args.role == "drafter" else None, prefix_model_id=args.prefix_model_id,
          trace=args.trace, max_per_key=args.max_concurrent_per_key)
    return 0


def add_serve_parser(sub) -> None:
    """``vericache serve``: added to the library's command line through the "vericache.commands"
    entry point (pyproject.toml), so the library never imports the gateway."""
    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP gateway over the engine")
    add_engine_args(sv)   # every engine flag, with EngineConfig's defaults
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--backend", default="embedded", choices=["embedded", "triton"])
    sv.add_argument("--triton-url", default="127.0.0.1:8001", help="gRPC address of the Triton server")
    sv.add_argument("--api-key", default=None, help="require this bearer key (or set VERICACHE_API_KEY)")
    sv.add_argument("--max-concurrent-per-key", type=int, default=0,
                    help="generations one API key may have running at once; more get 429 + Retry-After (0: no limit)")
    sv.add_argument("--role", default="single", choices=["single", "drafter", "verifier"],
                    help="single: one engine; drafter: vericache requests verified by --verifier; "
                         "verifier: a gRPC verifier next to the prefix store (on --grpc-port)")
    sv.add_argument("--verifier", action="append", default=None,
                    help="grpc://host:port of a verifier (drafter role); repeat for a pool: each prefix goes to one by "
                         "rendezvous hashing, and a request whose verifier dies moves to the next")
    sv.add_argument("--prefix-store", default=None, help="redis://host:port of the prefix KV store")
    sv.add_argument("--prefix-link", default="local", help="label of the link to the store in metrics (slow, fast)")
    sv.add_argument("--store-prefixes", action="store_true",
                    help="verifier role: store the whole blocks of the prompts it serves")
    sv.add_argument("--prefix-model-id", default=None,
                    help="the id the store and verifier know this model's KV by (default: name-dtype-kvdtype); "
                         "a drafter in another dtype than its verifier gives the verifier's")
    sv.add_argument("--grpc-port", type=int, default=50051, help="verifier role: the gRPC port")
    sv.add_argument("--metrics-port", type=int, default=0, help="verifier role: Prometheus port (0: none)")
    sv.add_argument("--trace", default=None, help="also write the engine's events to this JSON-lines file "
                                                  "(wall-clock times: the timelines of several processes line up)")
    sv.set_defaults(func=_cmd_serve)
