"""KVDecoder: the lean decoding forward agrees with each served model's own forward, and
the in-process client samples the same tokens through it as through the model's forward."""

from __future__ import annotations

import pytest
import torch
from tests.llama_shaped import SHAPE, llama_shaped
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from ludic.inference.kv_decoder import KVDecoder, decoder_problem
from ludic.inference.request import CompletionRequest, InferenceSpec, SamplingSpec
from ludic.inference.transformers_client import TransformersChatClient


def _model(kind: str) -> torch.nn.Module:
    return llama_shaped(kind)


def _reference(model: torch.nn.Module, ids: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=attention, position_ids=positions).logits[:, -1]


@pytest.mark.parametrize("fuse", [True, False])
@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "llama", "mistral"])
def test_prefill_and_every_step_match_the_models_forward(
    kind: str, fuse: bool, monkeypatch
) -> None:
    """With the projections fused (a small model) and called one by one (over FUSE_BYTES)."""
    if not fuse:
        monkeypatch.setattr("ludic.models.lean_layers.FUSE_BYTES", 0)
    model = _model(kind)
    assert decoder_problem(model) is None
    ids = torch.randint(1, 64, (3, 6))
    attention = torch.ones(3, 6, dtype=torch.long)
    attention[0, :4] = 0  # left padding of different widths
    attention[2, :1] = 0
    decoder = KVDecoder(model, capacity=6 + 5)
    assert (decoder.fused is not None) == fuse
    torch.testing.assert_close(decoder.prefill(ids, attention), _reference(model, ids, attention))
    rows = torch.tensor([0, 0, 1, 2, 2, 2])  # one row per request, as a group asks
    decoder.select(rows)
    seq, mask = ids[rows], attention[rows]
    for _ in range(5):
        token = torch.randint(1, 64, (6,))
        logits = decoder.step(token)
        seq = torch.cat([seq, token[:, None]], dim=1)
        mask = torch.cat([mask, torch.ones(6, 1, dtype=torch.long)], dim=1)
        torch.testing.assert_close(logits, _reference(model, seq, mask), atol=2e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="cache is full"):
        decoder.step(torch.ones(6, dtype=torch.long))


def test_a_lora_adapter_is_applied_as_in_the_models_forward() -> None:
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(
        _model("qwen2"), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"])
    )
    for name, p in model.named_parameters():
        if "lora_B" in name:  # non-zero, so that the adapter changes the logits
            torch.nn.init.normal_(p, std=0.5)
    ids, attention = torch.randint(1, 64, (2, 5)), torch.ones(2, 5, dtype=torch.long)
    decoder = KVDecoder(model, capacity=8)
    assert decoder.fused is None  # wrapped projections are called, never fused
    logits = decoder.prefill(ids, attention)
    torch.testing.assert_close(logits, _reference(model, ids, attention))
    token = torch.tensor([7, 9])
    stepped = decoder.step(token)
    longer = torch.cat([ids, token[:, None]], dim=1)
    torch.testing.assert_close(stepped, _reference(model, longer, torch.ones_like(longer)))
    with model.disable_adapter():
        assert not torch.allclose(logits, _reference(model, ids, attention))


def test_unserved_models_are_named_with_the_reason() -> None:
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2))
    assert "gpt2" in decoder_problem(gpt2)
    sliding = Qwen2Config(**SHAPE, use_sliding_window=True, sliding_window=4, max_window_layers=0)
    assert "sliding_attention" in decoder_problem(Qwen2ForCausalLM(sliding))
    windowed = MistralForCausalLM(MistralConfig(**SHAPE, sliding_window=4))
    assert "sliding" in decoder_problem(windowed)
    hooked = _model("qwen2")
    hooked.model.layers[1].mlp.register_forward_hook(lambda *_: None)
    assert "layers.1.mlp has forward hooks" in decoder_problem(hooked)
    dynamic = LlamaConfig(**SHAPE, rope_parameters={"rope_type": "dynamic", "factor": 2.0})
    assert "'dynamic' depends on the sequence length" in decoder_problem(LlamaForCausalLM(dynamic))
    with pytest.raises(ValueError, match="gpt2"):
        KVDecoder(gpt2, capacity=8)
    client = TransformersChatClient(gpt2, _Tokenizer())
    assert client.decode == "transformers"


class _Tokenizer:
    eos_token_id = 0
    pad_token_id = 0

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(str(int(i)) for i in ids)


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_the_client_samples_the_same_tokens_lean_or_through_the_models_forward(kind) -> None:
    model = _model(kind)
    lean = TransformersChatClient(model, _Tokenizer(), eos_token_ids=[0])
    plain = TransformersChatClient(model, _Tokenizer(), eos_token_ids=[0], lean_decode=False)
    assert (lean.decode, plain.decode) == ("lean", "transformers")
    requests = [
        CompletionRequest(
            prompt_token_ids=prompt,
            inference=InferenceSpec(
                sampling=SamplingSpec(temperature=temperature, max_tokens=8, seed=seed)
            ),
        )
        for prompt, temperature, seed in [
            ([5, 6, 7], 1.0, 1),
            ([5, 6, 7], 1.0, 2),
            ([9], 0.0, None),
            ([3, 4, 5, 6, 7, 8], 0.7, 3),
        ]
    ]
    got = [r.trace for r in lean._generate(requests)]
    want = [r.trace for r in plain._generate(requests)]
    for a, b in zip(got, want):
        assert a.completion_token_ids == b.completion_token_ids
        assert a.completion_logprobs == pytest.approx(b.completion_logprobs, abs=1e-5)


@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "llama", "mistral"])
def test_each_rms_norm_runs_as_one_op_to_the_bit_and_other_norms_are_called(kind) -> None:
    """``_norm`` gives the module's own float32 values and gradients bit for bit (the
    decoder's and the update's norms, Qwen3's per-head ones too); a float64 input, a
    subclass or another norm goes through the module (its forward computes in float32)."""
    from ludic.models.lean_layers import _norm

    model = _model(kind)
    layer = model.model.layers[0]
    norms = [layer.input_layernorm, layer.post_attention_layernorm, model.model.norm]
    if kind == "qwen3":
        norms += [layer.self_attn.q_norm, layer.self_attn.k_norm]
    for norm in norms:
        with torch.no_grad():
            norm.weight.normal_()
        size = norm.weight.shape[0]
        x = (torch.randn(3, 5, size) * 4).requires_grad_()
        calls = []
        handle = norm.register_forward_hook(lambda *args, calls=calls: calls.append(1))
        ours = _norm(norm, x)
        assert calls == []  # one op, not the module
        _norm(norm, x.detach().double())  # a float64 input: the module's own forward
        assert calls == [1]
        handle.remove()
        theirs = norm(x)
        assert torch.equal(ours, theirs)
        g = torch.randn_like(ours)
        assert all(
            torch.equal(a, b)
            for a, b in zip(
                torch.autograd.grad(ours, [x, norm.weight], g),
                torch.autograd.grad(theirs, [x, norm.weight], g),
            )
        )

    class Scaled(type(model.model.norm)):  # a subclass may compute anything: called
        def forward(self, hidden):
            return 2 * super().forward(hidden)

    scaled = Scaled(SHAPE["hidden_size"])
    x = torch.randn(2, SHAPE["hidden_size"])
    assert torch.equal(_norm(scaled, x), 2 * model.model.norm.__class__.forward(scaled, x))
