"""The reward curve of a run (``reward_curve.png``), from its ``metrics.jsonl``.

It reads the records of phase ``"rl"`` (``step``, ``reward_mean`` if any, and optionally
``entropy``, ``batch/zero_variance_group_frac`` and the bias audit's cumulative
``audit/<trained|dropped>_<samples|prompt_length|completion_length|reward>``), ``"eval"``
(``step``, ``reward_mean``, ``success_rate``) and ``"warm_start"`` (``step``, ``loss``).
The figure is drawn on matplotlib's Agg canvas directly (no pyplot), so plotting never
changes a user's pyplot backend or open figures.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from ludic.jsonl import read_jsonl
from ludic.training.sample_audit import LONGER_DROPS, longer_drops


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` (blank lines skipped; a torn last line, left by a
    crash, dropped with a warning)."""
    return read_jsonl(path, tolerate_torn_tail=True)


def plot_reward_curve(
    records: Iterable[dict[str, Any]], out_png: str | Path, *, title: str = "ludic run"
) -> Path:
    """Write a PNG of sampled RL reward per step, its moving average and eval rewards,
    plus panels when the records have them: the policy's token entropy and the fraction of
    zero-variance groups per RL step (what GRPO cannot learn from), the warm-start SFT
    loss, and, when the run dropped samples, the bias audit: mean prompt length, completion
    length and reward of dropped against trained samples (cumulative, from the last RL
    record), with a note when dropped completions are much longer. Returns ``out_png``."""
    figure = reward_curve_figure(records, title=title)
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=120)
    return out


def reward_curve_figure(records: Iterable[dict[str, Any]], *, title: str = "ludic run") -> Figure:
    """The figure :func:`plot_reward_curve` writes (on an Agg canvas, unsaved)."""
    records = list(records)
    rl = _points(records, "rl", "reward_mean")
    evals = _points(records, "eval", "reward_mean")
    sft_loss = _points(records, "warm_start", "loss")
    entropy = _points(records, "rl", "entropy")
    flat_groups = _points(records, "rl", "batch/zero_variance_group_frac")
    diagnostics = bool(entropy or flat_groups)
    audit = _dropped_audit(records)

    panels = 1 + diagnostics + bool(sft_loss) + bool(audit)
    figure = Figure(figsize=(8, 4.5 + 2.0 * (panels - 1)), layout="constrained")
    FigureCanvasAgg(figure)
    axes = list(
        figure.subplots(panels, 1, height_ratios=[3] + [1] * (panels - 1), squeeze=False)[:, 0]
    )
    reward_ax = axes.pop(0)
    diag_ax = axes.pop(0) if diagnostics else None
    loss_ax = axes.pop(0) if sft_loss else None
    audit_ax = axes.pop(0) if audit else None
    reward_ax.set_title(title)

    if not (rl or evals or sft_loss):
        reward_ax.text(
            0.5,
            0.5,
            "no data",
            ha="center",
            va="center",
            fontsize=14,
            transform=reward_ax.transAxes,
        )
        reward_ax.set_axis_off()
    else:
        _draw_rewards(reward_ax, rl, evals)
    if diag_ax is not None:
        _draw_diagnostics(diag_ax, entropy, flat_groups)
    if loss_ax is not None:
        steps, losses = zip(*sft_loss)
        loss_ax.plot(steps, losses, color="tab:gray", linewidth=1.0, label="SFT loss")
        loss_ax.set_xlabel("warm-start step")
        loss_ax.set_ylabel("loss")
        loss_ax.legend(loc="upper right")
        loss_ax.grid(alpha=0.3)
    if audit_ax is not None:
        _draw_audit(audit_ax, audit)
    return figure


def _draw_rewards(ax: Any, rl: list[tuple[float, float]], evals: list[tuple[float, float]]):
    if rl:
        steps, rewards = zip(*rl)
        ax.plot(steps, rewards, color="tab:blue", linewidth=0.8, alpha=0.5, label="sampled reward")
        window = max(1, round(0.1 * len(rewards)))
        ax.plot(
            steps,
            moving_average(rewards, window),
            color="tab:blue",
            linewidth=2.0,
            label=f"moving average ({window} steps)",
        )
    if evals:
        steps, rewards = zip(*evals)
        ax.plot(
            steps,
            rewards,
            linestyle="none",
            marker="o",
            color="tab:orange",
            label="eval reward (greedy)",
        )
    ax.set_xlabel("RL step")
    ax.set_ylabel("mean reward")
    ax.grid(alpha=0.3)
    ax.legend(loc="best")


def _draw_diagnostics(
    ax: Any, entropy: list[tuple[float, float]], flat_groups: list[tuple[float, float]]
) -> None:
    lines = []
    if entropy:
        steps, values = zip(*entropy)
        lines += ax.plot(steps, values, color="tab:green", linewidth=1.0, label="token entropy")
        ax.set_ylabel("entropy (nats)")
    if flat_groups:
        right = ax.twinx()
        steps, values = zip(*flat_groups)
        window = max(1, round(0.1 * len(values)))
        lines += right.plot(
            steps,
            moving_average(values, window),
            color="tab:red",
            linewidth=1.0,
            label=f"zero-variance groups ({window}-step average)",
        )
        right.set_ylim(0, 1.05)
        right.set_ylabel("fraction of groups")
    ax.set_xlabel("RL step")
    ax.grid(alpha=0.3)
    ax.legend(lines, [line.get_label() for line in lines], loc="best", fontsize=8)


_AUDIT_TITLE = "bias audit: trained vs dropped samples (cumulative)"
_AUDIT_FIELDS = ("prompt_length", "completion_length", "reward")


def _dropped_audit(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The ``audit/*`` metrics of the last RL record that has them, when it counts dropped
    samples; else empty (no panel)."""
    last = next(
        (r for r in reversed(records) if r.get("phase") == "rl" and "audit/dropped_samples" in r),
        {},
    )
    dropped = last.get("audit/dropped_samples")
    if not (_is_finite(dropped) and dropped > 0):
        return {}
    return {key: value for key, value in last.items() if key.startswith("audit/")}


def _draw_audit(ax: Any, audit: dict[str, Any]) -> None:
    """Grouped bars, trained against dropped: mean prompt and completion length (tokens,
    left axis) and mean reward (right axis)."""
    width = 0.38
    reward_ax = ax.twinx()
    handles = []
    for offset, name, color in (
        (-width / 2, "trained", "tab:blue"),
        (width / 2, "dropped", "tab:red"),
    ):
        values = [_number(audit.get(f"audit/{name}_{field}")) for field in _AUDIT_FIELDS]
        label = f"{name} (n={int(_number(audit.get(f'audit/{name}_samples'), 0.0))})"
        handles.append(ax.bar([offset, 1 + offset], values[:2], width, color=color, label=label))
        reward_ax.bar([2 + offset], values[2:], width, color=color, label=label)
    reward_ax.axhline(0.0, color="black", linewidth=0.5)
    ax.set_xticks([0, 1, 2], ["prompt length", "completion length", "reward"])
    ax.set_ylabel("mean tokens")
    reward_ax.set_ylabel("mean reward")
    ax.set_title(_AUDIT_TITLE, fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    for side in (ax, reward_ax):
        side.margins(y=0.35)  # headroom for the legend
    ax.legend(handles=handles, loc="upper left", ncols=2, fontsize=8)
    ratio = longer_drops(audit)
    if ratio is not None:
        ax.set_xlabel(
            f"dropped completions are {ratio:.1f}x longer than trained ones (over "
            f"{LONGER_DROPS}x): the run trains on shorter answers",
            color="tab:red",
            fontsize=9,
        )


def _number(value: Any, missing: float = math.nan) -> float:
    """``value`` as a float when it is a finite number; else ``missing`` (no bar is drawn
    for NaN, e.g. the means of a class with no samples yet)."""
    return float(value) if _is_finite(value) else missing


def moving_average(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over the last ``window`` values (fewer at the start)."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def _points(records: list[dict[str, Any]], phase: str, key: str) -> list[tuple[float, float]]:
    """(step, value) of ``phase`` records whose ``key`` is a finite number, sorted by step.

    Non-numbers (JsonlLogger writes NaN as ``"nan"``) are skipped. A step logged twice
    (steps redone after ``--resume``) keeps its last value."""
    by_step: dict[float, float] = {}
    for record in records:
        step, value = record.get("step"), record.get(key)
        if record.get("phase") == phase and _is_finite(step) and _is_finite(value):
            by_step[float(step)] = float(value)
    return sorted(by_step.items())


def _is_finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
