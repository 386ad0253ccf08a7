"""``ludic train`` with ``task: reward_model`` on a tiny budget: the run directory, the
saved HF folder, resume, the publisher hook, and config errors naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ludic import jobs
from ludic.cli import main
from ludic.distributed.publisher import InMemoryPublisher
from ludic.distributed.reward_publisher import RewardModelPublisher
from ludic.run.builders import RunError
from ludic.run.loading import ConfigError, load_config
from ludic.run.reward_job import train_reward_model

EXAMPLE = Path(__file__).resolve().parents[2] / "examples/configs/reward_model_tiny.yaml"
TINY = [
    "reward_model.steps=4",
    "reward_model.batch_size=8",
    "reward_model.eval_every=2",
    "reward_model.checkpoint_every=2",
    "reward_model.data.synthetic.num_pairs=40",
    "reward_model.data.eval_size=8",
    "logging.console_every=1",
]


def _records(run_dir: Path, phase: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["phase"] == phase]


def _only_run(tmp_path: Path) -> Path:
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    return run_dir


def _config(tmp_path: Path, *extra: str):
    return load_config(EXAMPLE, [f"output_dir={tmp_path}", *TINY, *extra])


@pytest.mark.parametrize("mode", ["head_only", "lora", "full"])
def test_cli_trains_a_reward_model_into_a_complete_run_directory(tmp_path: Path, mode, capsys):
    code = main(
        [
            "train",
            str(EXAMPLE),
            f"output_dir={tmp_path}",
            *TINY,
            f"reward_model.training_mode={mode}",
        ]
    )
    assert code == 0, capsys.readouterr().err
    run_dir = _only_run(tmp_path)
    for name in ["config.yaml", "metrics.jsonl", "summary.json", "preferences/train.jsonl"]:
        assert (run_dir / name).is_file(), name
    assert (run_dir / "model" / "config.json").is_file()  # the initial tiny model

    steps = _records(run_dir, "reward_model")
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for record in steps:
        assert {"loss", "accuracy", "margin_mean", "grad_norm", "lr", "tokens_per_s"} <= set(record)
    evals = _records(run_dir, "eval")
    assert [r["step"] for r in evals] == [0, 2, 4]
    assert all(r["num_pairs"] == 8 for r in evals)
    assert sorted(p.name for p in (run_dir / "checkpoints" / "reward_model").iterdir()) == [
        "step_00000002",
        "step_00000004",
    ]

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["training_mode"] == mode and summary["steps"] == 4
    assert summary["eval_accuracy_before"] == evals[0]["accuracy"]
    assert summary["eval_accuracy_after"] == evals[-1]["accuracy"]
    assert summary["train_pairs"] + summary["eval_pairs"] <= 40
    assert "ludic reward-model summary" in capsys.readouterr().out

    # The saved folder is a plain HF model (LoRA merged) that reproduces the final eval.
    final = run_dir / "reward_model"
    assert (final / "config.json").is_file() and not (final / "adapter_config.json").exists()
    saved_config = load_config(run_dir / "config.yaml")
    metrics = jobs.evaluate(saved_config, run_dir=run_dir)
    assert metrics["accuracy"] == evals[-1]["accuracy"]
    assert metrics["loss"] == pytest.approx(evals[-1]["loss"], rel=1e-5)
    # Without a run directory: the config's initial model, as evaluated at step 0.
    initial = jobs.evaluate(saved_config)
    assert initial["loss"] == pytest.approx(evals[0]["loss"], rel=1e-5)
    assert main(["eval", str(run_dir / "config.yaml"), "--run-dir", str(run_dir)]) == 0
    assert "accuracy" in capsys.readouterr().out


def test_resume_extends_a_run_exactly_like_an_uninterrupted_one(tmp_path: Path):
    straight = train_reward_model(_config(tmp_path / "a", "reward_model.steps=6"))
    short = train_reward_model(_config(tmp_path / "b"))
    resumed = train_reward_model(_config(tmp_path / "b", "reward_model.steps=6"), resume=short)
    assert resumed == short
    assert [r["step"] for r in _records(resumed, "reward_model")] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in _records(resumed, "eval")] == [0, 2, 4, 6]
    a = torch.load(straight / "checkpoints/reward_model/step_00000006/model.pt")
    b = torch.load(resumed / "checkpoints/reward_model/step_00000006/model.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class InterruptAt:
    """A publisher that raises KeyboardInterrupt (Ctrl-C) when version ``at`` arrives."""

    def __init__(self, at: int) -> None:
        self.at = at

    def publish(self, state_dict, version, *, training_mode=None) -> None:
        if version == self.at:
            raise KeyboardInterrupt


def test_ctrl_c_saves_a_checkpoint_that_resume_continues_from(tmp_path: Path):
    config = _config(tmp_path, "reward_model.publish_every=3", "reward_model.checkpoint_every=100")
    with pytest.raises(KeyboardInterrupt):
        train_reward_model(config, publisher=InterruptAt(3))
    run_dir = _only_run(tmp_path)
    checkpoints = run_dir / "checkpoints" / "reward_model"
    assert [p.name for p in checkpoints.iterdir()] == ["step_00000003"]
    assert not (run_dir / "reward_model").exists()

    train_reward_model(config, resume=run_dir, publisher=InterruptAt(-1))
    assert [r["step"] for r in _records(run_dir, "reward_model")] == [1, 2, 3, 4]
    assert [r["step"] for r in _records(run_dir, "eval")] == [0, 2, 4]
    assert (run_dir / "reward_model" / "config.json").is_file()


def test_resuming_a_finished_run_adds_no_steps_or_evaluations(tmp_path: Path):
    run_dir = train_reward_model(_config(tmp_path))
    before = (run_dir / "metrics.jsonl").read_text()
    train_reward_model(_config(tmp_path), resume=run_dir)
    assert (run_dir / "metrics.jsonl").read_text() == before


def test_resume_refuses_a_changed_setting_by_name(tmp_path: Path):
    run_dir = train_reward_model(_config(tmp_path, "reward_model.steps=1"))
    with pytest.raises(RunError, match=r"\['reward_model.lr'\]"):
        train_reward_model(_config(tmp_path, "reward_model.lr=0.5"), resume=run_dir)


def test_publisher_hook_receives_weights_every_publish_every_steps(tmp_path: Path):
    inner = InMemoryPublisher()
    config = _config(
        tmp_path, "reward_model.training_mode=head_only", "reward_model.publish_every=2"
    )
    train_reward_model(config, publisher=RewardModelPublisher(inner, training_mode="head_only"))
    assert inner.versions == [2, 4]
    assert set(inner.state_dict) == {"score.weight"}


def test_cli_refuses_publish_every_without_a_reward_server(tmp_path: Path, capsys):
    code = main(["train", str(EXAMPLE), f"output_dir={tmp_path}", "reward_model.publish_every=5"])
    assert code == 2
    assert "reward_model.publish_every=5: there is no reward server" in capsys.readouterr().err


def test_jsonl_data_and_a_missing_file(tmp_path: Path):
    from ludic.run.demos import synthetic_arithmetic_preferences
    from ludic.training.reward_model.preferences import write_preferences_jsonl

    data = write_preferences_jsonl(synthetic_arithmetic_preferences(20), tmp_path / "p.jsonl")
    run_dir = train_reward_model(
        _config(
            tmp_path,
            f"reward_model.data.path={data}",
            "reward_model.data.synthetic={}",
            "reward_model.steps=1",
        )
    )
    train = (run_dir / "preferences/train.jsonl").read_text().splitlines()
    evals = (run_dir / "preferences/eval.jsonl").read_text().splitlines()
    assert len(evals) == 8 and len(train) + len(evals) <= 20
    with pytest.raises(RunError, match="reward_model.data.path: preference file .* does not exist"):
        train_reward_model(
            _config(
                tmp_path,
                f"reward_model.data.path={tmp_path / 'none.jsonl'}",
                "reward_model.data.synthetic={}",
            )
        )


def test_missing_model_path_is_a_run_error_naming_the_field(tmp_path: Path):
    with pytest.raises(RunError, match="reward_model.path: folder '/no/such/rm' does not exist"):
        train_reward_model(
            _config(tmp_path, "reward_model.path=/no/such/rm", "reward_model.tiny={}")
        )


# ---------------------------------------------------------------- config validation


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["task=rm"], "task: Input should be 'policy' or 'reward_model'"),
        (["reward_model.steps=5"], "reward_model is set but task is 'policy'"),
        (["task=reward_model", "trainer.lr=0.1"], "does not read ['trainer']"),
        (
            ["task=reward_model", "reward_model.training_mode=partial"],
            "reward_model.training_mode: Input should be 'head_only', 'lora' or 'full'",
        ),
        (
            ["task=reward_model", "reward_model.lora.r=4"],
            "reward_model: lora is set but training_mode='full'",
        ),
        (["task=reward_model", "reward_model.lrr=1"], "reward_model.lrr: unknown field"),
        (
            ["task=reward_model", "reward_model.lr=0"],
            "reward_model.lr=0.0 is invalid; expected a finite",
        ),
        (
            ["task=reward_model", "reward_model.data.eval_size=0"],
            "reward_model.data.eval_size: Input should be greater than or equal to 1",
        ),
        (
            [
                "task=reward_model",
                "reward_model.data.path=p.jsonl",
                "reward_model.data.synthetic.seed=3",
            ],
            "reward_model.data: path is set, so synthetic is not used",
        ),
        (
            ["task=reward_model", "reward_model.path=/m", "reward_model.tiny.num_layers=1"],
            "reward_model: path is set, so tiny is not used",
        ),
        (
            ["task=reward_model", "reward_model.data.synthetic.min_digits=3"],
            "reward_model.data.synthetic: min_digits=3 > max_digits=1",
        ),
        (
            [
                "task=reward_model",
                "reward_model.lr_schedule=cosine",
                "reward_model.warmup_steps=300",
            ],
            "reward_model: lr_schedule='cosine' decays to 0 at steps=300",
        ),
    ],
)
def test_bad_reward_model_configs_fail_in_one_line_naming_the_field(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_example_config_is_a_reward_model_task():
    config = load_config(EXAMPLE)
    assert config.task == "reward_model" and config.reward_model.path is None
    assert config.reward_model.training_mode == "full" and config.reward_model.publish_every == 0
