"""``algorithm.kl_coef`` from the config: a KL penalty to a frozen reference model, the
policy as RL starts, loaded once (RUN_DIR/reference after a warm start, the same one on
resume); and ``algorithm.entropy_coef``, an entropy bonus."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ludic import jobs
from ludic.run.builders import make_algorithm
from ludic.run.loading import ConfigError, load_config
from ludic.training.losses import CompositeLoss, EntropyBonus, KLPenalty

DEMO = Path(jobs.__file__).parent / "configs" / "arithmetic_demo.yaml"
TINY = [
    "model.tiny={hidden_size: 64, num_layers: 1, num_heads: 1, seed: 0}",
    "warm_start.steps=3",
    "warm_start.num_demos=8",
    "warm_start.batch_size=8",
    "trainer.steps=3",
    "trainer.prompts_per_step=2",
    "trainer.checkpoint_every=3",
    "algorithm.group_size=2",
    "eval.num_problems=2",
    "env.kwargs.num_problems=8",
    "algorithm.kl_coef=0.5",
    "algorithm.kl_estimator=k2",
    # the policy moves every step even when each group's samples earn one reward (no
    # advantage, no policy gradient: which steps those are depends on the sampled tokens):
    # decoupled decay shrinks every weight by lr x 10 (0.4% at the demo's lr) each step
    "trainer.weight_decay=10",
]


def test_the_kl_fields_wrap_the_presets_loss() -> None:
    algorithm = make_algorithm(load_config(DEMO, ["algorithm.kl_coef=0.04"]))
    assert isinstance(algorithm.loss, CompositeLoss) and algorithm.loss.requires_ref_logprobs
    (_, _, policy), (name, weight, penalty) = algorithm.loss.terms
    assert name == "kl" and weight == 1.0
    assert isinstance(penalty, KLPenalty) and (penalty.beta, penalty.estimator) == (0.04, "k3")
    assert penalty.aggregation == policy.aggregation  # averaged like GRPO's surrogate
    assert not make_algorithm(load_config(DEMO)).loss.requires_ref_logprobs
    with pytest.raises(ConfigError, match="kl_estimator is set but kl_coef is 0"):
        load_config(DEMO, ["algorithm.kl_estimator=k1"])
    with pytest.raises(ConfigError, match="kl_coef: Input should be greater than or equal to 0"):
        load_config(DEMO, ["algorithm.kl_coef=-1"])
    with pytest.raises(ConfigError, match=r"world_size=2 \(FSDP2\) does not work with algorithm"):
        load_config(DEMO, ["algorithm.kl_coef=0.1", "trainer.world_size=2"])


def _kl(run_dir: Path) -> dict[int, float]:
    records = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["loss/kl/kl"] for r in records if r["phase"] == "rl"}


def test_the_reference_is_the_policy_as_rl_starts_and_survives_a_resume(tmp_path) -> None:
    run_dir = jobs.train(load_config(DEMO, [f"output_dir={tmp_path}", *TINY]))
    reference = run_dir / "reference" / "model.safetensors"
    assert reference.is_file()
    kl = _kl(run_dir)
    # step 1 trains the warm-started policy, which is the reference: no distance yet
    assert kl[1] == pytest.approx(0.0, abs=1e-7)
    assert kl[3] > 1e-6
    written = reference.stat().st_mtime_ns
    resumed = load_config(run_dir / "config.yaml", ["trainer.steps=5"])
    assert jobs.train(resumed, resume=run_dir) == run_dir
    assert reference.stat().st_mtime_ns == written  # read, not rebuilt from the RL policy
    kl = _kl(run_dir)
    assert sorted(kl) == [1, 2, 3, 4, 5] and kl[5] > 1e-6


def _entropy(run_dir: Path) -> dict[int, float]:
    records = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["entropy"] for r in records if r["phase"] == "rl"}


def test_the_entropy_coef_adds_a_bonus_that_raises_the_entropy(tmp_path) -> None:
    algorithm = make_algorithm(load_config(DEMO, ["algorithm.entropy_coef=0.01"]))
    assert isinstance(algorithm.loss, CompositeLoss) and algorithm.loss.requires_entropy
    assert not algorithm.loss.requires_ref_logprobs  # no reference model for this one
    (_, _, policy), (name, weight, bonus) = algorithm.loss.terms
    assert name == "entropy" and weight == 1.0
    assert isinstance(bonus, EntropyBonus) and bonus.coef == 0.01
    assert bonus.aggregation == policy.aggregation
    with pytest.raises(ConfigError, match="entropy_coef: Input should be greater than or equal"):
        load_config(DEMO, ["algorithm.entropy_coef=-0.1"])
    both = make_algorithm(
        load_config(DEMO, ["algorithm.entropy_coef=0.01", "algorithm.kl_coef=0.1"])
    )
    assert [name for name, _, _ in both.loss.terms] == ["policy", "kl", "entropy"]

    # The same short run with and without a bonus (the warm start's 40 steps at lr 1e-2
    # lower the entropy first): with it, the entropy is higher after the first update.
    same = [f for f in TINY if not f.startswith(("algorithm.kl", "trainer.weight_decay"))]
    same += ["warm_start.steps=40", "warm_start.lr=1e-2", "trainer.lr=1e-2"]
    entropy = {}
    for coef in (0.0, 1.0):
        out = tmp_path / f"coef{coef}"
        run_dir = jobs.train(
            load_config(DEMO, [f"output_dir={out}", *same, f"algorithm.entropy_coef={coef}"])
        )
        entropy[coef] = _entropy(run_dir)
    assert entropy[0.0][1] == pytest.approx(entropy[1.0][1])  # same policy at step 1
    # (each step's entropy is that of its own samples' positions)
    assert all(entropy[1.0][step] > entropy[0.0][step] + 1.0 for step in (2, 3))
