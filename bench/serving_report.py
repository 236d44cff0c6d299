"""Markdown table and PNG plots of a serving-benchmark results JSON."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

__all__ = ["ceiling_table", "markdown_table", "plot_results"]

BASELINE = "actorlm"


def _f(x: float | None, digits: int = 1) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return f"{x:,.{digits}f}"


def _ratio(a: float | None, b: float | None) -> str:
    if not a or not b or math.isnan(a) or math.isnan(b):
        return "–"
    return f"{a / b:.2f}×"


def _level_key(level: dict[str, Any]) -> str:
    if level.get("request_rate"):
        c = f", c≤{level['concurrency']}" if level.get("concurrency") else ""
        return f"{level['request_rate']:g} req/s{c}"
    return f"c={level['concurrency']}"


def markdown_table(data: dict[str, Any]) -> str:
    """One row per engine and load level, with ratios against actorlm at the same level.

    ``out tok/s ×`` is actorlm's output throughput divided by the engine's (above 1:
    actorlm is faster); ``TTFT ×`` is the engine's p50 TTFT divided by actorlm's
    (above 1: actorlm answers sooner).
    """
    engines = data.get("engines", {})
    base = {(_level_key(lv)): lv["summary"] for lv in engines.get(BASELINE, {}).get("levels", [])}
    head = (
        "| engine | load | ok/failed | req/s | out tok/s | total tok/s | TTFT p50 / p90 / p99 ms "
        "| ITL p50 / p90 / p99 ms | TPOT p50 ms | E2E p50 ms | out tokens (expected) "
        "| actorlm out tok/s × | TTFT p50 × |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    notes: list[str] = []
    for name, eng in engines.items():
        mark = ""
        if eng.get("note"):
            notes.append(f"{eng.get('label', name)}: {eng['note']}")
            mark = f"[{len(notes)}]"
        label = f"{eng.get('label', name)}{mark}"
        if eng.get("skipped"):
            lines.append(f"| {label} | – | skipped: {eng['skipped']} |" + " |" * 10)
            continue
        for lv in eng.get("levels", []):
            s = lv["summary"]
            b = base.get(_level_key(lv))
            t, i = s["ttft_ms"], s["itl_ms"]
            lines.append(
                f"| {label} | {_level_key(lv)} | {s['completed']}/{s['failed']} "
                f"| {_f(s['request_throughput'], 2)} | {_f(s['output_throughput'])} "
                f"| {_f(s['total_throughput'])} "
                f"| {_f(t['p50'], 0)} / {_f(t['p90'], 0)} / {_f(t['p99'], 0)} "
                f"| {_f(i['p50'])} / {_f(i['p90'])} / {_f(i['p99'])} "
                f"| {_f(s['tpot_ms']['p50'])} | {_f(s['e2e_ms']['p50'], 0)} "
                f"| {s['output_tokens']} ({s['expected_output_tokens']}) "
                f"| {_ratio(b['output_throughput'], s['output_throughput']) if b else '–'} "
                f"| {_ratio(t['p50'], b['ttft_ms']['p50']) if b else '–'} |"
            )
    out = "\n".join(lines)
    if notes:
        out += "\n\n" + "\n".join(f"[{k}] {n}" for k, n in enumerate(notes, 1))
    return out


def ceiling_table(data: dict[str, Any]) -> str:
    """Each level's floor on this machine (bench/serving_bound.py) and each engine against
    it: its output tok/s as a share of the ceiling, its TTFT p50 over the floor's."""
    lim = data["limits"]
    engines = {n: e for n, e in data.get("engines", {}).items() if e.get("levels")}
    head = (
        "| load | ceiling out tok/s | floor s: compute / memory | TTFT floor ms (alone, p50) | "
        + " | ".join(
            f"{e.get('label', n)}: out tok/s % of ceiling, TTFT p50 × floor"
            for n, e in engines.items()
        )
        + " |"
    )
    lines = [
        f"Machine ceiling (GGUF weights, 16-bit KV; read {lim['read_bandwidth'] / 1e9:.1f} GB/s,"
        f" best GEMM {lim['gemm'] / 1e9:,.0f} GFLOP/s):",
        "",
        head,
        "|" + "---|" * (head.count("|") - 1),
    ]
    for i, c in enumerate(data["ceiling"]):
        cells = []
        for e in engines.values():
            lv = e["levels"][i] if i < len(e["levels"]) else None
            if lv is None:
                cells.append("–")
                continue
            s = lv["summary"]
            share = 100 * s["output_throughput"] / c["ceiling_out_tok_s"]
            cells.append(f"{share:.0f}%, {_ratio(s['ttft_ms']['p50'], c['ttft_p50_floor_ms'])}")
        lines.append(
            f"| {_level_key(c)} | {_f(c['ceiling_out_tok_s'])} "
            f"| {c['compute_s']:.2f} / {c['memory_s']:.2f} | {_f(c['ttft_p50_floor_ms'])} | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(lines)


def _xaxis(ax: Any, ticks: list[float]) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks)
    ax.set_xticklabels([f"{t:g}" for t in ticks])
    ax.minorticks_off()


def plot_results(data: dict[str, Any], stem: Path) -> list[Path]:
    """``<stem>-throughput.png`` and ``<stem>-latency.png``; returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    engines = {n: e for n, e in data.get("engines", {}).items() if e.get("levels")}
    if not engines:
        return []
    title = f"{data.get('dataset', '')} · {data.get('model', '')}"
    by_rate = any(lv.get("request_rate") for e in engines.values() for lv in e["levels"])
    xkey = "request_rate" if by_rate else "concurrency"
    xlabel = "request rate (req/s)" if by_rate else "concurrency"
    written: list[Path] = []
    ticks = sorted({lv[xkey] for e in engines.values() for lv in e["levels"] if lv[xkey]})

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, e in engines.items():
        xs = [lv[xkey] for lv in e["levels"]]
        axes[0].plot(
            xs,
            [lv["summary"]["output_throughput"] for lv in e["levels"]],
            "o-",
            label=e.get("label", name),
        )
        axes[1].plot(
            xs,
            [lv["summary"]["request_throughput"] for lv in e["levels"]],
            "o-",
            label=e.get("label", name),
        )
    for ax, yl in zip(axes, ("output tokens/s", "requests/s"), strict=True):
        _xaxis(ax, ticks)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(yl)
        ax.grid(True, alpha=0.3)
    axes[0].legend()
    fig.suptitle(f"Throughput — {title}")
    fig.tight_layout()
    p = stem.with_name(stem.name + "-throughput.png")
    fig.savefig(p, dpi=110)
    plt.close(fig)
    written.append(p)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    styles = {"p50": "-", "p90": "--", "p99": ":"}
    for k, (metric, yl) in enumerate((("ttft_ms", "TTFT (ms)"), ("itl_ms", "ITL (ms)"))):
        ax = axes[k]
        for j, (name, e) in enumerate(engines.items()):
            xs = [lv[xkey] for lv in e["levels"]]
            for q, ls in styles.items():
                ax.plot(
                    xs,
                    [lv["summary"][metric][q] for lv in e["levels"]],
                    ls,
                    marker="o",
                    color=f"C{j}",
                    label=e.get("label", name) if q == "p50" else None,
                )
        _xaxis(ax, ticks)
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(yl)
        ax.grid(True, alpha=0.3, which="both")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Latency percentiles (solid p50, dashed p90, dotted p99) — {title}")
    fig.tight_layout()
    p = stem.with_name(stem.name + "-latency.png")
    fig.savefig(p, dpi=110)
    plt.close(fig)
    written.append(p)
    return written
