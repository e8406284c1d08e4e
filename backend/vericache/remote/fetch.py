"""The drafter's prefix fetches: from the store, over the drafter's (slow) link, in background
threads so the engine keeps stepping other requests meanwhile.

``form``: "full" (full-remote: the whole KV crosses the slow link) or a compressor spec (the
drafter's compressed form). A store that is down, or a block that is missing or corrupt, is not
an error: the result says how many leading blocks arrived, and the engine computes the rest.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from vericache.remote.store import Fetched, PrefixStore, StoreUnavailable

log = logging.getLogger("vericache.prefix")


class PrefixFetcher:
    def __init__(self, store: PrefixStore, link: str = "slow", workers: int = 4) -> None:
        self.store, self.link = store, link
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="vericache-fetch")
        self.wake = threading.Event()
        self.events: list[tuple[str, dict]] = []   # drained by the metrics exporter

    def max_blocks(self, prompt_len: int) -> int:
        """Leading blocks worth fetching: the prompt's last token is always computed (its logits)."""
        return (prompt_len - 1) // self.store.block_tokens

    def fetch(self, token_ids: list[int], form: str, device: torch.device | str) -> Future:
        """Start fetching; the future gives a ``Fetched`` (never raises for a store outage)."""
        limit = self.max_blocks(len(token_ids))
        fut = self.pool.submit(self._get, list(token_ids), form, limit, device)
        fut.add_done_callback(lambda _: self.wake.set())
        return fut

    def _get(self, ids: list[int], form: str, limit: int, device) -> Fetched:
        tier = "full" if form == "full" else "compressed"
        try:
            got = self.store.get(ids, form, limit, device)
        except StoreUnavailable as exc:
            log.warning("%s; recomputing the prompt", exc)
            self.events.append(("store_error", {"role": "drafter"}))
            return Fetched([], 0, 0.0, "unavailable")
        if got.reason == "unavailable":
            log.warning("the prefix store went away after %d of %d blocks; computing from block %d", len(got.blocks),
                        limit, len(got.blocks))
            self.events.append(("store_error", {"role": "drafter"}))
        elif got.reason in ("corrupt", "partial") or (got.reason == "miss" and limit):
            log.info("prefix fetch: %d of %d blocks (%s); computing from block %d", len(got.blocks), limit,
                     got.reason, len(got.blocks))
        self.events.append(("prefix", {"link": self.link, "tier": tier, "bytes": got.nbytes, "seconds": got.seconds,
                                       "hit_blocks": len(got.blocks), "miss_blocks": limit - len(got.blocks),
                                       "end": time.time()}))
        return got

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
