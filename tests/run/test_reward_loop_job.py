"""``ludic train`` with a ``reward_loop`` section, on the in-process backend: a reward
function from a file scores every sample (standalone and colocate), the scores drive
training and are logged; bad settings are config errors naming the field. The hybrid
example with real vLLM reward servers behind the router, in every mode:
tests/vllm_reward/test_reward_loop_modes.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tests.pipeline.helpers import require_redis_server

from ludic import cli, jobs
from ludic.pipeline.run_info import REWARD_ROUTER_URL_ENV, require_reward_router
from ludic.rewards import RewardLoopError
from ludic.run.builders import RunError
from ludic.run.loading import load_config
from ludic.run.preflight import check_config
from ludic.run.reward_loop import starts_reward_servers

TINY = [
    "warm_start.steps=2",
    "warm_start.num_demos=8",
    "warm_start.batch_size=8",
    "trainer.steps=3",
    "trainer.prompts_per_step=2",
    "trainer.checkpoint_every=3",
    "algorithm.group_size=2",
    "eval.num_problems=4",
    "env.kwargs.num_problems=8",
]

REWARD_FILE = """\
import json, os

def length_reward(data_source, solution_str, ground_truth, extra_info, log=None):
    with open(log, "a") as f:
        f.write(json.dumps([data_source, solution_str, ground_truth, extra_info["question"]]) + "\\n")
    return {"score": min(len(solution_str), 4) / 4, "chars": float(len(solution_str))}

async def failing(data_source, solution_str, ground_truth, extra_info):
    raise RuntimeError("judge down")

def wrong_answers_fail(data_source, solution_str, ground_truth, extra_info):
    if solution_str.strip() != ground_truth:
        raise ValueError("not the answer")
    return 1.0
"""


def _config(tmp_path: Path, *extra: str):
    demo = Path(jobs.__file__).parent / "configs" / "arithmetic_demo.yaml"
    return load_config(demo, [f"output_dir={tmp_path}", *TINY, *extra])


def _rl(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["phase"] == "rl"]


@pytest.mark.parametrize(
    ("mode", "trainer_mode"),
    [("standalone", "sync"), ("colocate", "sync"), ("standalone", "async")],
)
def test_a_reward_function_from_a_file_scores_every_sample(
    tmp_path: Path, mode: str, trainer_mode: str
) -> None:
    fn = tmp_path / "my_reward.py"
    fn.write_text(REWARD_FILE)
    log = tmp_path / "calls.jsonl"
    run_dir = jobs.train(
        _config(
            tmp_path,
            f"reward_loop.function={fn}:length_reward",
            f"reward_loop.function_kwargs.log={log}",
            f"reward_loop.mode={mode}",
            f"trainer.mode={trainer_mode}",
        )
    )
    probe, *calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert probe[1] == probe[2] and probe[3].endswith("=")  # preflight: the target scored
    batch = 2 * 2  # prompts x group
    if trainer_mode == "sync":  # steps x batch: every sample, once
        assert len(calls) == 3 * batch
    else:  # async: up to max_staleness (1) batch generated ahead, scored, never trained
        assert len(calls) in (3 * batch, 4 * batch)
    assert {c[0] for c in calls} == {"arithmetic"}  # data_source: the env kind
    assert all(c[3].endswith("=") and c[2] for c in calls)  # question and ground truth
    for record in _rl(run_dir):
        assert record["batch/reward_loop/errors"] == 0
        assert 0.0 <= record["batch/reward_loop/score_mean"] <= 1.0
        assert record["batch/reward_loop/chars"] >= 0


@pytest.mark.redis
def test_in_pipeline_mode_the_actors_score_and_the_learner_trains_on_the_scores(
    tmp_path: Path,
) -> None:
    require_redis_server()
    fn = tmp_path / "my_reward.py"
    fn.write_text(REWARD_FILE)
    log = tmp_path / "calls.jsonl"
    run_dir = jobs.train(
        _config(
            tmp_path,
            "trainer.mode=pipeline",
            "pipeline.num_actors=2",
            f"reward_loop.function={fn}:length_reward",
            f"reward_loop.function_kwargs.log={log}",
        )
    )
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    # the preflight probes (the launcher's, each actor's), then every sample the actors
    # made: at least the 3 trained batches' (actors may run ahead of the learner)
    assert len(calls) >= 3 + 3 * 2 * 2
    for record in _rl(run_dir):
        assert record["batch/reward_loop/errors"] == 0
        assert 0.0 <= record["batch/reward_loop/score_mean"] <= 1.0


def test_a_reward_path_that_fails_stops_the_run_loudly(tmp_path: Path) -> None:
    """Never a silent run on nothing: a function that always fails is caught by the probe
    before the run directory exists; one that fails on most samples of a batch (not on
    the probe's right answer) stops the run with the first error and its sample."""
    fn = tmp_path / "my_reward.py"
    fn.write_text(REWARD_FILE)
    with pytest.raises(RunError, match=r"reward_loop: a probe sample .* RuntimeError: judge down"):
        check_config(_config(tmp_path, f"reward_loop.function={fn}:failing"))
    with pytest.raises(RewardLoopError) as err:
        jobs.train(_config(tmp_path, f"reward_loop.function={fn}:wrong_answers_fail"))
    assert "samples of a batch failed to score, more than max_failure_fraction=0.5" in str(
        err.value
    )
    assert "not the answer" in str(err.value) and "ground_truth=" in str(err.value)


def test_a_data_source_no_rule_knows_is_caught_before_the_run(tmp_path: Path) -> None:
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(f'{{"question": "{i}+1=", "answer": "{i + 1}"}}\n' for i in range(8)))
    config = _config(
        tmp_path,
        "env.kind=dataset_qa",
        f"env.kwargs={{path: {data}}}",
        "warm_start.steps=0",
        "reward_loop.mode=standalone",
    )
    with pytest.raises(
        RunError, match=r"probe sample \(env 'dataset_qa'.*data_source 'dataset_qa'"
    ):
        check_config(config)


def test_the_built_in_rule_scores_the_arithmetic_env_like_its_verifier(tmp_path: Path) -> None:
    run_dir = jobs.train(_config(tmp_path, "reward_loop.mode=colocate", "logging.console_every=1"))
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    scored = [s for s in samples if "reward_loop" in s["meta"]]
    assert len(scored) >= 4
    for sample in scored:
        correct = any(
            step.get("info", {}).get("correct") for step in sample["steps"] if step["kind"] == "env"
        )
        assert sample["meta"]["reward_loop"]["score"] == float(correct)
        assert sample["meta"]["reset_info"][
            "target"
        ]  # the ground truth, even after a parse failure


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["reward_loop.function=nowhere.py:f"], "reward_loop.function"),
        (["reward_loop.manager=naiive"], "did you mean 'naive'"),
        (["reward_loop.manager=dapo"], "overlong_buffer_len"),
        (["reward_loop.mode=later"], "reward_loop.mode"),
        (["reward_loop.rule_weight=0"], "no reward"),
        (["reward_loop.disrm.num_servers=2", "reward_loop.disrm.server.port=9000"], "own port"),
        (["reward_loop.manager_module=no_such_module_x"], "reward_loop.manager_module"),
        # reward servers that sleep between batches (issue 27): colocate mode, CUDA only
        (["reward_loop.disrm.sleep=keep_weights"], "a standalone loop scores while"),
        (
            ["reward_loop.mode=colocate", "reward_loop.disrm.sleep=keep_weights"],
            "reward_loop.disrm.sleep: vLLM sleep mode frees GPU memory and exists on CUDA only",
        ),
        (
            ["reward_loop.mode=colocate", "reward_loop.genrm.sleep=reload_weights"]
            + ["reward_loop.router.address=http://127.0.0.1:1"],
            "the run starts no server to put to sleep",
        ),
        (
            ["reward_loop.disrm.sleep=keep_weights", "reward_loop.disrm.server.start_server=false"],
            "a running server (server.start_server: false) is not one",
        ),
        (
            ["reward_loop.mode=colocate", "reward_loop.disrm.sleep=keep_weights"]
            + ["model.device=cuda", "trainer.mode=pipeline"],
            "the actors share the reward servers",
        ),
    ],
)
def test_bad_reward_loop_settings_name_the_field(tmp_path, overrides, message) -> None:
    with pytest.raises((RunError, ValueError)) as error:
        check_config(_config(tmp_path, *overrides))
    assert message in str(error.value)


PIPELINE_DISRM = ["trainer.mode=pipeline", "reward_loop.disrm.num_servers=1"]


def test_ludic_train_starts_a_pipelines_reward_servers_for_its_actors(
    tmp_path, monkeypatch
) -> None:
    """``ludic train``'s preflight passes: it starts the servers once and hands the router
    to its learner and actors, whose own check then passes; a router named in the config
    needs nobody to start anything."""
    monkeypatch.delenv(REWARD_ROUTER_URL_ENV, raising=False)
    config = _config(tmp_path, *PIPELINE_DISRM)
    check_config(config)
    assert starts_reward_servers(config)
    with pytest.raises(RunError, match="every actor would start its own reward servers"):
        require_reward_router(config, "ludic actor")
    monkeypatch.setenv(REWARD_ROUTER_URL_ENV, "http://127.0.0.1:9")
    require_reward_router(config, "ludic actor")
    monkeypatch.delenv(REWARD_ROUTER_URL_ENV)
    named = _config(tmp_path, *PIPELINE_DISRM, "reward_loop.router.address=http://127.0.0.1:9")
    assert not starts_reward_servers(named)
    require_reward_router(named, "ludic actor")


@pytest.mark.parametrize("command", ["learner", "actor", "launch"])
def test_a_pipeline_process_started_by_hand_needs_a_running_reward_router(
    tmp_path, capsys, monkeypatch, command: str
) -> None:
    monkeypatch.delenv(REWARD_ROUTER_URL_ENV, raising=False)
    demo = Path(jobs.__file__).parent / "configs" / "arithmetic_demo.yaml"
    argv = [command, str(demo), f"output_dir={tmp_path}", *TINY, *PIPELINE_DISRM]
    if command != "launch":
        argv += ["--run-dir", str(tmp_path / "run")]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "every actor would start its own reward servers" in err
    assert "set reward_loop.router.address" in err and f"`ludic {command}` does not" in err
    assert not (tmp_path / "run").exists()  # refused before anything started
