"""Your own parts from the config: env, parser, algorithm, credit assigner, reward function
and manager, tools, named as ``path/to/file.py:attr`` or ``package.module:attr`` beside the
built-in names -- one loader, checked before the run with errors naming the field, the file
and what is wrong. The README tour's ``GuessParity`` trains from the command line."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ludic._imports import load_function, load_object
from ludic.cli import main
from ludic.run.builders import make_algorithm
from ludic.run.errors import RunError
from ludic.run.loading import ConfigError, load_config
from ludic.run.preflight import check_config

USER_FILE = '''
from ludic.envs import SingleAgentEnv
from ludic.parsers import ParseResult
from ludic.training import make_grpo
from ludic.training.credit_assignment import EpisodicReturn
from ludic.types import StepOutcome


class GuessParity(SingleAgentEnv):
    """Say whether a number is even or odd (the README tour's env)."""

    def __init__(self, offset: int = 3):
        super().__init__()
        self.offset = offset

    def env_reset(self, seed=None):
        self.n = (seed or 0) * 7 + self.offset
        return f"Is {self.n} even or odd?", {}

    def env_step(self, action):
        correct = action == ("even" if self.n % 2 == 0 else "odd")
        return StepOutcome(obs="done", reward=float(correct), terminated=True)


def lowercase(text: str) -> ParseResult:
    return ParseResult(action=text.strip().lower())


def make_mine(group_size: int, clip_eps_high: float = 0.2):
    """GRPO under another name: a preset of one's own."""
    algorithm = make_grpo(group_size=group_size, clip_eps_high=clip_eps_high)
    return algorithm


class Scaled:
    """A credit assigner: the episode return times ``scale``."""

    def __init__(self, scale: float = 1.0):
        self.inner = EpisodicReturn()
        self.scale = scale

    def compute(self, rollouts):
        return [[w * self.scale for w in ws] for ws in self.inner.compute(rollouts)]


def two_arguments(text, other):
    return ParseResult(action=text)


def not_an_env(**kwargs):
    return {"reset": None}


NOT_CALLABLE = 3
'''

BASE = {
    "name": "byo",
    "model": {"tiny": {"hidden_size": 64, "num_layers": 1, "num_heads": 1}},
    "env": {"kind": "my_env.py:GuessParity", "kwargs": {"offset": 4}},
    "agent": {"parser": "my_env.py:lowercase"},
    "algorithm": {
        "name": "my_env.py:make_mine",
        "group_size": 2,
        "clip_eps_high": 0.3,
        "credit_assigner": "my_env.py:Scaled",
        "credit_assigner_kwargs": {"scale": 2.0},
    },
    "sampling": {"max_tokens": 4},
    "warm_start": {"steps": 0},
    "trainer": {"steps": 2, "prompts_per_step": 2, "checkpoint_every": 2},
    "eval": {"num_problems": 2},
    "logging": {"console_every": 1},
}


@pytest.fixture
def project(tmp_path: Path, monkeypatch) -> Path:
    """A user's project folder: my_env.py beside the config; the tests run from it."""
    (tmp_path / "my_env.py").write_text(USER_FILE)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _config_file(folder: Path, **changes) -> Path:
    data = json.loads(json.dumps(BASE))
    data["output_dir"] = str(folder / "runs")
    for dotted, value in changes.items():
        *parents, last = dotted.split("__")
        node = data
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    path = folder / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_the_loader_reads_modules_and_files_and_names_what_is_wrong(tmp_path) -> None:
    tools = tmp_path / "tools.py"
    tools.write_text("def add(a: int, b: int) -> int:\n    return a + b\nVALUE = 3\n")
    assert load_function("math:sqrt", field="f")(9) == 3
    assert load_function(f"{tools}:add", field="f")(2, 3) == 5
    assert load_object(f"{tools}:VALUE", field="f") == 3
    with pytest.raises(ValueError, match="f: 'nocolon' must look like"):
        load_function("nocolon", field="f")
    with pytest.raises(FileNotFoundError, match="f: .*no file"):
        load_function(f"{tmp_path}/missing.py:add", field="f")
    with pytest.raises(
        ValueError, match=r"has no attribute 'nope' \(it defines \['VALUE', 'add'\]"
    ):
        load_function(f"{tools}:nope", field="f")
    with pytest.raises(ValueError, match="VALUE in .* is not callable"):
        load_function(f"{tools}:VALUE", field="f")
    with pytest.raises(ValueError, match="cannot import 'no_such_module_x'"):
        load_function("no_such_module_x:f", field="f")
    with pytest.raises(ValueError, match="neither a module path"):
        load_function("not a module:f", field="f")
    broken = tmp_path / "broken.py"
    broken.write_text("x = 1\ny = undefined_name\n")
    with pytest.raises(ValueError, match=r"running broken.py failed: NameError: .*line 2\)"):
        load_object(f"{broken}:x", field="f")
    syntax = tmp_path / "syntax.py"
    syntax.write_text("def f(:\n")
    with pytest.raises(ValueError, match=r"running syntax.py failed: SyntaxError: .*line 1\)"):
        load_object(f"{syntax}:f", field="f")


def test_a_user_file_sibling_module_imports(tmp_path) -> None:
    (tmp_path / "helpers_for_ludic_test.py").write_text("PARITY = ('even', 'odd')\n")
    (tmp_path / "uses_helper.py").write_text(
        "from helpers_for_ludic_test import PARITY\n\ndef first():\n    return PARITY[0]\n"
    )
    assert load_function(f"{tmp_path}/uses_helper.py:first", field="f")() == "even"


def test_the_schema_makes_files_absolute_and_checks_names_without_importing(project) -> None:
    config = load_config(_config_file(project))
    assert config.env.kind == f"{project}/my_env.py:GuessParity"
    assert config.agent.parser == f"{project}/my_env.py:lowercase"
    assert config.algorithm.credit_assigner == f"{project}/my_env.py:Scaled"
    assert load_config(None, ["env.kind=ludic.envs.arithmetic:ArithmeticQAEnv"]).env.kind == (
        "ludic.envs.arithmetic:ArithmeticQAEnv"
    )
    with pytest.raises(ConfigError, match=r"env.kind: unknown env 'arithmetik' \(did you mean"):
        load_config(None, ["env.kind=arithmetik"])
    with pytest.raises(ConfigError, match="or name your own as package.module:attr"):
        load_config(None, ["agent.parser=nope"])
    with pytest.raises(ConfigError, match="algorithm.name: 'my_env.py:3' must look like"):
        load_config(None, ["algorithm.name=my_env.py:3"])
    with pytest.raises(ConfigError, match="credit_assigner_kwargs is set but credit_assigner"):
        load_config(None, ["algorithm.credit_assigner_kwargs={gamma: 0.5}"])
    config = load_config(_config_file(project))
    check_config(config)  # every part of the good config builds
    algorithm = make_algorithm(config)
    assert algorithm.name == "grpo" and algorithm.loss.clip_eps_high == 0.3
    assert type(algorithm.credit_assigner).__name__ == "Scaled"
    assert algorithm.credit_assigner.scale == 2.0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"env__kind": "missing.py:GuessParity"},
            r"env.kind: '.*/missing.py:GuessParity': no file '.*/missing.py'",
        ),
        (
            {"env__kind": "my_env.py:GuesParity"},
            r"env.kind: '.*my_env.py:GuesParity': .*my_env.py has no attribute 'GuesParity'",
        ),
        (
            {"env__kwargs": {"offsett": 1}},
            r"env.kwargs: env '.*my_env.py:GuessParity' \(GuessParity\) got an unexpected "
            r"keyword argument 'offsett'; it takes \['offset'\]",
        ),
        (
            {"env__kind": "my_env.py:not_an_env"},
            r"env.kind: '.*my_env.py:not_an_env' built a dict without \['agent_ids', 'reset', "
            r"'step'\], not an environment",
        ),
        (
            {"agent__parser": "my_env.py:two_arguments"},
            r"agent.parser: '.*my_env.py:two_arguments': two_arguments\(text, other\) cannot be "
            r"called with one argument \(the completion text\)",
        ),
        (
            {"agent__parser": "my_env.py:NOT_CALLABLE"},
            r"agent.parser: .*it is a int, not callable; it must be a function \(text: str\)",
        ),
        (
            {"algorithm__name": "my_env.py:lowercase"},
            r"algorithm.clip_eps_high is set but algorithm.name='.*my_env.py:lowercase' does "
            r"not take it",
        ),
        (
            {"algorithm__credit_assigner_kwargs": {"scal": 2}},
            r"algorithm.credit_assigner_kwargs: '.*my_env.py:Scaled' refused \{'scal': 2\}",
        ),
        (
            {
                "algorithm__credit_assigner": "my_env.py:lowercase",
                "algorithm__credit_assigner_kwargs": {},
            },
            r"algorithm.credit_assigner_kwargs: '.*my_env.py:lowercase' refused \{\}",
        ),
    ],
)
def test_a_bad_user_part_is_one_error_line_naming_field_file_and_problem(
    project, capsys, change, message
) -> None:
    assert main(["train", str(_config_file(project, **change))]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert re.search(message, err), err
    assert not (project / "runs").exists()  # nothing started


def test_a_file_that_fails_to_import_is_reported_with_its_line(project, capsys) -> None:
    (project / "bad_env.py").write_text("import os\n\nraise RuntimeError('no GPU here')\n")
    assert main(["train", str(_config_file(project, env__kind="bad_env.py:Env"))]) == 2
    err = capsys.readouterr().err
    assert "env.kind:" in err and "running bad_env.py failed: RuntimeError: no GPU here" in err
    assert "(bad_env.py, line 3)" in err


def test_the_readme_env_trains_from_the_command_line(project) -> None:
    """`ludic train run.yaml` in the user's folder, my_env.py beside it, every part named
    there; the run directory's saved config names the file absolutely, so it loads from
    another directory."""
    config_file = _config_file(project)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, "-m", "ludic", "train", str(config_file)],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (run_dir,) = (project / "runs").iterdir()
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["env"]["kind"] == f"{project}/my_env.py:GuessParity"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in records if r["phase"] == "rl"]
    assert [r["step"] for r in rl] == [1, 2]
    samples = (run_dir / "samples.jsonl").read_text()
    assert "even or odd?" in samples

    # from another directory, the saved config still names the file (what `ludic eval`,
    # --resume and pipeline actors load)
    elsewhere = project / "elsewhere"
    elsewhere.mkdir()
    os.chdir(elsewhere)
    check_config(load_config(run_dir / "config.yaml"))


REWARDS_FILE = """
from ludic.rewards import RewardManager
from ludic.rewards.sample import RewardResult


class Halved(RewardManager):
    async def run_single(self, sample):
        result = await self.score(sample)
        return RewardResult(None if result.score is None else result.score / 2)


class NotAManager:
    pass


def reward(data_source, solution_str, ground_truth, extra_info):
    return float(solution_str.strip() == "odd")
"""


def test_reward_functions_and_managers_by_name_or_as_code(project) -> None:
    from ludic.run.reward_loop import make_manager, rule_function

    (project / "my_rewards.py").write_text(REWARDS_FILE)
    config = load_config(
        _config_file(project),
        ["reward_loop.function=arithmetic", "reward_loop.manager=my_rewards.py:Halved"],
    )
    check_config(config)
    section = config.reward_loop
    assert rule_function(section).__name__ == "arithmetic_score"
    manager = make_manager(section, config, rule_function(section))
    assert type(manager).__name__ == "Halved"
    config = load_config(_config_file(project), ["reward_loop.function=my_rewards.py:reward"])
    check_config(config)
    with pytest.raises(
        RunError, match=r"reward_loop.manager: .*NotAManager.?: it is a class NotAManager, not a"
    ):
        check_config(
            load_config(_config_file(project), ["reward_loop.manager=my_rewards.py:NotAManager"])
        )
    with pytest.raises(ConfigError, match="reward_loop.function: unknown reward function 'gsm9k'"):
        load_config(None, ["reward_loop.function=gsm9k"])


def test_an_agent_program_config_refuses_what_it_would_ignore(project) -> None:
    (project / "agent.py").write_text("async def solve(client, task):\n    return 1.0\n")
    base = ["agent.kind=program", "agent.program=agent.py:solve", "warm_start.steps=0"]
    check_config(load_config(None, base))
    with pytest.raises(ConfigError, match=r"does not use \['parser', 'system_prompt'\]"):
        load_config(None, [*base, "agent.parser=boxed", "agent.system_prompt=hi"])
    with pytest.raises(ConfigError, match="agent.kind=program needs agent.program"):
        load_config(None, ["agent.kind=program"])
    with pytest.raises(RunError, match="agent.program: .*not an async function"):
        (project / "sync.py").write_text("def solve(client, task):\n    return 1.0\n")
        check_config(load_config(None, [*base[:1], "agent.program=sync.py:solve", base[2]]))
    with pytest.raises(RunError, match="cannot demonstrate an agent program"):
        check_config(load_config(None, base[:2]))
