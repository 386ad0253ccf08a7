"""Reward-model training with a real tiny Qwen2 sequence classifier on CPU: what each
training mode changes, what it publishes, the saved HF folder, resume, and clear errors."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from ludic.distributed.publisher import InMemoryPublisher
from ludic.distributed.reward_publisher import (
    PEFT_MARKERS,
    RewardModelPublisher,
    reward_sync_params,
)
from ludic.models.tiny import build_tiny_causal_lm, build_tiny_reward_model
from ludic.run.demos import synthetic_arithmetic_preferences
from ludic.training.checkpoint import CheckpointConfig
from ludic.training.reward_model.config import PreferenceTrainerConfig
from ludic.training.reward_model.preferences import PreferencePair
from ludic.training.reward_model.trainer import (
    LoraSettings,
    PreferenceTrainer,
    evaluate_preferences,
    prepare_reward_model,
    reward_scores,
    save_reward_model,
)

peft = pytest.importorskip("peft")

HEAD = "score.weight"
LR = {"head_only": 1e-2, "lora": 1e-2, "full": 1e-3}
PAIRS = synthetic_arithmetic_preferences(8, seed=0)


@pytest.fixture
def base(tiny_tokenizer):
    """A fresh tiny reward model (seed 0) and a detached copy of its initial weights."""
    model = build_tiny_reward_model(tiny_tokenizer, seed=0)
    return model, {n: t.detach().clone() for n, t in model.state_dict().items()}


def _trainer(model, tokenizer, mode, *, pairs=PAIRS, publisher=None, **config):
    settings = {"lr": LR[mode], "batch_size": len(pairs), **config}
    return PreferenceTrainer(
        model,
        tokenizer,
        pairs,
        PreferenceTrainerConfig(**settings),
        training_mode=mode,
        publisher=publisher,
    )


def _changed(before, after) -> set[str]:
    return {n for n in before if not torch.equal(before[n], after[n])}


# ---------------------------------------------------------------- each mode learns


@pytest.mark.parametrize("mode", ["head_only", "lora", "full"])
def test_each_mode_lowers_the_bt_loss_on_a_fixed_set(mode, base, tiny_tokenizer):
    model = prepare_reward_model(base[0], mode)
    trainer = _trainer(model, tiny_tokenizer, mode)
    before = trainer.evaluate(PAIRS)
    history = trainer.train(6)
    after = trainer.evaluate(PAIRS)
    assert after["loss"] < 0.8 * before["loss"]
    assert after["margin_mean"] > before["margin_mean"]
    assert history[-1]["loss"] < history[0]["loss"]
    assert [k in history[0] for k in ("accuracy", "grad_norm", "lr", "tokens_per_s")] == [True] * 4
    assert trainer.step == 6


def test_head_only_changes_the_head_and_leaves_every_backbone_tensor_bit_identical(
    base, tiny_tokenizer
):
    model, initial = base
    trainer = _trainer(prepare_reward_model(model, "head_only"), tiny_tokenizer, "head_only")
    trainer.train(3)
    assert _changed(initial, model.state_dict()) == {HEAD}
    assert [n for n, p in model.named_parameters() if p.requires_grad] == [HEAD]


def test_lora_changes_the_merged_backbone_and_head_but_not_the_base_weights(base, tiny_tokenizer):
    model, initial = base
    lora = LoraSettings(r=4, alpha=8, target_modules=("q_proj", "v_proj"))
    peft_model = prepare_reward_model(model, "lora", lora=lora)
    publisher = InMemoryPublisher()
    trainer = _trainer(
        peft_model,
        tiny_tokenizer,
        "lora",
        publish_every=3,
        publisher=RewardModelPublisher(publisher, training_mode="lora"),
    )
    trainer.train(3)
    # the frozen base weights under the adapters are untouched ...
    base_weights = {
        n.replace("base_model.model.", "").replace(".base_layer", ""): t
        for n, t in peft_model.state_dict().items()
        if not any(m in n for m in ("lora_", "modules_to_save", "original_module"))
    }
    assert not _changed({n: initial[n] for n in base_weights}, base_weights)
    # ... while the published (merged) weights differ exactly on adapted layers + head
    published = publisher.state_dict
    assert publisher.versions == [3]
    assert set(published) == set(initial)  # base-model names, nothing else
    assert not [n for n in published if any(m in n for m in PEFT_MARKERS)]
    assert set(reward_sync_params(published, "lora")) == set(initial)
    changed = _changed(initial, published)
    assert HEAD in changed
    assert "model.layers.0.self_attn.q_proj.weight" in changed
    assert {n.rsplit(".", 2)[-2] for n in changed - {HEAD}} <= {"q_proj", "v_proj"}


def test_full_changes_backbone_and_head(base, tiny_tokenizer):
    model, initial = base
    trainer = _trainer(prepare_reward_model(model, "full"), tiny_tokenizer, "full")
    trainer.train(2)
    changed = _changed(initial, model.state_dict())
    assert HEAD in changed and "model.embed_tokens.weight" in changed
    assert "model.layers.1.mlp.down_proj.weight" in changed


@pytest.mark.parametrize("mode", ["head_only", "full"])
def test_publishes_mode_sized_state_every_publish_every_steps(mode, base, tiny_tokenizer):
    model, initial = base
    inner = InMemoryPublisher()
    trainer = _trainer(
        prepare_reward_model(model, mode),
        tiny_tokenizer,
        mode,
        publish_every=2,
        publisher=RewardModelPublisher(inner),
    )
    trainer.train(5)
    assert inner.versions == [2, 4]
    expected = {HEAD} if mode == "head_only" else set(initial)
    assert set(inner.state_dict) == expected


# ---------------------------------------------------------------- scoring and saving


def test_reward_is_read_at_the_last_real_token_of_a_right_padded_batch(base, tiny_tokenizer):
    model = base[0].eval()
    texts = ["3+4=\n7", "12+30=\n42", "1\n1"]
    with torch.no_grad():
        batched = reward_scores(model, tiny_tokenizer, texts)
        alone = torch.cat([reward_scores(model, tiny_tokenizer, [t]) for t in texts])
    torch.testing.assert_close(batched, alone, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_saved_folder_is_a_plain_hf_model_scoring_like_the_trained_one(
    mode, base, tiny_tokenizer, tmp_path
):
    model = prepare_reward_model(base[0], mode)
    trainer = _trainer(model, tiny_tokenizer, mode)
    trainer.train(2)
    folder = save_reward_model(trainer.model, tiny_tokenizer, tmp_path / "rm")
    assert not (folder / "adapter_config.json").exists()
    loaded = AutoModelForSequenceClassification.from_pretrained(folder)
    assert not hasattr(loaded, "peft_config") and loaded.config.num_labels == 1
    ours = evaluate_preferences(trainer.model, tiny_tokenizer, PAIRS)
    theirs = evaluate_preferences(loaded, tiny_tokenizer, PAIRS)
    assert theirs["loss"] == pytest.approx(ours["loss"], rel=1e-5)
    assert theirs["accuracy"] == ours["accuracy"]


def test_resume_continues_exactly_where_an_uninterrupted_run_would_be(tiny_tokenizer, tmp_path):
    pairs = synthetic_arithmetic_preferences(12, seed=1)  # batches of 5 cross epochs

    def make(checkpoint=None):
        model = prepare_reward_model(build_tiny_reward_model(tiny_tokenizer, seed=0), "full")
        return PreferenceTrainer(
            model,
            tiny_tokenizer,
            pairs,
            PreferenceTrainerConfig(lr=1e-3, batch_size=5, lr_schedule="linear", total_steps=6),
            training_mode="full",
            checkpoint=checkpoint,
        )

    straight = make()
    straight.train(6)
    first = make(CheckpointConfig(tmp_path, every_n_steps=3))
    first.train(3)
    second = make(CheckpointConfig(tmp_path, every_n_steps=3))
    assert second.resume() == 3
    second.train(3)
    for (name, a), b in zip(
        straight.model.state_dict().items(), second.model.state_dict().values()
    ):
        assert torch.equal(a, b), name


def test_margins_of_pairs_reach_the_loss(base, tiny_tokenizer):
    model = prepare_reward_model(base[0], "head_only")
    plain = evaluate_preferences(model, tiny_tokenizer, PAIRS)
    with_margin = [PreferencePair(p.prompt, p.chosen, p.rejected, margin=3.0) for p in PAIRS]
    harder = evaluate_preferences(model, tiny_tokenizer, with_margin)
    assert harder["loss"] > plain["loss"] + 1.0
    assert harder["accuracy"] == plain["accuracy"]  # accuracy ignores the margin


# ---------------------------------------------------------------- errors


def test_unknown_mode_lists_the_valid_ones(base):
    with pytest.raises(ValueError, match="unknown reward-model training mode 'partial'.*head_only"):
        prepare_reward_model(base[0], "partial")


def test_model_without_a_head_is_refused(tiny_tokenizer):
    with pytest.raises(ValueError, match="Qwen2ForCausalLM has no classification head"):
        prepare_reward_model(build_tiny_causal_lm(tiny_tokenizer), "full")


def test_lora_settings_for_another_mode_and_peft_inputs_are_refused(base):
    with pytest.raises(ValueError, match="lora settings given for training_mode='full'"):
        prepare_reward_model(base[0], "full", lora=LoraSettings())
    wrapped = prepare_reward_model(base[0], "lora")
    with pytest.raises(ValueError, match="already a peft model"):
        prepare_reward_model(wrapped, "lora")


def test_unmatched_lora_targets_are_named(base):
    with pytest.raises(ValueError, match="lora.target_modules"):
        prepare_reward_model(base[0], "lora", lora=LoraSettings(target_modules=("nope",)))


def test_empty_pairs_are_refused(base, tiny_tokenizer):
    model = prepare_reward_model(base[0], "full")
    with pytest.raises(ValueError, match="no preference pairs"):
        _trainer(model, tiny_tokenizer, "full", pairs=[], batch_size=1)
    with pytest.raises(ValueError, match="no pairs to evaluate"):
        evaluate_preferences(model, tiny_tokenizer, [])


def test_a_model_prepared_for_another_mode_is_refused(base, tiny_tokenizer):
    model = prepare_reward_model(base[0], "full")
    with pytest.raises(ValueError, match=r"not prepared for training_mode='head_only'.*trainable"):
        _trainer(model, tiny_tokenizer, "head_only")
    with pytest.raises(ValueError, match="not prepared for training_mode='lora'"):
        _trainer(model, tiny_tokenizer, "lora")


def test_pad_token_mismatch_is_refused(base, tiny_tokenizer):
    model = prepare_reward_model(base[0], "full")
    model.config.pad_token_id = 0
    with pytest.raises(ValueError, match=r"model.config.pad_token_id=0 but tokenizer.pad_token_id"):
        _trainer(model, tiny_tokenizer, "full")


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"publish_every": 2}, "publish_every=2 but no publisher"),
        ({"batch_size": 9}, "batch_size=9 exceeds the 8 training pairs"),
    ],
)
def test_trainer_settings_that_cannot_work_are_refused(base, tiny_tokenizer, config, message):
    model = prepare_reward_model(base[0], "full")
    with pytest.raises(ValueError, match=message):
        _trainer(model, tiny_tokenizer, "full", **config)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lr": 0.0}, r"PreferenceTrainerConfig.lr=0.0 is invalid"),
        ({"batch_size": 0}, r"PreferenceTrainerConfig.batch_size=0 is invalid"),
        ({"lr_schedule": "cosine"}, r"PreferenceTrainerConfig.total_steps=None"),
        ({"lr_schedule": "step"}, r"PreferenceTrainerConfig.lr_schedule='step'"),
    ],
)
def test_config_errors_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PreferenceTrainerConfig(**kwargs)


def test_text_containing_the_pad_token_is_refused(base, tiny_tokenizer):
    pad = tiny_tokenizer.pad_token
    with pytest.raises(ValueError, match="contains the pad token"):
        reward_scores(base[0], tiny_tokenizer, [f"1+1=\n2{pad}"])
