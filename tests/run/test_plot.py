"""plot_reward_curve / read_metrics: PNGs from metrics.jsonl records, without pyplot."""

from __future__ import annotations

import json
import math
import sys

from ludic.run.plot import moving_average, plot_reward_curve, read_metrics, reward_curve_figure

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _records() -> list[dict]:
    records = [{"phase": "warm_start", "step": s, "loss": 2.0 / s} for s in range(1, 6)]
    records.append({"phase": "eval", "step": 0, "reward_mean": 0.1, "success_rate": 0.1})
    records += [{"phase": "rl", "step": s, "reward_mean": s / 20} for s in range(1, 21)]
    records.append({"phase": "rl", "step": 21})  # reward missing
    records.append({"phase": "rl", "step": 22, "reward_mean": "nan"})  # JsonlLogger's NaN
    records.append({"phase": "eval", "step": 22, "reward_mean": 0.9, "success_rate": 0.9})
    return records


def test_plot_with_all_phases_writes_a_png(tmp_path) -> None:
    out = plot_reward_curve(_records(), tmp_path / "plots" / "reward.png", title="t")
    assert out == tmp_path / "plots" / "reward.png"
    data = out.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 1000


def test_plot_of_no_records_still_writes_a_png(tmp_path) -> None:
    out = plot_reward_curve([], tmp_path / "empty.png")
    assert out.read_bytes().startswith(PNG_MAGIC)


def test_plot_does_not_touch_pyplot(tmp_path) -> None:
    plot_reward_curve(_records(), tmp_path / "r.png")
    pyplot = sys.modules.get("matplotlib.pyplot")
    assert pyplot is None or not pyplot.get_fignums()


def test_read_metrics_reads_jsonl_and_skips_blank_lines(tmp_path) -> None:
    path = tmp_path / "metrics.jsonl"
    records = _records()
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    assert read_metrics(path) == records


def test_moving_average_is_trailing_with_a_short_start() -> None:
    assert moving_average([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert moving_average([2.0], 1) == [2.0]


def test_entropy_and_zero_variance_groups_get_their_own_panel(tmp_path) -> None:
    import matplotlib.image

    plain = [{"phase": "rl", "step": s, "reward_mean": 0.1 * s} for s in range(1, 6)]
    diagnosed = [
        {**r, "entropy": 2.0 - 0.1 * r["step"], "batch/zero_variance_group_frac": 0.2}
        for r in plain
    ]
    heights = [
        matplotlib.image.imread(plot_reward_curve(records, tmp_path / f"{i}.png")).shape[0]
        for i, records in enumerate((plain, diagnosed))
    ]
    assert heights[1] > heights[0]  # one more panel


def _audited(dropped: float, dropped_completion: float) -> list[dict]:
    """RL records with the cumulative bias audit; the last one is what the panel shows."""
    return [
        {
            "phase": "rl",
            "step": s,
            "reward_mean": 0.1 * s,
            "audit/trained_samples": 10.0 * s,
            "audit/trained_prompt_length": 30.0,
            "audit/trained_completion_length": 20.0 + s,  # 25 at the last step
            "audit/trained_reward": 0.75,
            "audit/dropped_samples": dropped * s / 5,
            "audit/dropped_prompt_length": 28.0,
            "audit/dropped_completion_length": dropped_completion,
            "audit/dropped_reward": 0.25,
        }
        for s in range(1, 6)
    ]


def _audit_axes(figure) -> list:
    return [ax for ax in figure.axes if ax.get_title().startswith("bias audit")]


def test_dropped_samples_get_a_bias_audit_panel_against_trained_ones(tmp_path) -> None:
    plain = [{"phase": "rl", "step": s, "reward_mean": 0.1 * s} for s in range(1, 6)]
    assert len(reward_curve_figure(plain).axes) == 1
    none_dropped = _audited(dropped=0.0, dropped_completion=math.nan)
    assert len(reward_curve_figure(none_dropped).axes) == 1  # nothing dropped: no panel

    figure = reward_curve_figure(_audited(dropped=40.0, dropped_completion=50.0))
    (ax,) = _audit_axes(figure)
    assert len(figure.axes) == 3  # reward, audit, the audit's reward axis (twin)
    reward_ax = next(other for other in figure.axes if other not in (ax, figure.axes[0]))
    trained, dropped = ax.containers
    assert [p.get_height() for p in trained] == [30.0, 25.0]  # prompt, completion (last step)
    assert [p.get_height() for p in dropped] == [28.0, 50.0]
    assert [p.get_height() for c in reward_ax.containers for p in c] == [0.75, 0.25]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "trained (n=50)",
        "dropped (n=40)",
    ]
    assert ax.get_xlabel().startswith("dropped completions are 2.0x longer")  # 50/25 > 1.5
    out = plot_reward_curve(_audited(40.0, 50.0), tmp_path / "audit.png")
    assert out.read_bytes().startswith(PNG_MAGIC)


def test_the_audit_note_follows_the_sample_audit_rule() -> None:
    (similar,) = _audit_axes(reward_curve_figure(_audited(dropped=40.0, dropped_completion=37.0)))
    assert similar.get_xlabel() == ""  # 37/25 = 1.48: not over LONGER_DROPS
    (few,) = _audit_axes(reward_curve_figure(_audited(dropped=5.0, dropped_completion=100.0)))
    assert few.get_xlabel() == ""  # 4x longer, but fewer than MIN_DROPPED dropped
