"""Where a request lives, decided once when it is added (``place``), asked by every other part.

A request's mode (full, lossy, vericache) and the home of its full KV decide:
  which caches it allocates and on which tier (``KVMemory.allocate``),
  the device bytes it holds at its longest and for a while (admission control),
  which cache each row kind attends through (``prefill_cache``, ``decode_cache``),
  whether its rounds are verified here, after a transfer, or elsewhere,
  and the state it moves to once its prompt is in (``after_prefill``).

    mode        home      caches here                                   after prefill
    full        DEVICE    full (device)                                 decoding
    lossy       DEVICE    draft (device)                                decoding
    vericache   DEVICE    full + draft (device): verified in place      drafting
    vericache   HOST      draft + resident layers (device), full (host) drafting (rounds cross the link)
    vericache   REMOTE    draft (device): the full KV is at the verifier drafting once its first token lands
    full        SESSION   full (device): a remote drafter's verifier    serving

This is the one module that compares a request's mode; the scheduler, memory, the remote half and
the stats ask a ``Placement``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from vericache.engine.options import check_mode


class Home(StrEnum):
    DEVICE = "device"    # every cache on this engine's device
    HOST = "host"        # vericache offloaded: the full KV in the host tier, streamed for each verification
    REMOTE = "remote"    # drafter role: the full KV is at a remote verifier; here only the draft cache
    SESSION = "session"  # verifier role: the full KV of a remote drafter's request, verifying its rounds


@dataclass(frozen=True)
class Placement:
    mode: str
    home: Home
    # What follows from the two, derived once when it is made: plain fields, so a step reads them without
    # running this module's code (tests/test_step_trace.py counts the modules a step runs).
    full_here: bool = field(init=False, repr=False)     # it holds its full KV in this engine (device or host)
    draft_here: bool = field(init=False, repr=False)    # it holds a compressed (draft) cache on the device
    drafts: bool = field(init=False, repr=False)        # its tokens come in draft-then-verify rounds
    offloaded: bool = field(init=False, repr=False)     # its full KV is in the host tier, crossing the link
    remote: bool = field(init=False, repr=False)        # a remote verifier verifies its rounds (and first token)
    session: bool = field(init=False, repr=False)       # a verifier session for a remote drafter's rounds
    verifies_in_place: bool = field(init=False, repr=False)    # a complete round is verified where its KV is
    loads_stored_prefix: bool = field(init=False, repr=False)  # a prefix store may hold what it would prefill

    def __post_init__(self) -> None:
        drafts = drafts_in_rounds(self.mode)
        derived = {
            "drafts": drafts,
            "full_here": self.mode == "full" or (drafts and self.home is not Home.REMOTE),
            "draft_here": self.mode != "full",
            "offloaded": self.home is Home.HOST,
            "remote": self.home is Home.REMOTE,
            "session": self.home is Home.SESSION,
            "verifies_in_place": drafts and self.home is Home.DEVICE,
            # the full form (full mode) or its compressed form (lossy, or a drafter whose full KV is remote);
            # a local vericache request prefills both caches together, so it fetches neither
            "loads_stored_prefix": not drafts or self.home is Home.REMOTE,
        }
        for name, value in derived.items():
            object.__setattr__(self, name, value)

    def prefix_form(self, compressor_spec: str) -> str:
        """The form its prefix takes in a prefix store: "full" or the compressor's spec."""
        return "full" if self.mode == "full" else compressor_spec

    def device_bytes_needed(self, full: int, draft: int, resident: int) -> int:
        """Device bytes at its longest, given its full KV's bytes (``full``), its draft cache's
        (``draft``) and the part of ``full`` in the resident layers (``resident``)."""
        if not self.draft_here:
            return full
        if not self.full_here:
            return draft
        return draft + (resident if self.offloaded else full)

    def transient_bytes(self, prompt: int, streamed: int) -> int:
        """Device bytes held only for a while: the uncompressed prompt (``prompt``) in a draft cache
        without a full one beside it, until the prefill is compressed; or an offloaded request's
        verification buffer (``streamed``: its non-resident layers at capacity)."""
        if self.draft_here and not self.full_here:
            return prompt
        return streamed if self.offloaded else 0

    def state_after_prefill(self) -> str:
        """The state its prompt's end leads to: "serving", "drafting" or "decoding" (``State`` values)."""
        if self.session:
            return "serving"
        return "drafting" if self.drafts else "decoding"


def drafts_in_rounds(mode: str) -> bool:
    """A request of ``mode`` drafts and verifies (an engine whose default it is times its costs at start)."""
    return mode == "vericache"


def place(mode: str, *, offload: bool, remote: bool, session: bool = False) -> Placement:
    """The one decision: ``mode`` (a request's, resolved) in an engine that offloads full KV to the host
    (``offload``) or verifies elsewhere (``remote``: drafter role); ``session``: a verifier session.

    >>> place("vericache", offload=True, remote=False)
    Placement(mode='vericache', home=<Home.HOST: 'host'>)
    """
    check_mode(mode)
    if session:
        if mode != "full":
            raise ValueError(f"a verifier session holds the full KV: mode must be 'full', got {mode!r}")
        return Placement(mode, Home.SESSION)
    if mode == "vericache" and remote:
        return Placement(mode, Home.REMOTE)
    if mode == "vericache" and offload:
        return Placement(mode, Home.HOST)
    return Placement(mode, Home.DEVICE)
