"""The ``ludic`` command line: help text, one-line errors with exit codes, pass-through to
the job functions (monkeypatched here, so nothing trains)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ludic import jobs
from ludic.cli import demo_config_path, main
from ludic.run.loading import ConfigError, load_config


@pytest.fixture
def no_job(monkeypatch):
    """Fail the test if a command reaches the job despite a bad config."""

    def unreachable(*args, **kwargs):
        raise AssertionError("the job must not run for a bad config")

    monkeypatch.setattr(jobs, "train", unreachable)
    monkeypatch.setattr(jobs, "evaluate", unreachable)


@pytest.fixture
def config_file(tmp_path) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text("name: cli-test\ntrainer:\n  steps: 3\n")
    return path


def _single_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


def test_top_level_help_lists_commands_override_examples_and_the_schema(capsys) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for text in ("train", "eval", "demo", "trainer.lr=1e-5 algorithm.name=gspo", "config.py"):
        assert text in out


@pytest.mark.parametrize(
    ("command", "options"),
    [
        ("train", ["CONFIG", "OVERRIDE", "--resume", "--debug"]),
        ("eval", ["CONFIG", "OVERRIDE", "--run-dir", "--debug"]),
        ("demo", ["OVERRIDE", "--resume", "--debug"]),
    ],
)
def test_command_help_documents_every_option(capsys, command, options) -> None:
    assert main([command, "--help"]) == 0
    out = capsys.readouterr().out
    for option in [*options, "trainer.lr=1e-5", "ludic/run/config.py"]:
        assert option in out


def test_python_dash_m_ludic_help_runs_in_a_subprocess() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "ludic", "--help"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "usage: ludic" in result.stdout and "demo" in result.stdout


def test_no_command_prints_usage_and_exits_2(capsys) -> None:
    assert main([]) == 2
    assert "usage: ludic" in capsys.readouterr().err


def test_unknown_option_is_a_usage_error(config_file, no_job, capsys) -> None:
    assert main(["train", str(config_file), "--lr", "1e-5"]) == 2
    assert "unrecognized arguments: --lr" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("yaml_text", "overrides", "expected"),
    [
        ("trainer:\n  lrr: 0.1\n", [], "trainer.lrr: unknown field (did you mean 'lr'?)"),
        ("trainer:\n  steps: many\n", [], "trainer.steps"),
        ("algorithm:\n  name: ppo\n", [], "unknown algorithm 'ppo'"),
        ("name: x\n", ["trainer.lr"], "expected dotted.key=value"),
        ("name: x\n", ["trainer.lrr=1e-5"], "trainer.lrr: unknown field"),
    ],
    ids=["unknown-field", "wrong-type", "unknown-algorithm", "override-syntax", "override-field"],
)
@pytest.mark.parametrize("command", ["train", "eval"])
def test_bad_config_exits_2_with_one_line_naming_the_problem(
    tmp_path, no_job, capsys, command, yaml_text, overrides, expected
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(yaml_text)
    assert main([command, str(path), *overrides]) == 2
    line = _single_error_line(capsys.readouterr().err)
    assert line.startswith("error: ") and expected in line


def test_missing_config_file_exits_2_naming_the_file(tmp_path, no_job, capsys) -> None:
    missing = tmp_path / "nope.yaml"
    assert main(["train", str(missing)]) == 2
    line = _single_error_line(capsys.readouterr().err)
    assert line.startswith("error: ") and "nope.yaml" in line


def test_debug_lets_a_config_error_propagate(tmp_path, no_job) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("trainer:\n  lrr: 0.1\n")
    with pytest.raises(ConfigError, match="lrr"):
        main(["train", str(path), "--debug"])


def test_debug_lets_an_unexpected_error_propagate(config_file, monkeypatch) -> None:
    def boom(config, *, resume=None):
        raise ValueError("boom")

    monkeypatch.setattr(jobs, "train", boom)
    with pytest.raises(ValueError, match="boom"):
        main(["train", str(config_file), "--debug"])


def test_run_error_and_file_not_found_from_the_job_exit_2(config_file, monkeypatch, capsys):
    def run_error(config, *, resume=None):
        raise jobs.RunError("no checkpoint in runs/x; train first")

    monkeypatch.setattr(jobs, "train", run_error)
    assert main(["train", str(config_file)]) == 2
    line = _single_error_line(capsys.readouterr().err)
    assert line == "error: no checkpoint in runs/x; train first"

    def missing(config, *, run_dir=None):
        raise FileNotFoundError(2, "No such file or directory", "runs/x/config.yaml")

    monkeypatch.setattr(jobs, "evaluate", missing)
    assert main(["eval", str(config_file)]) == 2
    line = _single_error_line(capsys.readouterr().err)
    assert line == "error: No such file or directory: runs/x/config.yaml"


def test_keyboard_interrupt_exits_130_with_a_resume_hint(config_file, monkeypatch, capsys):
    def interrupted(config, *, resume=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(jobs, "train", interrupted)
    assert main(["train", str(config_file), "trainer.lr=1e-5"]) == 130
    line = _single_error_line(capsys.readouterr().err)
    assert "interrupted" in line
    assert f"ludic train {config_file} trainer.lr=1e-5 --resume RUN_DIR" in line

    assert main(["train", str(config_file), "--resume", "runs/r1"]) == 130
    assert "--resume runs/r1" in capsys.readouterr().err


def test_unexpected_error_exits_1_with_the_type_and_a_debug_hint(config_file, monkeypatch, capsys):
    def boom(config, *, resume=None):
        raise ValueError("boom\nsecond line")

    monkeypatch.setattr(jobs, "train", boom)
    assert main(["train", str(config_file)]) == 1
    line = _single_error_line(capsys.readouterr().err)
    assert line == "error: ValueError: boom second line (run with --debug for the traceback)"


def test_a_huge_error_message_is_cut_to_one_readable_line(config_file, monkeypatch, capsys):
    def boom(config, *, resume=None):
        raise RuntimeError("server died: " + "[--some-flag VALUE]\n" * 200)

    monkeypatch.setattr(jobs, "train", boom)
    assert main(["train", str(config_file)]) == 1
    line = _single_error_line(capsys.readouterr().err)
    assert line.startswith("error: RuntimeError: server died: [--some-flag VALUE] [--some")
    assert line.endswith(
        "VALUE] [--some ... (3012 more characters) (run with --debug for the traceback)"
    )


def test_train_passes_resume_and_overrides_through(tmp_path, config_file, monkeypatch, capsys):
    seen = {}

    def fake_train(config, *, resume=None):
        seen.update(config=config, resume=resume)
        return tmp_path / "runs" / "cli-test-1"

    monkeypatch.setattr(jobs, "train", fake_train)
    argv = ["train", str(config_file), "trainer.lr=1e-5", "--resume", "runs/r1"]
    assert main([*argv, "algorithm.name=gspo"]) == 0  # an override after an option

    config = seen["config"]
    assert seen["resume"] == "runs/r1"
    assert (config.name, config.trainer.steps) == ("cli-test", 3)
    assert (config.trainer.lr, config.algorithm.name) == (1e-5, "gspo")
    assert "cli-test-1" in capsys.readouterr().out


def test_eval_passes_run_dir_and_prints_a_metrics_table(tmp_path, config_file, monkeypatch, capsys):
    seen = {}
    run_dir = tmp_path / "runs" / "r1"
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text("name: cli-test\n")

    def fake_evaluate(config, *, run_dir=None):
        seen.update(config=config, run_dir=run_dir)
        return {"success_rate": 0.75, "reward_mean": 0.5}

    monkeypatch.setattr(jobs, "evaluate", fake_evaluate)
    argv = ["eval", str(config_file), "eval.num_problems=7", "--run-dir", str(run_dir)]
    assert main(argv) == 0
    assert seen["run_dir"] == str(run_dir) and seen["config"].eval.num_problems == 7
    out = capsys.readouterr().out
    assert "success_rate" in out and "0.75" in out and "reward_mean" in out


def test_demo_trains_the_packaged_config_with_overrides(monkeypatch, capsys, tmp_path) -> None:
    seen = {}

    def fake_train(config, *, resume=None):
        seen.update(config=config, resume=resume)
        return tmp_path / "run"

    monkeypatch.setattr(jobs, "train", fake_train)
    assert demo_config_path().is_file()
    assert main(["demo", "trainer.steps=2"]) == 0
    packaged = load_config(str(demo_config_path()))
    assert seen["config"].name == packaged.name
    assert seen["config"].trainer.steps == 2 and seen["resume"] is None


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (None, "no config.yaml"),
        (["inference.backend=vllm"], "num_servers"),
        (["inference.backend=transformers"], "inference.backend is transformers"),
    ],
)
def test_serve_policy_join_refuses_a_run_that_takes_no_server_naming_why(
    tmp_path, capsys, overrides, named
):
    """``ludic serve policy --join RUN_DIR`` before anything starts: a folder with no run,
    a run served by one server, a run without vLLM."""
    from ludic.run.loading import dump_config

    if overrides is not None:
        config = load_config(demo_config_path(), overrides)
        (tmp_path / "config.yaml").write_text(dump_config(config))
    assert main(["serve", "policy", "--join", str(tmp_path), "--port", "8011"]) == 2
    assert named in capsys.readouterr().err
    assert not (tmp_path / "servers").exists()
