"""The GPU recipe's data path, run on CPU: the shipped GSM8K config with its model, device
and backend swapped for the tiny local model reads GSM8K-format JSONL (``#### N``
answers), prompts with the recipe's template, parses boxed answers and trains."""

from __future__ import annotations

import json
from pathlib import Path

from ludic.cli import main
from ludic.run.builders import build_env
from ludic.run.loading import load_config

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "examples/configs/gsm8k_qwen2.5_0.5b_vllm.yaml"


def _gsm8k_lines(path: Path, n: int, offset: int = 0) -> Path:
    rows = [
        {
            "question": f"Tom has {i} apples and buys {i + 2} more. How many does he have?",
            "answer": f"He has {i} + {i + 2} = <<{i}+{i + 2}={2 * i + 2}>>{2 * i + 2} apples.\n"
            f"#### {2 * i + 2:,}",
        }
        for i in range(offset, offset + n)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_the_gsm8k_recipe_runs_on_cpu_with_local_data(tmp_path) -> None:
    train = _gsm8k_lines(tmp_path / "gsm8k_train.jsonl", 12)
    test = _gsm8k_lines(tmp_path / "gsm8k_test.jsonl", 4, offset=600)  # 1,202: commas
    on_cpu = [
        "model.path=null",
        "model.device=cpu",
        "model.dtype=float32",
        "inference.backend=transformers",
        "inference.vllm.sync_backend=null",
        f"env.kwargs.path={train}",
        f"env.eval_kwargs.path={test}",
        "sampling.max_tokens=8",
        "algorithm.group_size=2",
        "trainer.steps=2",
        "trainer.prompts_per_step=2",
        "trainer.warmup_steps=0",
        "trainer.checkpoint_every=50",
        "eval.num_problems=4",
        "eval.every=0",
        f"output_dir={tmp_path / 'runs'}",
    ]
    config = load_config(RECIPE, on_cpu)
    env = build_env(config, config.env.eval_kwargs)
    obs, _ = env.reset(seed=1)["agent_0"]
    assert obs.endswith("How many does he have?\nPut your final answer in \\boxed{}.")
    assert env.step({"agent_0": "1204"})["agent_0"].reward == 1.0  # target "#### 1,204"
    assert main(["train", str(RECIPE), *on_cpu]) == 0
    (run,) = (tmp_path / "runs").iterdir()
    assert (run / "policy" / "config.json").is_file()
