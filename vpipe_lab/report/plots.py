"""The benchmark plots: throughput, largest micro-batch and the simulator's projection, as PNGs.

They need matplotlib (the ``plot`` extra), imported only when plots are asked for.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vpipe_lab.report.results import Results

__all__ = ["plot"]


def plot(results: Results, directory: Path) -> list[Path]:
    """PNG plots of the throughput, micro-batch and projection results; returns the files written."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError("plots need matplotlib: pip install 'vpipe[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    written = []
    if "throughput" in results:
        cases = results["throughput"]["cases"]
        fig, axes = plt.subplots(1, len(cases), figsize=(4 * len(cases), 4), sharey=True, squeeze=False)
        for ax, case in zip(axes[0], cases):
            ran = [r for r in case["rows"] if r.get("samples_per_s")]
            ax.barh([r["system"] for r in ran], [r["of_ideal"] for r in ran],
                    color=["tab:orange" if r["vpipe"] else "tab:gray" for r in ran])
            ax.set_title(f"{case['model']}, {case['stages']} stages")
            ax.set_xlabel("fraction of ideal throughput")
        axes[0][0].invert_yaxis()
        written.append(_save(fig, directory / "throughput.png"))
    if "microbatch" in results:
        cases = results["microbatch"]["cases"]
        fig, axes = plt.subplots(1, len(cases), figsize=(4 * len(cases), 4), sharey=True, squeeze=False)
        for ax, case in zip(axes[0], cases):
            ax.barh([r["system"] for r in case["rows"]], [r["max_micro_batch_size"] for r in case["rows"]],
                    color=["tab:orange" if r["vpipe"] else "tab:gray" for r in case["rows"]])
            ax.set_title(f"{case['model']}, {case['stages']} stages")
            ax.set_xlabel("largest micro-batch under the budget")
        axes[0][0].invert_yaxis()
        written.append(_save(fig, directory / "microbatch.png"))
    projection = results.get("simulator", {}).get("projection", [])
    if projection:
        ratio = projection[0]["ratio"]
        rows = [r for r in projection if r["ratio"] == ratio]
        fig, ax = plt.subplots(figsize=(6, 4))
        for name in rows[0]["systems"]:
            ax.plot([r["stages"] for r in rows], [r["systems"][name]["of_ideal"] for r in rows], marker="o",
                    label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("stages (one GPU-like device each)")
        ax.set_ylabel("fraction of ideal throughput")
        ax.set_title(f"simulated: block compute = {ratio:g} x its PCIe round trip")
        ax.legend()
        written.append(_save(fig, directory / "projection.png"))
    return written


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
