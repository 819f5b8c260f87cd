"""Draw the PNGs of bench/results/ from the CSVs a GPU run wrote (the GPU image has no
matplotlib): ``<family>_step_*.csv`` -> bar chart of median step ms per provider and batch;
``*vae_decode_*.csv`` (bench/bench_vae.py) the same for one VAE decode.

    python bench/plot_results.py bench/results/flux_step_h200.csv bench/results/wan_step_h200.csv
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path


def plot_step(csv_path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(csv.DictReader(csv_path.open()))
    provs = list(dict.fromkeys(r["provider"] for r in rows))
    batches = list(dict.fromkeys((r["size"], r["batch"]) for r in rows))  # one bar group per (size, batch)
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(provs)
    for i, p in enumerate(provs):
        vals = [next((float(r["median_ms"]) for r in rows if r["provider"] == p and (r["size"], r["batch"]) == b), 0.0)
                for b in batches]
        bars = ax.bar([j + i * width for j in range(len(batches))], vals, width, label=p)
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.set_xticks([j + width * (len(provs) - 1) / 2 for j in range(len(batches))])
    one_size = len({sz for sz, _ in batches}) == 1
    ax.set_xticklabels([f"B={b}" if one_size else f"{sz} B={b}" for sz, b in batches])
    r0 = rows[0]
    what = "transformer step" if "txt_tokens" in r0 else "VAE decode"
    ax.set_ylabel(f"median {what} time (ms)")
    sizes = ", ".join(dict.fromkeys(r["size"] for r in rows))
    ax.set_title(f"{r0['model']} {what}, {sizes}, {r0['gpu']} (commit {r0['commit']})", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = csv_path.with_suffix(".png")
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv: list[str]) -> int:
    for a in argv:
        print(f"wrote {plot_step(Path(a))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
