"""flatten_parameters: one flat buffer per dtype, same values and Parameter objects, the
same training, and state dicts whose tensors a weight sync can send without packing."""

from __future__ import annotations

import pytest
import torch
from tests.training.test_trainer import ListSource, _algorithm, _config, _items

from ludic.distributed.weight_transfer import ModelWeightExtractor
from ludic.distributed.weight_transfer.packing import as_bytes, contiguous_bytes
from ludic.models.tiny import build_tiny_causal_lm
from ludic.training.flat_parameters import flatten_parameters
from ludic.training.trainer import Trainer
from ludic.training.types import SAWBatch


def test_parameters_keep_identity_and_values_and_share_one_buffer(tiny_model) -> None:
    before = {name: (p, p.detach().clone()) for name, p in tiny_model.named_parameters()}
    [flat] = flatten_parameters(tiny_model)
    params = list(tiny_model.named_parameters())
    assert flat.numel() == sum(p.numel() for _, p in params)
    for name, param in params:
        assert param is before[name][0]  # optimizers keep pointing at the same objects
        assert torch.equal(param, before[name][1])
        assert param.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    run = contiguous_bytes([p.detach() for _, p in params])
    assert run is not None and torch.equal(run, as_bytes(flat))


def test_one_buffer_per_dtype_and_tied_parameters_once() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 3))
    model[1].weight = torch.nn.Parameter(model[1].weight.detach().to(torch.float64))
    shared = torch.nn.Linear(2, 2, bias=False)
    model.append(shared).append(shared)  # one module under two names
    buffers = flatten_parameters(model)
    assert {b.dtype for b in buffers} == {torch.float32, torch.float64} and len(buffers) == 2
    f32 = next(b for b in buffers if b.dtype == torch.float32)
    assert f32.numel() == 3 * 4 + 4 + 3 + 2 * 2  # the tied weight counted once


def test_training_on_flat_parameters_matches_training_on_separate_ones(tiny_tokenizer) -> None:
    batch = SAWBatch(_items(3))
    losses = {}
    for flat in (False, True):
        model = build_tiny_causal_lm(tiny_tokenizer, seed=0)
        trainer = Trainer(model, _algorithm(), ListSource(batch), _config(flat_parameters=flat))
        losses[flat] = [m["loss"] for m in trainer.train_sync(3)]
        if flat:  # still one buffer after optimizer steps
            storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
            assert len(storages) == 1
    assert losses[True] == pytest.approx(losses[False], rel=1e-6)


def test_a_flat_models_chunks_need_no_packing_except_around_aliases(tiny_model) -> None:
    flatten_parameters(tiny_model)
    assert tiny_model.config.tie_word_embeddings  # lm_head.weight aliases the embedding
    extractor = ModelWeightExtractor(chunk_bytes=2**20)  # lm_head joins the last layers
    chunks = list(extractor.extract_state_dict(tiny_model.state_dict()))
    assert len(chunks) >= 2 and len(chunks[-1]) > 1 and chunks[-1].names[-1] == "lm_head.weight"
    for chunk in chunks[:-1]:
        assert contiguous_bytes(chunk.tensors) is not None, chunk.names
    assert contiguous_bytes(chunks[-1].tensors) is None  # the alias points back
    assert contiguous_bytes(chunks[-1].tensors[:-1]) is not None
