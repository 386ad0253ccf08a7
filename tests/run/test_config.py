"""Run config: files, dotted overrides, one-line errors naming the field."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from ludic.run.config import RunConfig
from ludic.run.loading import ConfigError, dump_config, load_config, parse_value

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = sorted(ROOT.glob("examples/configs/*.yaml")) + sorted(
    ROOT.glob("src/ludic/configs/*.yaml")
)


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_config_validates(path: Path) -> None:
    assert isinstance(load_config(path), RunConfig)


def test_gpu_config_selects_colocated_vllm_and_a_local_model() -> None:
    config = load_config(ROOT / "examples/configs/gsm8k_qwen2.5_0.5b_vllm.yaml")
    v = config.inference.vllm
    assert config.inference.backend == "vllm" and v.sync_strategy == "packed_cuda_ipc"
    assert v.sleep_level == 1 and v.num_servers == 1
    assert config.model.path == "models/Qwen2.5-0.5B-Instruct" and config.model.device == "cuda"


def test_overrides_set_nested_fields_with_typed_values() -> None:
    config = load_config(
        None,
        [
            "trainer.lr=1e-5",
            "trainer.max_grad_norm=null",
            "algorithm.name=gspo",
            "env.kwargs.operators=[+, '*']",
            "env.kwargs.max_digits=2",
            "logging.wandb=true",
        ],
    )
    assert config.trainer.lr == 1e-5 and config.trainer.max_grad_norm is None
    assert config.algorithm.name == "gspo"
    assert config.env.kwargs == {"operators": ["+", "*"], "max_digits": 2}
    assert config.logging.wandb is True


def test_later_overrides_win_and_override_the_file(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("trainer: {lr: 0.1, steps: 7}\n")
    config = load_config(f, ["trainer.lr=0.2", "trainer.lr=0.3"])
    assert config.trainer.lr == 0.3 and config.trainer.steps == 7


def test_toml_and_yaml_give_the_same_config(tmp_path: Path) -> None:
    (tmp_path / "c.toml").write_text('[trainer]\nlr = 0.01\n[algorithm]\nname = "cispo"\n')
    (tmp_path / "c.yaml").write_text("trainer: {lr: 0.01}\nalgorithm: {name: cispo}\n")
    assert load_config(tmp_path / "c.toml") == load_config(tmp_path / "c.yaml")


def test_off_policy_algorithm_fields_are_unset_until_written() -> None:
    config = load_config(None, ["algorithm.name=decoupled_grpo", "algorithm.dual_clip_c=3"])
    assert config.algorithm.name == "decoupled_grpo"
    assert config.algorithm.dual_clip_c == 3.0
    assert config.algorithm.model_fields_set == {"name", "dual_clip_c"}
    explicit_null = load_config(None, ["algorithm.behaviour_weight_cap=null"])
    assert "behaviour_weight_cap" in explicit_null.algorithm.model_fields_set


def test_resolved_config_round_trips(tmp_path: Path) -> None:
    config = load_config(None, ["trainer.lr=2e-4", "model.lora.r=4"])
    (tmp_path / "resolved.yaml").write_text(dump_config(config))
    assert load_config(tmp_path / "resolved.yaml") == config


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["trainer.lrr=1"], "trainer.lrr: unknown field (did you mean 'lr'?)"),
        (["trainer.steps=abc"], "trainer.steps: Input should be a valid integer"),
        (["trainer.lr=-1"], "trainer.lr=-1.0 is invalid; expected a finite value > 0"),
        (["algorithm.name=ppo"], "algorithm.name: unknown algorithm 'ppo'; choose one of"),
        (["algorithm.name=gpro"], "(did you mean 'gspo'?)"),
        (["env.kind=chess"], "env.kind: unknown env 'chess'"),
        (["agent.parser=xml"], "agent.parser: unknown parser 'xml'"),
        (["model.tiny.num_heads=3"], "model.tiny: hidden_size=128 / num_heads=3"),
        (
            ["inference.backend=sglang"],
            "inference.backend: Input should be 'transformers' or 'vllm'",
        ),
        (["sampling.max_tokens"], "expected dotted.key=value"),
        (["trainer=3"], "trainer: Input should be a valid dictionary"),
        (["algorithm.clip_eps_low=-0.1"], "algorithm.clip_eps_low: Input should be greater than"),
        (["algorithm.dual_clip_c=1"], "algorithm.dual_clip_c: Input should be greater than 1"),
        (
            ["algorithm.behaviour_weight_cap=0.5"],
            "algorithm.behaviour_weight_cap: Input should be greater than or equal to 1",
        ),
        (
            ["algorithm.behaviour_weight_mode=clip"],
            "algorithm.behaviour_weight_mode: Input should be 'truncate' or 'mask'",
        ),
        (
            ["algorithm.truncated_is_cap=0"],
            "algorithm.truncated_is_cap: Input should be greater than or equal to 1",
        ),
        (
            ["algorithm.dual_clip_c=3", "algorithm.kwargs.dual_clip_c=2"],
            "dual_clip_c is set both as algorithm.dual_clip_c and in algorithm.kwargs",
        ),
        (["trainer.lr=1", "trainer.lr.x=1"], "trainer.lr is a value, not a section"),
        (["name=../../escape"], "name: must be one folder name (no '/', '\\' or '..'"),
        (["name=a\\b"], "name: must be one folder name"),
    ],
)
def test_bad_configs_fail_in_one_line_naming_the_field(overrides, message) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    text = str(err.value)
    assert message in text and "\n" not in text


@pytest.mark.parametrize(
    ("file", "text"),
    [("empty.yaml", ""), ("comments.yaml", "# nothing yet\n\n"), ("empty.toml", "# none\n")],
)
def test_an_empty_config_file_is_an_error_naming_the_file(tmp_path: Path, file, text) -> None:
    (tmp_path / file).write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(tmp_path / file, ["trainer.steps=3"])
    assert str(err.value) == (
        f"config file {str(tmp_path / file)!r} is empty; use `ludic demo` for the default run, "
        "or write at least one section (e.g. env:, trainer:)"
    )


def test_bad_files_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="'list.yaml': expected a mapping"):
        load_config(tmp_path / "list.yaml")
    (tmp_path / "broken.yaml").write_text("trainer: {lr: [\n")
    with pytest.raises(ConfigError, match="'broken.yaml' is not valid"):
        load_config(tmp_path / "broken.yaml")
    (tmp_path / "c.json").write_text("{}")
    with pytest.raises(ConfigError, match="use a .yaml, .yml or .toml file"):
        load_config(tmp_path / "c.json")


def test_override_values_parse_like_yaml_but_keep_exponents_numeric() -> None:
    assert parse_value("1e-5") == 1e-5 and parse_value("3") == 3
    assert parse_value("true") is True and parse_value("null") is None
    assert parse_value("hello world") == "hello world"


def test_validating_a_config_does_not_import_torch() -> None:
    code = "import sys; from ludic.run.loading import load_config; load_config(None); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_weight_sync_backend_follows_the_device_and_nccl_needs_cuda() -> None:
    assert load_config(None, ["inference.backend=vllm"]).sync_backend == "gloo"
    assert load_config(None, ["model.device=cuda"]).sync_backend == "nccl"
    with pytest.raises(ConfigError, match="sync_backend=nccl needs model.device=cuda"):
        load_config(None, ["inference.vllm.sync_backend=nccl"])


def test_a_saved_config_loads_back_as_the_same_config(tmp_path: Path) -> None:
    """RUN_DIR/config.yaml is a valid CONFIG (the pipeline's processes start from it):
    preset fields left unset stay unset, so the preset's own defaults still apply."""
    from ludic.run.builders import make_algorithm

    for overrides in (
        ["algorithm.name=grpo"],
        ["algorithm.name=gspo", "algorithm.clip_eps_high=0.2"],
    ):
        config = load_config(None, overrides)
        saved = tmp_path / "config.yaml"
        saved.write_text(dump_config(config))
        loaded = load_config(saved)
        assert loaded == config
        assert loaded.algorithm.model_fields_set & {"clip_eps_low", "dual_clip_c"} == set()
        make_algorithm(loaded)  # grpo refuses e.g. behaviour_weight_cap when it is "set"


def test_partial_rollouts_continue_by_default(tmp_path: Path) -> None:
    # every token carries the version that sampled it unless the user turns it off
    config = load_config(None, ["inference.backend=vllm"])
    assert config.inference.vllm.partial_rollouts == "continue"
    (tmp_path / "off.yaml").write_text("inference: {vllm: {partial_rollouts: off}}\n")
    assert load_config(tmp_path / "off.yaml").inference.vllm.partial_rollouts == "off"
    with pytest.raises(ConfigError, match="partial_rollouts: Input should be 'off'"):
        load_config(None, ["inference.backend=vllm", "inference.vllm.partial_rollouts=resume"])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["num_servers=2", "port=8000"], "port=8000 with num_servers=2: each server needs"),
        (["num_servers=0"], "num_servers: Input should be greater than or equal to 1"),
        (["num_servers=2", "start_server=false"], "list the running servers in urls"),
        (["urls=[http://a:1]"], "set start_server: false to use them"),
        (["start_server=false", "urls=[http://a:1,http://a:1]"], "lists a server twice"),
        (["start_server=false", "urls=[a:1]"], "'a:1' is not a base URL"),
        (["num_servers=2", "cpu_cores=[0]"], "lists 1 core sets for num_servers=2"),
        (["cpu_cores=[0-]"], "'0-' is not a core list"),
        (["publish=all"], "publish: Input should be 'per_server' or 'one_group'"),
        (["tensor_parallel_size=2", "cpu_cores=[0-1]"], "gives 1 worker core set(s) for "),
        (["cpu_cores=['0|1']"], "gives 2 worker core set(s) for tensor_parallel_size=1"),
        (["tensor_parallel_size=2", "extra_args=['--tensor-parallel-size=2']"], "keep tensor_"),
    ],
)
def test_policy_servers_config_names_the_bad_field(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)) as err:
        load_config(None, [f"inference.vllm.{o}" for o in overrides])
    assert str(err.value).startswith("inference.vllm")


def test_policy_servers_config_takes_core_numbers_and_running_urls() -> None:
    v = load_config(None, ["inference.vllm.num_servers=2", "inference.vllm.cpu_cores=[0,1-3]"])
    assert v.inference.vllm.cpu_cores == ["0", "1-3"] and v.inference.vllm.num_servers == 2
    v = load_config(
        None, ["inference.vllm.start_server=false", "inference.vllm.urls=[http://h:1,http://h:2/]"]
    )
    assert v.inference.vllm.urls == ["http://h:1", "http://h:2/"]


def test_a_tensor_parallel_cpu_server_needs_a_core_set_per_worker() -> None:
    from ludic.run.errors import RunError
    from ludic.run.preflight import check_local_servers

    tp = ["inference.backend=vllm", "inference.vllm.tensor_parallel_size=2"]
    with pytest.raises(RunError, match=r"tensor_parallel_size=2 on CPU needs .*cpu_cores.*'0\|1'"):
        check_local_servers(load_config(None, tp))
    check_local_servers(load_config(None, [*tp, "inference.vllm.cpu_cores=['0|1']"]))


def test_memory_switches_reach_the_trainer_and_the_model(tmp_path: Path) -> None:
    from ludic.run.builders import rl_trainer_config
    from ludic.run.models import load_policy

    config = load_config(
        None,
        [
            "model.gradient_checkpointing=true",
            "model.attn_implementation=eager",
            "trainer.shared_prefix=false",
            "trainer.packing=false",
            "trainer.logprobs=full",
            "trainer.logprob_chunk_tokens=64",
        ],
    )
    trainer_config = rl_trainer_config(config, pad_token_id=0)
    assert trainer_config.gradient_checkpointing and not trainer_config.packing
    assert (trainer_config.logprobs, trainer_config.logprob_chunk_tokens) == ("full", 64)
    model, _ = load_policy(config, tmp_path / "model")
    assert model.config._attn_implementation == "eager"


def test_gradient_checkpointing_with_a_shared_prefix_is_refused_by_name() -> None:
    with pytest.raises(
        ConfigError, match="model.gradient_checkpointing=true needs trainer.shared_prefix"
    ):
        load_config(None, ["model.gradient_checkpointing=true"])
    with pytest.raises(ConfigError, match="logprobs"):
        load_config(None, ["trainer.logprobs=dense"])


GSM8K_LINE = '{"question": "What is 2 + 3?", "answer": "2 + 3 = 5\\n#### 5"}\n'


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_config_passes_preflight_with_only_its_model_path_replaced(
    path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each shipped config, with its real settings, passes every check made before a run
    (``ludic.run.preflight.check_config``: the env and its data, the parser, the algorithm,
    the trainer settings, the weight-sync combination). Only ``model.path`` is replaced (by
    the tiny model), the data files the GPU recipes name are small stand-ins in GSM8K's
    format, and a CUDA device is taken as present where this machine has none."""
    import torch

    from ludic.models.tiny import save_tiny_model
    from ludic.run import preflight

    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    for split in ("train", "test"):
        (tmp_path / "data" / f"gsm8k_{split}.jsonl").write_text(GSM8K_LINE * 8)
    if not torch.cuda.is_available():
        monkeypatch.setattr(preflight, "check_device", lambda field, device: torch.device(device))
    config = load_config(path)
    overrides = []
    if config.model.path is not None:
        overrides.append(f"model.path={save_tiny_model(tmp_path / 'model')}")
    config = load_config(path, overrides)
    preflight.check_config(config)
    preflight.check_local_servers(config)


def test_nccl_to_a_server_on_the_trainers_own_gpu_is_refused_naming_the_fix() -> None:
    """A server ``ludic train`` starts shares the trainer's GPU (``ludic launch`` places
    servers on GPUs of their own: not refused there)."""
    from ludic.run.errors import RunError
    from ludic.run.preflight import check_local_servers

    recipe = ROOT / "examples/configs/gsm8k_qwen2.5_0.5b_vllm.yaml"
    broadcast = ["inference.vllm.sync_strategy=broadcast", "inference.vllm.sleep_level=0"]
    with pytest.raises(RunError, match="NCCL refuses two ranks on one GPU.*packed_cuda_ipc"):
        check_local_servers(load_config(recipe, broadcast))
    check_local_servers(load_config(recipe, [*broadcast, "model.device=cuda:1"]))
    check_local_servers(load_config(recipe, [*broadcast, "inference.vllm.start_server=false"]))
    check_local_servers(load_config(recipe))  # the recipe itself: packed CUDA IPC


def test_a_pipeline_learners_ranks_wait_for_a_batch_longer_than_rank_0_does() -> None:
    from datetime import timedelta

    from ludic.run.trainer_ranks import GROUP_TIMEOUT, group_timeout

    assert group_timeout(load_config(None, [])) == GROUP_TIMEOUT
    pipeline = load_config(None, ["trainer.mode=pipeline", "pipeline.batch_timeout_s=900"])
    assert group_timeout(pipeline) == GROUP_TIMEOUT + timedelta(seconds=900)
