"""Per-request draft length (the paper's P2: long verification periods).

``draft_len=int`` fixes it. ``draft_len="auto"`` follows each request's observed
acceptance: a run that is fully accepted doubles the next draft (up to
``max_len``); otherwise the next draft is a little longer than the smoothed
accepted length. When acceptance collapses (nothing accepted for ``patience``
rounds) the request falls back to plain full-KV decoding for ``cooldown``
tokens, then tries drafting again from a short draft.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DraftState:
    k: int
    ema_accepted: float = 0.0
    failed_rounds: int = 0
    cooldown: int = 0
    fallbacks: int = 0
    accepted_total: int = 0       # drafted tokens accepted, all rounds
    rejections: int = 0           # rounds that ended at a mismatch

    def acceptance(self) -> float:
        """Per-token acceptance, a geometric model's estimate (Laplace-smoothed)."""
        return (self.accepted_total + 1) / (self.accepted_total + self.rejections + 2)


@dataclass
class DraftLengthPolicy:
    fixed: int | None = None
    start: int = 8
    min_len: int = 2
    max_len: int = 48
    patience: int = 3
    cooldown: int = 16

    @classmethod
    def from_arg(cls, draft_len: int | str) -> "DraftLengthPolicy":
        if draft_len == "auto":
            return cls()
        if isinstance(draft_len, bool) or not isinstance(draft_len, int) or draft_len < 1:
            raise ValueError(f"draft_len must be an integer >= 1 or 'auto', got {draft_len!r}")
        return cls(fixed=draft_len)

    def new_state(self) -> DraftState:
        return DraftState(k=self.fixed if self.fixed is not None else self.start)

    def next_len(self, st: DraftState, remaining: int) -> int:
        """Draft tokens for the next round; 0 means a plain full-KV step. A round emits at most k+1."""
        if st.cooldown > 0:
            return 0
        return max(min(st.k, remaining - 1), 0)

    def update(self, st: DraftState, drafted: int, accepted: int) -> None:
        if drafted == 0:
            st.cooldown = max(st.cooldown - 1, 0)
            if st.cooldown == 0 and self.fixed is None:
                st.k = max(self.min_len, 4)
            return
        st.accepted_total += accepted
        st.rejections += accepted < drafted
        if self.fixed is not None:
            return
        st.ema_accepted = 0.6 * st.ema_accepted + 0.4 * accepted
        if accepted == drafted:
            st.k = min(max(st.k, 2 * drafted), self.max_len)
        else:
            st.k = min(max(int(1.5 * st.ema_accepted) + 2, self.min_len), self.max_len)
        st.failed_rounds = st.failed_rounds + 1 if accepted == 0 else 0
        if st.failed_rounds >= self.patience:
            st.cooldown, st.failed_rounds = self.cooldown, 0
            st.fallbacks += 1
