"""PNG plots of `deltaflash bench e2e` results (matplotlib, no display): tokens/s vs concurrency for
speculative vs target-only, and the histogram of accepted lengths per concurrency."""

from __future__ import annotations

from pathlib import Path


def plot(result: dict, out: Path) -> list[Path]:
    """Writes e2e-<workload>-tokens-per-s.png and e2e-<workload>-accepted-length.png; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    name, points = result["workload"], result["points"]
    title = f"{result['label']}\nW {result['block_size']}, {result['max_new_tokens']} new tokens"
    if "machine" in result and "gpu" in result["machine"]:
        title += f", {result['machine']['gpu']}"

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode in sorted({p["mode"] for p in points}):
        xs = [p for p in points if p["mode"] == mode]
        ax.plot([p["concurrency"] for p in xs], [p["tokens_per_s"] for p in xs], marker="o", label=mode)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("aggregate output tokens/s")
    ax.set_title(title, fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend()
    speed = out / f"e2e-{name}-tokens-per-s.png"
    fig.tight_layout()
    fig.savefig(speed, dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    W = result["block_size"]
    bins = [b + 0.5 for b in range(W + 1)]
    spec = [p for p in points if p.get("accepted_lengths")]
    for p in spec:
        ax.hist(p["accepted_lengths"], bins=bins, histtype="step", density=True,
                label=f"C={p['concurrency']} (mean {p['mean_accepted_length']:.2f})")
    ax.set_xlabel("accepted length per round (1 + accepted drafts)")
    ax.set_ylabel("fraction of rounds")
    ax.set_xticks(range(1, W + 1))
    ax.set_title(title, fontsize=8)
    if spec:
        ax.legend(fontsize=7)
    hist = out / f"e2e-{name}-accepted-length.png"
    fig.tight_layout()
    fig.savefig(hist, dpi=120)
    plt.close(fig)
    return [speed, hist]
