"""The shipped hybrid reward-loop example (rule + DisRM + GenRM behind ludic's router) run
end to end by ``ludic train`` on a tiny budget: real vLLM reward and judge servers on CPU,
every sample scored by all three components, and nothing left running afterwards."""

from __future__ import annotations

import json
from pathlib import Path

import psutil
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed")

from ludic import jobs  # noqa: E402
from ludic.run.loading import load_config  # noqa: E402

EXAMPLE = Path(__file__).parents[2] / "examples" / "configs" / "reward_loop_hybrid_tiny.yaml"
TINY = [
    "warm_start.steps=2",
    "warm_start.num_demos=8",
    "trainer.steps=2",
    "trainer.prompts_per_step=2",
    "trainer.checkpoint_every=2",
    "algorithm.group_size=2",
    "eval.num_problems=2",
    "logging.console_every=1",
]


def _ludic_servers() -> set[int]:
    found = set()
    for proc in psutil.process_iter(["cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if "ludic serve" in cmd and "reward-loop-hybrid" in cmd:
            found.add(proc.pid)
    return found


def test_the_hybrid_example_trains_on_rule_disrm_and_genrm(tmp_path: Path) -> None:
    run_dir = jobs.train(load_config(EXAMPLE, [f"output_dir={tmp_path}", *TINY]))
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    rl = [r for r in map(json.loads, lines) if r["phase"] == "rl"]
    assert [r["step"] for r in rl] == [1, 2]
    for record in rl:
        assert record["batch/reward_loop/errors"] == 0
        assert record["batch/reward_loop/rule"] in (0.0, 0.25, 0.5, 0.75, 1.0)
        assert 0.0 < record["batch/reward_loop/disrm"] < 1.0  # a sigmoid
        assert 0.0 <= record["batch/reward_loop/genrm"] <= 0.9  # "Score: N" / 10
        expected = (
            record["batch/reward_loop/rule"]
            + 0.1 * record["batch/reward_loop/disrm"]
            + 0.1 * record["batch/reward_loop/genrm"]
        )
        assert record["batch/reward_loop/score_mean"] == pytest.approx(expected)
    router_log = (run_dir / "reward_router.log").read_text()
    assert "Traceback" not in router_log
    for name in ["vllm_disrm_0.log", "vllm_disrm_1.log", "vllm_genrm_0.log"]:
        assert (run_dir / name).is_file(), name
    assert not _ludic_servers()  # servers and router stopped with the run
