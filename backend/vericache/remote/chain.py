"""What a prefix block's key is: a hash chain over fixed token blocks (as vLLM and LMCache do).

Block i's hash covers the model id, block i's tokens and block i-1's hash, so equal hashes mean
equal *leading* token runs: a request sharing only the first blocks of a stored prefix still hits
those. Only whole blocks are keyed; the tail of a prompt shorter than a block is always computed.
"""

from __future__ import annotations

import hashlib
import struct

BLOCK_TOKENS = 256


def block_hashes(model_id: str, token_ids: list[int], block_tokens: int = BLOCK_TOKENS) -> list[str]:
    """Hex hashes of each whole block of ``token_ids`` (len(token_ids) // block_tokens of them)."""
    if not isinstance(block_tokens, int) or block_tokens < 1:
        raise ValueError(f"block_tokens must be an integer >= 1, got {block_tokens!r}")
    prev = hashlib.sha256(f"vericache-prefix-v1:{model_id}:{block_tokens}".encode()).digest()
    out = []
    for b in range(len(token_ids) // block_tokens):
        block = token_ids[b * block_tokens : (b + 1) * block_tokens]
        prev = hashlib.sha256(prev + struct.pack(f"<{len(block)}q", *block)).digest()
        out.append(prev.hex()[:40])
    return out
