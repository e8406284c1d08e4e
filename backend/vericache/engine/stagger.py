"""P1 cross-resource staggering: how many phase-shifted groups, from measured rates.

Two resources work in parallel: the link moves one group's full KV to the device while compute runs
the other groups' draft steps (then the group's verification). With ``n`` VeriCache requests in
``G`` groups, one group's transfer takes ``(n / G) * t_x`` on the link, and meanwhile the others
run draft steps of ``t_d`` seconds each. The link is hidden behind drafting when one group's
transfer fits in one draft round of ``k`` steps:

    (n / G) * t_x <= k * t_d    =>    G >= n * t_x / (k * t_d)

Fewer groups mean bigger verification batches (one forward verifies a whole group), so the plan
takes the smallest G that hides the link: at least 2 (one group drafts while another verifies)
and at most n (one request per group, when the link is slow). Before anything is measured it
starts from 2. The engine re-plans at every new draft round, so G follows the measured rates.
"""

from __future__ import annotations

import math


def group_count(n: int, transfer_s: float, draft_step_s: float, draft_len: int) -> int:
    """Groups for ``n`` requests whose full KV takes ``transfer_s`` each to move, with draft steps of
    ``draft_step_s`` and rounds of ``draft_len`` tokens."""
    if n < 0 or draft_len < 0:
        raise ValueError(f"n and draft_len must be >= 0, got n={n}, draft_len={draft_len}")
    if n <= 1:
        return 1
    if transfer_s <= 0 or draft_step_s <= 0 or draft_len == 0:
        return 2  # nothing measured yet: the two-phase ping-pong
    need = math.ceil(n * transfer_s / (draft_len * draft_step_s))
    return max(2, min(n, need))
