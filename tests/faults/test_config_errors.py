"""Issue 9, finding 5 ("Errors that name the problem, early"): each bad input below used to
surface after the whole warm start, exit 1 with a bare exception class, or name the wrong
option. Each now exits 2 with exactly one ``error:`` line naming the field (and no
traceback), and config errors stop the run before its run directory is created.

The commands run for real through ``ludic.cli.main``; a run that got past the checks would
train (on a tiny budget, so a regression fails in seconds rather than hanging)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from ludic.cli import demo_config_path, main

TINY = [
    "warm_start.steps=2",
    "warm_start.num_demos=4",
    "warm_start.batch_size=4",
    "trainer.steps=2",
    "trainer.prompts_per_step=2",
    "algorithm.group_size=2",
    "eval.num_problems=2",
    "env.kwargs.num_problems=8",
]


def _error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert lines[0].startswith("error: "), err
    return lines[0]


def _train(tmp_path: Path, *overrides: str, config: Path | None = None) -> int:
    path = config or Path(str(demo_config_path()))
    return main(["train", str(path), f"output_dir={tmp_path / 'runs'}", *TINY, *overrides])


@pytest.mark.parametrize(
    ("overrides", "names"),
    [
        (["algorithm.kwargs.bogus=1"], ["algorithm.kwargs", "bogus"]),
        (["trainer.lr=inf"], ["trainer.lr", "finite"]),
        (["warm_start.lr=nan"], ["warm_start.lr", "finite"]),
        (["env.eval_kwargs.foo=1"], ["env.eval_kwargs", "foo", "num_problems"]),
        (
            ["trainer.lr_schedule=cosine", "trainer.warmup_steps=5", "trainer.steps=5"],
            ["trainer", "warmup_steps=5", "steps=5"],
        ),
        (["trainer.max_staleness=0", "trainer.publish_every=3"], ["trainer", "max_staleness=0"]),
        (["model.device=banana"], ["model.device", "banana", "cpu"]),
        (["env.kwargs.foo=1"], ["env.kwargs", "'arithmetic'", "foo", "problem_seed"]),
        (["model.path=/nonexistent/model"], ["model.path", "/nonexistent/model"]),
        (["model.path=nope"], ["model.path", "'nope'", "not a hub id", "org/name"]),
    ],
    ids=lambda v: v[0] if isinstance(v, list) else None,
)
def test_bad_config_exits_2_naming_the_field_before_any_run_directory(
    tmp_path, capsys, overrides, names
) -> None:
    started = time.monotonic()
    assert _train(tmp_path, *overrides) == 2
    line = _error_line(capsys)
    for name in names:
        assert name in line, line
    assert not (tmp_path / "runs").exists(), "the run started before the config was checked"
    assert time.monotonic() - started < 20


def test_cuda_device_without_a_gpu_exits_2_naming_model_device(tmp_path, capsys) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert _train(tmp_path, "model.device=cuda") == 2
    line = _error_line(capsys)
    assert "model.device='cuda'" in line and "no CUDA GPU" in line and "cpu" in line
    assert not (tmp_path / "runs").exists()


def test_a_fixed_config_then_runs_so_the_checks_do_not_refuse_good_configs(
    tmp_path, capsys
) -> None:
    assert _train(tmp_path, "trainer.lr_schedule=cosine", "trainer.warmup_steps=1") == 0


def test_non_utf8_config_file_names_the_file_and_byte(tmp_path, capsys) -> None:
    config = tmp_path / "latin1.yaml"
    config.write_bytes("name: caf\xe9\n".encode("latin-1"))
    assert main(["train", str(config)]) == 2
    line = _error_line(capsys)
    assert "latin1.yaml" in line and "UTF-8" in line and "0xe9" in line


def test_config_path_that_is_a_directory_says_so(tmp_path, capsys) -> None:
    folder = tmp_path / "configs.yaml"
    folder.mkdir()
    assert main(["train", str(folder)]) == 2
    line = _error_line(capsys)
    assert "is a directory" in line and "does not exist" not in line


def test_duplicate_yaml_key_is_refused_naming_key_and_lines(tmp_path, capsys) -> None:
    config = tmp_path / "dup.yaml"
    config.write_text("trainer:\n  lr: 1.0e-3\n  steps: 3\n  lr: 5.0e-4\n")
    assert main(["train", str(config)]) == 2
    line = _error_line(capsys)
    assert "duplicate key 'lr'" in line and "line 4" in line and "line 2" in line


def test_serve_policy_with_a_missing_model_folder_names_it_before_vllm(capsys) -> None:
    started = time.monotonic()
    assert main(["serve", "policy", "--model", "/nonexistent/model"]) == 2
    line = _error_line(capsys)
    assert "--model '/nonexistent/model'" in line and "no such folder" in line
    assert "Repo id" not in line
    assert time.monotonic() - started < 5  # vLLM was not imported


def test_serve_reward_with_a_folder_without_config_json_names_it(tmp_path, capsys) -> None:
    assert main(["serve", "reward", f"--model={tmp_path}"]) == 2
    assert "no config.json" in _error_line(capsys)


def test_corrupt_weights_name_model_path(tmp_path, capsys) -> None:
    from ludic.models.tiny import save_tiny_model

    model_dir = save_tiny_model(tmp_path / "model")
    weights = model_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # a torn copy
    capsys.readouterr()  # save_pretrained's progress bar
    assert _train(tmp_path, f"model.path={model_dir}", "warm_start.steps=0") == 2
    line = _error_line(capsys)
    assert "model.path" in line and str(model_dir) in line and "SafetensorError" in line
    assert list((tmp_path / "runs").iterdir()) == []  # no half-made run directory left


@pytest.mark.parametrize("make", ["missing", "not_a_run"])
def test_eval_run_dir_errors_name_run_dir_not_resume(tmp_path, capsys, make) -> None:
    run_dir = tmp_path / "run"
    if make == "not_a_run":
        run_dir.mkdir()
    assert main(["eval", str(demo_config_path()), "--run-dir", str(run_dir)]) == 2
    line = _error_line(capsys)
    assert "--run-dir" in line and "--resume" not in line


def test_torn_metrics_line_on_resume_is_one_error_line_naming_the_file(tmp_path, capsys) -> None:
    assert _train(tmp_path, "warm_start.steps=0", "trainer.steps=1") == 0
    (run_dir,) = (tmp_path / "runs").iterdir()
    metrics = run_dir / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    lines.insert(1, json.dumps({"phase": "rl", "step": 1})[:9])  # a torn line, not the last
    metrics.write_text("\n".join(lines) + "\n")
    capsys.readouterr()
    config = run_dir / "config.yaml"
    assert main(["train", str(config), "--resume", str(run_dir)]) == 2
    line = _error_line(capsys)
    assert "metrics.jsonl:2" in line and "damaged" in line
