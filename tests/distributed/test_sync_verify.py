"""The checks of ``ludic.distributed.weight_transfer.verify`` on reports built by hand, and
the in-process backend's read-back after a sync (the vLLM side runs against a real server
in ``tests/vllm/test_vllm_verify.py``)."""

from __future__ import annotations

import pytest
import torch

from ludic.distributed.weight_transfer.verify import (
    SentChecksums,
    SyncVerificationError,
    add_checksums,
    check_reports,
    checksums,
    make_report,
)


def _sent(tensors: dict[str, torch.Tensor]) -> SentChecksums:
    sent = SentChecksums()
    sent.record(list(tensors), list(tensors.values()))
    return sent


def _report(received: dict[str, torch.Tensor], loaded: dict[str, dict], version=3, **kw):
    sums = dict(zip(received, checksums(list(received.values()))))
    return make_report(
        version=version,
        tp_rank=kw.get("tp_rank", 0),
        tp_size=kw.get("tp_size", 1),
        received=sums,
        loaded=loaded,
        unverified=kw.get("unverified", {}),
    )


def _entry(parts, loaded: torch.Tensor, expected: list[torch.Tensor], sharded=False) -> dict:
    (got,) = checksums([loaded])
    size = loaded.element_size()
    want = add_checksums(checksums(expected), size)
    return {
        "parts": parts,
        "checksum": got,
        "expected": want,
        "element_size": size,
        "sharded": sharded,
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_checksums_do_not_depend_on_layout_and_see_any_one_bit(dtype):
    """Fused, padded and sharded layouts keep the checksum, exactly (the sums wrap around
    in the element's width, here many times over); flipping the lowest bit of one element
    changes it."""
    g = torch.Generator().manual_seed(0)
    q = (torch.randn(64, 32, generator=g) * 1e4).to(dtype)
    k = (torch.randn(16, 32, generator=g) * 1e4).to(dtype)
    fused = torch.cat([q, k])
    (whole,) = checksums([fused])
    assert add_checksums(checksums([q, k]), fused.element_size()) == whole
    assert checksums([torch.cat([fused, torch.zeros(8, 32, dtype=dtype)])])[0] == whole
    assert add_checksums(checksums(list(fused.chunk(3, dim=1))), fused.element_size()) == whole
    assert len(whole) == (2 if fused.element_size() < 4 else 1)
    ints = (
        fused.clone()
        .view(-1)
        .view({2: torch.int16, 4: torch.int32, 8: torch.int64}[fused.element_size()])
    )
    ints[77] ^= 1  # the least significant bit of one element
    assert checksums([ints.view(dtype)])[0] != whole


def test_a_report_that_matches_passes_and_each_kind_of_mismatch_is_named():
    g = torch.Generator().manual_seed(1)
    w = {"a.weight": torch.randn(8, 4, generator=g), "b.weight": torch.randn(4, generator=g)}
    sent = _sent(w)
    loaded = {n: _entry([n], t, [t]) for n, t in w.items()}
    check_reports(sent, [_report(w, loaded)], server="S", version=3)

    with pytest.raises(SyncVerificationError, match="worker 0 reports .* version 2, not 3"):
        check_reports(sent, [_report(w, loaded, version=2)], server="S", version=3)
    missing = {"a.weight": w["a.weight"]}
    with pytest.raises(SyncVerificationError, match="'b.weight' was sent but not received"):
        check_reports(sent, [_report(missing, loaded)], server="S", version=3)
    bent = {**w, "b.weight": w["b.weight"] + 1}
    with pytest.raises(SyncVerificationError, match="'b.weight' arrived changed"):
        check_reports(sent, [_report(bent, loaded)], server="S", version=3)
    off_by_one_ulp = w["a.weight"].clone()
    off_by_one_ulp.view(-1).view(torch.int32)[5] += 1
    stale = {**loaded, "a.weight": _entry(["a.weight"], off_by_one_ulp, [w["a.weight"]])}
    with pytest.raises(SyncVerificationError, match="'a.weight' .* does not hold the received"):
        check_reports(sent, [_report(w, stale)], server="S", version=3)
    stale = {**loaded, "a.weight": _entry(["a.weight"], torch.zeros(8, 4), [w["a.weight"]])}
    with pytest.raises(
        SyncVerificationError, match="server S, version 3, worker 0: served parameter 'a.weight'"
    ):
        check_reports(sent, [_report(w, stale)], server="S", version=3)
    unmapped = {"b.weight": "the served model has no parameter"}
    with pytest.raises(SyncVerificationError, match="'b.weight' cannot be verified"):
        check_reports(sent, [_report(w, loaded, unverified=unmapped)], server="S", version=3)
    tied = {"b.weight": "tied"}  # an alias vLLM skips: fine
    check_reports(sent, [_report(w, loaded, unverified=tied)], server="S", version=3)


def test_tensor_parallel_shards_add_up_and_a_missing_shard_is_seen():
    """Written for tensor-parallel servers (never run on one: the CPU build has TP 1)."""
    g = torch.Generator().manual_seed(2)
    w = {"a.weight": torch.randn(8, 4, generator=g)}
    sent = _sent(w)
    shards = w["a.weight"].chunk(2)
    reports = [
        _report(w, {"a.weight": _entry(["a.weight"], s, [w["a.weight"]], sharded=True)})
        for s in shards
    ]
    check_reports(sent, reports, server="S", version=3)
    with pytest.raises(SyncVerificationError, match="workers 0 \\(shards\\)"):
        check_reports(sent, reports[:1], server="S", version=3)


def test_the_in_process_backend_reads_its_copy_back(tiny_model, tiny_tokenizer):
    """A tied model given two different values for its one tensor (embeddings and
    lm_head): the second copy overwrites the first, and the read-back names it."""
    from ludic.inference import TransformersChatClient

    assert tiny_model.config.tie_word_embeddings
    client = TransformersChatClient(tiny_model, tiny_tokenizer)
    params = {k: v.clone() for k, v in tiny_model.state_dict().items()}
    client.sync_weights(params, version=1)  # verified: fine
    params["lm_head.weight"] = params["model.embed_tokens.weight"] + 0.5
    with pytest.raises(
        SyncVerificationError, match="version 2: tensor 'model.embed_tokens.weight'"
    ):
        client.sync_weights(params, version=2)
    off = TransformersChatClient(tiny_model, tiny_tokenizer, verify_sync="off")
    off.sync_weights(params, version=3)  # what verification off would let through
