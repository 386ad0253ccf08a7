"""plot_reward_curve / read_metrics: PNGs from metrics.jsonl records, without pyplot."""

from __future__ import annotations

import json
import sys

from ludic.run.plot import moving_average, plot_reward_curve, read_metrics

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
