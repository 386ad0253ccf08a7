"""Sample filters keep (True) or drop (False) items by their meta flags."""

from __future__ import annotations

from ludic.training.filters import (
    combine,
    drop_incomplete_completions,
    drop_parse_errors,
    drop_truncated,
)
from ludic.training.types import SAWItem


def _item(**meta) -> SAWItem:
    return SAWItem(input_ids=(1, 2), action_mask=(0, 1), weight=1.0, meta=meta)


def test_drop_truncated_drops_only_truncated_items() -> None:
    keep = drop_truncated()
    assert keep(_item(truncated=False)) and keep(_item())
    assert not keep(_item(truncated=True))


def test_drop_incomplete_completions_drops_length_finishes() -> None:
    keep = drop_incomplete_completions()
    assert keep(_item(finish_reason="stop")) and keep(_item())
    assert not keep(_item(finish_reason="length"))


def test_drop_parse_errors_drops_items_flagged_with_a_parse_error() -> None:
    keep = drop_parse_errors()
    assert keep(_item(parse_error=False)) and keep(_item())
    assert not keep(_item(parse_error=True))


def test_combine_keeps_an_item_only_if_every_filter_keeps_it() -> None:
    keep = combine(drop_truncated(), drop_parse_errors())
    assert keep(_item())
    assert not keep(_item(truncated=True))
    assert not keep(_item(parse_error=True))
    assert combine()(_item(truncated=True))
