"""Plots of evaluation results (matplotlib, optional): retrieval accuracy against context length per format."""

from __future__ import annotations


def plot_retrieval(result: dict | list[dict], path: str) -> str:
    """One panel per retrieval task, accuracy vs context length, one line per (model, cache). Writes ``path``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("plots need matplotlib: pip install matplotlib (or quantmla[eval])") from None
    runs = result if isinstance(result, list) else [result]
    tasks: list[str] = []
    for run in runs:
        for r in run["results"].values():
            for t in r.get("retrieval", {}):
                if t not in tasks:
                    tasks.append(t)
    if not tasks:
        raise ValueError("no retrieval results to plot")
    fig, axes = plt.subplots(1, len(tasks), figsize=(4 * len(tasks) + 2.5, 3.4), squeeze=False)
    colors: dict[str, str] = {}
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, task in zip(axes[0], tasks, strict=True):
        for run in runs:
            for r in run["results"].values():
                by_len = r.get("retrieval", {}).get(task)
                if not by_len:
                    continue
                xs = sorted(int(L) for L in by_len)
                ys = [by_len[str(L)]["accuracy"] for L in xs]
                label = f"{run['model']['name']} {r['cache']}"
                color = colors.setdefault(label, cycle[len(colors) % len(cycle)])
                ax.plot(xs, ys, marker="o", label=label, color=color)
        ax.set_xscale("log", base=2)
        ax.set_ylim(-0.05, 1.05)
        ax.set_title(task)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("exact-match accuracy")
        ax.grid(alpha=0.3)
    handles = {}
    for ax in axes[0]:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(lab, h)
    fig.legend(list(handles.values()), list(handles), fontsize=7, loc="center right")
    fig.tight_layout(rect=(0, 0, 1 - 2.4 / (4 * len(tasks) + 2.5), 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
