"""Plot the bundled model's learning curves from training runs' curve.jsonl files (for MODEL_CARD.md).

    python scripts/plot_learning_curve.py docs/tiny_learning_curve.png runs/tiny/work/curve.jsonl \
        runs/tiny2/work/curve.jsonl

Each later run continues the one before it (``--init-from``): its minutes are drawn after the
previous run's last minute, and a dotted line marks where it starts.
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

SERIES = (("retrieval_em_heldout_layouts", "retrieval, held-out layouts, 1.5K"),
          ("retrieval_em_train_layouts", "retrieval, training layouts, 1.5K"),
          ("retrieval_em_heldout_layouts_512", "retrieval, held-out layouts, 512"),
          ("toolcall_em_heldout_layouts", "tool-call args, held-out layout"))


def main(dst: str, *srcs: str) -> None:
    rows, offset, starts = [], 0.0, []
    for src in srcs:
        run = [json.loads(line) for line in open(src)]
        starts.append(offset)
        rows += [{**r, "minutes": r["minutes"] + offset} for r in run]
        offset += max(r["minutes"] for r in run)
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.8))
    ax[0].plot([r["minutes"] for r in rows], [r["heldout_loss"] for r in rows], marker=".")
    ax[0].axhline(3.0, color="gray", linestyle="--", label="floor 3.0 (64 windows; this is 8)")
    ax[0].set(xlabel="training minutes", ylabel="held-out stdlib loss (nats/token)", title="held-out loss")
    ax[0].legend(fontsize=8)
    for key, label in SERIES:
        pts = [(r["minutes"], r[key]) for r in rows if key in r]
        ax[1].plot([p[0] for p in pts], [p[1] for p in pts], marker=".", label=label)
    ax[1].set(xlabel="training minutes", ylabel="exact match", title="copying from far back", ylim=(-0.05, 1.05))
    ax[1].legend(fontsize=7)
    for a in ax:
        for s in starts[1:]:
            a.axvline(s, color="gray", linestyle=":")
    fig.tight_layout()
    fig.savefig(dst, dpi=120)


if __name__ == "__main__":
    main(*sys.argv[1:])
