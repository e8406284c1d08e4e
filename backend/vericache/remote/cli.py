"""``vericache prefix put|get|ls|rm``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from vericache.cli_args import add_model_args


def _store(args):
    from vericache.engine.config import MODEL_FIELDS, EngineConfig
    from vericache.remote.prefixes import model_id
    from vericache.remote.store import PrefixStore

    loaded = EngineConfig.from_args(args, only=MODEL_FIELDS).load_model()   # --kernels, --numerics too
    return loaded, PrefixStore(args.redis, model_id(loaded), args.block_tokens)


def _prompt_ids(args, loaded) -> list[int]:
    if bool(args.prompt) == bool(args.prompt_file):
        raise ValueError("give exactly one of --prompt and --prompt-file")
    text = args.prompt if args.prompt else Path(args.prompt_file).read_text()
    return loaded.tokenizer.encode(text)


def _cmd_prefix(args: argparse.Namespace) -> int:
    from vericache.engine.engine import Engine
    from vericache.remote.prefixes import describe, put_prompt

    loaded, store = _store(args)
    if args.action == "put":
        out = put_prompt(Engine(loaded, mode="full"), store, _prompt_ids(args, loaded), args.compressor or [])
    elif args.action == "get":
        out = describe(store, _prompt_ids(args, loaded), args.compressor or [])
    elif args.action == "ls":
        out = {"redis": store.version(), "model_id": store.model_id, "masters": store.masters(), "prefixes": store.ls()}
    else:
        if not args.id and not args.all:
            raise ValueError("prefix rm needs --id ID (from prefix ls) or --all")
        out = {"deleted_keys": store.rm(None if args.all else args.id)}
    print(json.dumps(out, indent=None if args.json else 2))
    return 0


def _add_prefix(sub) -> None:
    p = sub.add_parser("prefix", help="the prefix KV store: put, get (what a prompt hits), ls, rm")
    p.add_argument("action", choices=["put", "get", "ls", "rm"])
    p.add_argument("--redis", default="redis://127.0.0.1:6379", help="redis://host:port of the store")
    add_model_args(p)
    p.add_argument("--prompt", default=None)
    p.add_argument("--prompt-file", default=None)
    p.add_argument("--compressor", action="append", default=None,
                   help="also store this compressor's form (repeatable), e.g. snapkv:ratio=0.125")
    p.add_argument("--block-tokens", type=int, default=256)
    p.add_argument("--id", default=None, help="rm: the prefix id (from ls)")
    p.add_argument("--all", action="store_true", help="rm: every prefix of this model")
    p.add_argument("--json", action="store_true", help="one-line JSON")
    p.set_defaults(func=_cmd_prefix)


def add_remote_parsers(sub) -> None:
    _add_prefix(sub)
