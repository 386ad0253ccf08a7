"""Reducer / aggregate_stats (ludic.stats)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest

from ludic.stats import Reducer, StatsPathError, aggregate_stats, lookup


@dataclass
class Item:
    total_reward: float
    meta: dict = field(default_factory=dict)


ITEMS = [
    Item(1.0, {"reward": 0.5, "ok": True, "info": {"len": 3}}),
    Item(-1.0, {"reward": 0.0, "ok": False, "info": {"len": 5}}),
    Item(3.0, {"reward": 2.5, "ok": True, "info": {"len": 4}}),
]


def test_dotted_paths_read_attributes_then_mapping_keys():
    assert lookup(ITEMS[0], "total_reward") == 1.0
    assert lookup(ITEMS[0], "meta.reward") == 0.5
    assert lookup(ITEMS[0], "meta.info.len") == 3
    assert lookup({"a": {"b": 2}}, "a.b") == 2


def test_each_reduction_over_the_items():
    stats = aggregate_stats(
        [
            Reducer("mean", "total_reward"),
            Reducer("sum", "meta.reward", reduce="sum"),
            Reducer("max", "meta.info.len", reduce="max"),
            Reducer("min", "meta.info.len", reduce="min"),
            Reducer("count", "meta.ok", reduce="count"),
            Reducer("fraction", "meta.ok", reduce="fraction"),
        ],
        ITEMS,
    )
    assert stats == {
        "mean": 1.0,
        "sum": 3.0,
        "max": 5.0,
        "min": 3.0,
        "count": 2.0,
        "fraction": pytest.approx(2 / 3),
    }


def test_callable_source_and_transform():
    stats = aggregate_stats(
        [
            Reducer("success", "total_reward", reduce="fraction", transform=lambda r: r > 0),
            Reducer("double", lambda it: 2 * it.total_reward, reduce="sum"),
        ],
        ITEMS,
    )
    assert stats == {"success": pytest.approx(2 / 3), "double": 6.0}


def test_empty_items_give_nan_for_averages_and_zero_for_totals():
    stats = aggregate_stats(
        [
            Reducer("m", "x"),
            Reducer("s", "x", "sum"),
            Reducer("c", "x", "count"),
            Reducer("f", "x", "fraction"),
        ],
        [],
    )
    assert math.isnan(stats["m"]) and math.isnan(stats["f"])
    assert stats["s"] == 0.0 and stats["c"] == 0.0


def test_missing_path_names_the_path_the_missing_part_and_the_item_type():
    with pytest.raises(StatsPathError, match=r"'meta\.nope'.*at 'meta' has no key 'nope'.*Item"):
        aggregate_stats([Reducer("x", "meta.nope")], ITEMS)
    with pytest.raises(KeyError, match=r"'bogus'.*has no attribute 'bogus'"):
        lookup(ITEMS[0], "bogus")


def test_dict_methods_are_not_mistaken_for_keys():
    with pytest.raises(StatsPathError, match="no key 'items'"):
        lookup({"a": 1}, "items")


def test_non_numeric_value_is_a_type_error_naming_the_reducer():
    with pytest.raises(TypeError, match=r"Reducer 'r': value 'abc' \(str\)"):
        aggregate_stats([Reducer("r", lambda it: "abc")], ITEMS)


def test_bad_reduce_and_duplicate_names_are_rejected():
    with pytest.raises(ValueError, match=r"reduce='median'"):
        Reducer("r", "x", reduce="median")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="two reducers are named 'r'"):
        aggregate_stats([Reducer("r", "total_reward"), Reducer("r", "total_reward")], ITEMS)
