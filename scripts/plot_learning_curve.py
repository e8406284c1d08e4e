"""Plot the bundled model's learning curve from a training run's curve.jsonl (used for MODEL_CARD.md).

    python scripts/plot_learning_curve.py runs/tiny/work/curve.jsonl docs/tiny_learning_curve.png
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src: str, dst: str) -> None:
    rows = [json.loads(line) for line in open(src)]
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.8))
    ax[0].plot([r["minutes"] for r in rows], [r["heldout_loss"] for r in rows], marker="o")
    ax[0].axhline(3.0, color="gray", linestyle="--", label="floor 3.0")
    ax[0].set(xlabel="training minutes", ylabel="held-out stdlib loss (nats/token)", title="held-out loss")
    ax[0].legend()
    for key, label in (("retrieval_em_heldout_layouts", "retrieval, held-out layouts"),
                       ("retrieval_em_train_layouts", "retrieval, training layouts"),
                       ("toolcall_em_heldout_layouts", "tool-call args, held-out layout")):
        ax[1].plot([r["minutes"] for r in rows], [r[key] for r in rows], marker="o", label=label)
    ax[1].set(xlabel="training minutes", ylabel="exact match", title="copying from far back (1-1.5K tokens)",
              ylim=(-0.05, 1.05))
    ax[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(dst, dpi=120)


if __name__ == "__main__":
    main(*sys.argv[1:3])
