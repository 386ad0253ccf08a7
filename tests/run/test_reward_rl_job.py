"""``ludic train`` RL on a learned reward (``algorithm.name: reward_rl``): a reward model
trained by a ``task: reward_model`` run scores the policy's completions; config errors
name the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ludic.cli import demo_config_path, main
from ludic.run.loading import ConfigError, load_config

RM_CONFIG = Path(__file__).resolve().parents[2] / "examples/configs/reward_model_tiny.yaml"
POLICY_TINY = [
    "warm_start.steps=2",
    "warm_start.num_demos=8",
    "warm_start.batch_size=8",
    "trainer.steps=2",
    "trainer.prompts_per_step=2",
    "algorithm.group_size=2",
    "eval.num_problems=4",
    "env.kwargs.num_problems=8",
    "logging.console_every=1",
]


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("rm_runs")
    args = [
        "train",
        str(RM_CONFIG),
        f"output_dir={out}",
        "reward_model.steps=3",
        "reward_model.batch_size=8",
        "reward_model.data.synthetic.num_pairs=40",
        "reward_model.data.eval_size=8",
    ]
    assert main(args) == 0
    (run_dir,) = [p for p in out.iterdir() if p.is_dir()]
    return run_dir / "reward_model"


@pytest.mark.parametrize("mode", ["replace", "weighted"])
def test_policy_trains_on_reward_model_scores(tmp_path: Path, reward_model_dir: Path, mode, capsys):
    args = [
        "train",
        str(demo_config_path()),
        f"output_dir={tmp_path}",
        *POLICY_TINY,
        "algorithm.name=reward_rl",
        f"reward.path={reward_model_dir}",
        f"reward.mode={mode}",
    ]
    assert main(args) == 0, capsys.readouterr().err
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    samples = [json.loads(x) for x in (run_dir / "samples.jsonl").read_text().splitlines()]
    rl = [s for s in samples if s.get("phase", "rl") == "rl" and "rm_scores" in s["meta"]]
    assert rl, "no RL rollout carries reward-model scores"
    for sample in rl:
        score = sample["meta"]["rm_scores"][-1]
        assert 0.0 < score < 1.0  # the sigmoid of the reward model's logit


def test_reward_rl_needs_a_reward_section(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"algorithm.name=reward_rl needs a reward section"):
        load_config(demo_config_path(), [f"output_dir={tmp_path}", "algorithm.name=reward_rl"])


def test_a_reward_section_needs_reward_rl(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"reward is set but algorithm.name='grpo'"):
        load_config(demo_config_path(), [f"output_dir={tmp_path}", "reward.path=/x"])


def test_bad_reward_fields_are_named(tmp_path: Path) -> None:
    base = [f"output_dir={tmp_path}", "algorithm.name=reward_rl", "reward.path=/x"]
    with pytest.raises(ConfigError, match=r"reward.mode"):
        load_config(demo_config_path(), [*base, "reward.mode=divide"])
    with pytest.raises(ConfigError, match=r"reward.weight"):
        load_config(demo_config_path(), [*base, "reward.weight=1.5"])


def test_a_missing_reward_model_folder_is_named(tmp_path: Path, capsys) -> None:
    args = [
        "train",
        str(demo_config_path()),
        f"output_dir={tmp_path}",
        *POLICY_TINY,
        "algorithm.name=reward_rl",
        f"reward.path={tmp_path / 'nowhere'}",
    ]
    assert main(args) == 2
    assert "reward.path" in capsys.readouterr().err
