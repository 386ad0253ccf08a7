"""OfflineBatchSource and the rollout JSONL helpers."""

from __future__ import annotations

import asyncio
import json

import pytest

from ludic.inference.chat_template import HFChatTemplate
from ludic.training.batching.offline import (
    DataExhausted,
    OfflineBatchSource,
    read_rollouts_jsonl,
    write_rollouts_jsonl,
)


def write(fakes, path, n=7):
    rollouts = [fakes.one_turn_rollout(float(i), rid=f"r{i}") for i in range(n)]
    return write_rollouts_jsonl(rollouts, path)


def ids(batch):
    return [it.meta["rollout_id"] for it in batch.items]


async def take(source, n):
    return [await source.next_batch() for _ in range(n)]


def test_batches_cover_each_epoch_once_in_a_reproducible_order(fakes, tmp_path):
    path = write(fakes, tmp_path / "d.jsonl")

    def source():
        return OfflineBatchSource(
            path, credit_assigner=fakes.TurnRewardCredit(), batch_size=3, seed=1
        )

    a = asyncio.run(take(source(), 6))
    b = asyncio.run(take(source(), 6))
    assert [ids(x) for x in a] == [ids(x) for x in b]
    assert [len(x) for x in a] == [3, 3, 1, 3, 3, 1]
    epoch0 = [i for x in a[:3] for i in ids(x)]
    epoch1 = [i for x in a[3:] for i in ids(x)]
    assert sorted(epoch0) == sorted(epoch1) == [f"r{i}" for i in range(7)]
    assert epoch0 != epoch1  # reshuffled every epoch
    assert [x.meta["epoch"] for x in a] == [0, 0, 0, 1, 1, 1]
    # weights come from the credit assigner (turn reward = i)
    assert {it.meta["rollout_id"]: it.weight for x in a for it in x.items}["r4"] == 4.0


def test_finite_epochs_end_with_data_exhausted_and_async_for_stops(fakes, tmp_path):
    path = write(fakes, tmp_path / "d.jsonl", n=4)
    kw = dict(credit_assigner=fakes.TurnRewardCredit(), batch_size=2, shuffle=False, epochs=2)
    source = OfflineBatchSource(path, **kw)
    batches = asyncio.run(take(source, 4))
    assert [ids(b) for b in batches] == [["r0", "r1"], ["r2", "r3"]] * 2
    with pytest.raises(DataExhausted, match="all 2 epoch"):
        asyncio.run(source.next_batch())

    async def collect():
        return [b async for b in OfflineBatchSource(path, **kw)]

    assert len(asyncio.run(collect())) == 4


def test_drop_last_skips_the_partial_batch(fakes, tmp_path):
    path = write(fakes, tmp_path / "d.jsonl", n=5)
    source = OfflineBatchSource(
        path, credit_assigner=fakes.TurnRewardCredit(), batch_size=2, drop_last=True, epochs=1
    )
    assert source.batches_per_epoch == 2
    assert [len(b) for b in asyncio.run(take(source, 2))] == [2, 2]
    with pytest.raises(DataExhausted):
        asyncio.run(source.next_batch())


def test_filters_drop_rollouts_and_items(fakes, tmp_path):
    path = write(fakes, tmp_path / "d.jsonl", n=6)
    source = OfflineBatchSource(
        path,
        credit_assigner=fakes.TurnRewardCredit(),
        batch_size=10,
        rollout_filter=lambda r: r.total_reward >= 2,
        sample_filter=lambda it: it.meta["rollout_id"] != "r5",
    )
    assert len(source.rollouts) == 4
    assert sorted(ids(asyncio.run(source.next_batch()))) == ["r2", "r3", "r4"]


def test_everything_filtered_out_is_a_clear_error(fakes, tmp_path):
    path = write(fakes, tmp_path / "d.jsonl", n=2)
    credit = fakes.TurnRewardCredit()
    with pytest.raises(ValueError, match="rollout_filter kept 0 of 2 rollouts"):
        OfflineBatchSource(
            path, credit_assigner=credit, batch_size=1, rollout_filter=lambda r: False
        )
    with pytest.raises(ValueError, match=r"0 training items left.*\(2 before sample_filter\)"):
        OfflineBatchSource(
            path, credit_assigner=credit, batch_size=1, sample_filter=lambda i: False
        )


def test_empty_file_is_a_clear_error(fakes, tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    with pytest.raises(ValueError, match="no rollouts in"):
        OfflineBatchSource(path, credit_assigner=fakes.TurnRewardCredit(), batch_size=1)


def test_bad_line_names_file_and_line(fakes, tmp_path):
    path = write(fakes, tmp_path / "d.jsonl", n=2)
    with path.open("a") as f:
        f.write("{not json\n")
    with pytest.raises(ValueError, match=r"d\.jsonl:3: not valid JSON"):
        read_rollouts_jsonl(path)
    bad_step = {"id": "x", "steps": [{"kind": "agent", "index": 0}]}
    path.write_text(json.dumps(bad_step) + "\n")
    with pytest.raises(ValueError, match=r"d\.jsonl:1: .*missing field"):
        OfflineBatchSource(path, credit_assigner=fakes.TurnRewardCredit(), batch_size=1)


def test_multiple_files_are_read_together(fakes, tmp_path):
    a = write_rollouts_jsonl([fakes.one_turn_rollout(rid="a")], tmp_path / "a.jsonl")
    b = write_rollouts_jsonl([fakes.one_turn_rollout(rid="b")], tmp_path / "b.jsonl")
    source = OfflineBatchSource([a, b], credit_assigner=fakes.TurnRewardCredit(), batch_size=2)
    assert sorted(ids(asyncio.run(source.next_batch()))) == ["a", "b"]


def test_retokenize_mode_trains_on_traceless_sft_data(fakes, tmp_path, tiny_tokenizer):
    user = [{"role": "user", "content": "2+2?"}]
    r = fakes.one_turn_rollout(trace=False, messages=user, completion="4")
    path = write_rollouts_jsonl([r], tmp_path / "sft.jsonl")
    tmpl = HFChatTemplate(tiny_tokenizer)
    source = OfflineBatchSource(
        path,
        credit_assigner=fakes.TurnRewardCredit(),
        batch_size=1,
        retokenize=True,
        chat_template=tmpl,
    )
    [item] = asyncio.run(source.next_batch()).items
    actions = [t for t, m in zip(item.input_ids, item.action_mask) if m]
    assert tmpl.decode(actions) == "4<|im_end|>\n"


def test_invalid_arguments_are_rejected(fakes, tmp_path):
    path = write(fakes, tmp_path / "d.jsonl", n=1)
    credit = fakes.TurnRewardCredit()
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        OfflineBatchSource(path, credit_assigner=credit, batch_size=0)
    with pytest.raises(ValueError, match="epochs must be >= 1 or None"):
        OfflineBatchSource(path, credit_assigner=credit, batch_size=1, epochs=0)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        OfflineBatchSource(tmp_path / "missing.jsonl", credit_assigner=credit, batch_size=1)


def test_skip_continues_exactly_where_that_many_batches_would_leave_off(fakes, tmp_path):
    """What a resumed warm start relies on: skip(k) then next_batch == the (k+1)th batch."""
    path = write(fakes, tmp_path / "d.jsonl")

    def source():
        return OfflineBatchSource(
            path, credit_assigner=fakes.TurnRewardCredit(), batch_size=3, seed=1
        )

    straight = asyncio.run(take(source(), 8))
    resumed = source()
    resumed.skip(5)  # across an epoch boundary
    assert [ids(b) for b in asyncio.run(take(resumed, 3))] == [ids(b) for b in straight[5:]]
    with pytest.raises(ValueError, match="num_batches must be >= 0"):
        resumed.skip(-1)
