"""collate (padding, next-token shift) and split_microbatches (budget packing)."""

from __future__ import annotations

import pytest
import torch

from ludic.training.collate import collate, split_microbatches
from ludic.training.types import SAWItem


def _item(n_prompt: int, n_completion: int, weight: float = 1.0, **kw) -> SAWItem:
    ids = list(range(10, 10 + n_prompt + n_completion))
    return SAWItem(
        input_ids=ids, action_mask=[0] * n_prompt + [1] * n_completion, weight=weight, **kw
    )


def test_collate_right_pads_and_shifts_masks_to_next_token_positions() -> None:
    a = _item(2, 3, weight=0.5, old_logprobs=[0.0, 0.0, -1.0, -2.0, -3.0], policy_version=4)
    b = _item(1, 1, weight=-1.0, old_logprobs=[0.0, -0.5])
    mb = collate([a, b], pad_token_id=99)

    assert mb.input_ids.tolist() == [[10, 11, 12, 13, 14], [10, 11, 99, 99, 99]]
    assert mb.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    # action_mask[:, t] refers to input_ids[:, t+1]
    assert mb.action_mask.tolist() == [[0, 1, 1, 1], [1, 0, 0, 0]]
    assert mb.old_logprobs is not None
    assert mb.old_logprobs.tolist() == [[0.0, -1.0, -2.0, -3.0], [-0.5, 0.0, 0.0, 0.0]]
    assert mb.weights.tolist() == [0.5, -1.0]
    assert mb.policy_versions == (4, None)
    assert (mb.num_sequences, mb.num_action_tokens, mb.num_tokens) == (2, 4, 7)


def test_collate_lays_out_each_action_tokens_version_like_the_action_mask() -> None:
    straddling = _item(2, 3, action_versions=(3, 3, 4))  # continued across an update
    whole = _item(1, 2, policy_version=5)
    mb = collate([straddling, whole], pad_token_id=0)
    assert mb.action_versions is not None
    assert mb.action_versions.tolist() == [[-1, 3, 3, 4], [5, 5, -1, -1]]
    assert collate([straddling, _item(1, 1)], pad_token_id=0).action_versions is None


def test_collate_gives_no_old_logprobs_when_any_item_lacks_them() -> None:
    with_lp = _item(1, 2, old_logprobs=[0.0, -1.0, -1.0])
    assert collate([with_lp, _item(1, 2)], pad_token_id=0).old_logprobs is None


def test_collate_zeroes_old_logprobs_off_the_action_mask() -> None:
    item = _item(2, 1, old_logprobs=[-7.0, -7.0, -1.0])
    mb = collate([item], pad_token_id=0)
    assert mb.old_logprobs is not None
    assert mb.old_logprobs.tolist() == [[0.0, -1.0]]


def test_collate_places_tensors_on_the_requested_device() -> None:
    mb = collate([_item(1, 1)], pad_token_id=0, device="cpu")
    assert mb.input_ids.device == torch.device("cpu")
    assert mb.input_ids.dtype == torch.long and mb.action_mask.dtype == torch.float32


def test_split_microbatches_keeps_every_item_within_the_padded_token_budget() -> None:
    items = [_item(1, n) for n in (3, 9, 5, 2, 7, 4, 1)]
    budget = 16
    microbatches = split_microbatches(items, budget)

    assert sorted(id(i) for mb in microbatches for i in mb) == sorted(id(i) for i in items)
    for mb in microbatches:
        assert len(mb) * max(i.num_tokens for i in mb) <= budget
    lengths = [i.num_tokens for mb in microbatches for i in mb]
    assert lengths == sorted(lengths, reverse=True)  # longest first: little padding


def test_split_microbatches_puts_everything_in_one_batch_when_it_fits() -> None:
    items = [_item(1, 2), _item(1, 3)]
    assert split_microbatches(items, 1000) == [[items[1], items[0]]]


def test_split_microbatches_rejects_an_item_longer_than_the_budget() -> None:
    with pytest.raises(ValueError, match="max_tokens_per_microbatch=8"):
        split_microbatches([_item(4, 6, meta={"rollout_id": "r1"})], 8)
