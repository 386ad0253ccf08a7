"""The main job on a tiny budget: run directory, Ctrl-C + resume, clear failures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ludic import jobs
from ludic.run import phases
from ludic.run.builders import RunError
from ludic.run.loading import load_config

TINY = [
    "warm_start.steps=4",
    "warm_start.num_demos=8",
    "warm_start.batch_size=8",
    "trainer.steps=4",
    "trainer.prompts_per_step=2",
    "trainer.checkpoint_every=2",
    "algorithm.group_size=2",
    "eval.num_problems=4",
    "logging.console_every=1",
    "env.kwargs.num_problems=8",
]


def _config(tmp_path: Path, *extra: str):
    demo = Path(jobs.__file__).parent / "configs" / "arithmetic_demo.yaml"
    return load_config(demo, [f"output_dir={tmp_path}", *TINY, *extra])


def _records(run_dir: Path, phase: str) -> list[dict]:
    text = (run_dir / "metrics.jsonl").read_text()
    # Another process may be appending: a last line without its newline is not complete.
    lines = text.split("\n")[:-1]
    return [r for r in map(json.loads, lines) if r["phase"] == phase]


def test_train_leaves_a_complete_run_directory(tmp_path: Path) -> None:
    run_dir = jobs.train(_config(tmp_path))
    for name in [
        "config.yaml",
        "metrics.jsonl",
        "samples.jsonl",
        "reward_curve.png",
        "summary.json",
    ]:
        assert (run_dir / name).is_file(), name
    assert (run_dir / "model" / "config.json").is_file()
    rl = _records(run_dir, "rl")
    assert [r["step"] for r in rl] == [1, 2, 3, 4]
    for record in rl:
        assert {"step", "reward_mean", "loss", "tokens_per_s", "policy_version"} <= record.keys()
        assert record["policy_version"] == record["step"]
    assert [r["step"] for r in _records(run_dir, "warm_start")] == [1, 2, 3, 4]
    assert [r["step"] for r in _records(run_dir, "eval")] == [0, 4]
    assert sorted(p.name for p in (run_dir / "checkpoints" / "rl").iterdir()) == [
        "step_00000002",
        "step_00000004",
    ]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rl_steps"] == 4
    assert summary["sample_audit"]["trained_samples"] > 0  # trained against dropped items
    ledger = summary["token_ledger"]
    assert ledger["generated"] == sum(v for k, v in ledger.items() if k != "generated") > 0
    assert (run_dir / "reward_curve.png").read_bytes()[:4] == b"\x89PNG"

    # `ludic eval --run-dir`: the newest checkpoint reproduces the run's final greedy eval.
    final = _records(run_dir, "eval")[-1]
    metrics = jobs.evaluate(_config(tmp_path), run_dir=run_dir)
    assert metrics["success_rate"] == final["success_rate"]
    assert metrics["reward_mean"] == pytest.approx(final["reward_mean"])


def test_missing_model_path_is_a_run_error_naming_the_field(tmp_path: Path) -> None:
    with pytest.raises(RunError, match="model.path: folder '/no/such/model' does not exist"):
        jobs.train(_config(tmp_path, "model.path=/no/such/model"))


def test_resume_refuses_a_different_config(tmp_path: Path) -> None:
    run_dir = jobs.train(_config(tmp_path, "trainer.steps=1", "warm_start.steps=1"))
    with pytest.raises(RunError, match=r"trainer.lr"):
        jobs.train(_config(tmp_path, "trainer.lr=0.1"), resume=run_dir)


def test_interrupt_then_resume_continues_like_an_uninterrupted_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C during RL leaves a checkpoint of the last completed step; resuming finishes
    with the same step count and (restored optimizer, RNGs and step-seeded problems) the
    same losses and rewards as a run that was never interrupted."""
    steps = ["trainer.steps=6", "trainer.checkpoint_every=100"]
    reference = jobs.train(_config(tmp_path / "a", *steps))

    from ludic.training.trainer import Trainer

    real_step = Trainer.train_step

    async def interrupted_before_rl_step_4(self):
        if self.checkpoints and "rl" in str(self.checkpoints.config.dir) and self.step == 3:
            raise KeyboardInterrupt  # what asyncio delivers at a step boundary on SIGINT
        return await real_step(self)

    monkeypatch.setattr(Trainer, "train_step", interrupted_before_rl_step_4)
    with pytest.raises(KeyboardInterrupt):
        jobs.train(_config(tmp_path / "b", *steps))
    run_dir = next((tmp_path / "b").glob("*"))
    assert [r["step"] for r in _records(run_dir, "rl")] == [1, 2, 3]
    assert (run_dir / "checkpoints" / "rl" / "step_00000003").is_dir()

    monkeypatch.setattr(Trainer, "train_step", real_step)
    jobs.train(_config(tmp_path / "b", *steps), resume=run_dir)
    got, want = _records(run_dir, "rl"), _records(reference, "rl")
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], abs=1e-5)
    assert [r["reward_mean"] for r in got] == pytest.approx([r["reward_mean"] for r in want])


def test_ctrl_c_during_the_final_evaluation_still_checkpoints_the_last_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_evaluate, calls = phases.evaluate_policy, []

    async def interrupted_on_the_final_eval(config, engine):
        calls.append(1)
        if len(calls) == 2:  # before RL, then after the last step
            raise KeyboardInterrupt
        return await real_evaluate(config, engine)

    monkeypatch.setattr(phases, "evaluate_policy", interrupted_on_the_final_eval)
    config = _config(tmp_path, "trainer.steps=3", "trainer.checkpoint_every=100")
    with pytest.raises(KeyboardInterrupt):
        jobs.train(config)
    run_dir = next(tmp_path.glob("arithmetic-demo-*"))
    assert (run_dir / "checkpoints" / "rl" / "step_00000003").is_dir()
