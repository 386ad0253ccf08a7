"""The shipped hybrid reward-loop example (rule + DisRM + GenRM behind ludic's router) run
end to end by ``ludic train`` in every mode on a tiny budget, against real vLLM reward and
judge servers on CPU: every sample scored by all three components, and nothing the run
started left running afterwards.

* pipeline: ``ludic train`` starts the GenRM judge and the router once, before the
  learner and 2 actors, and stops them after the run; the DisRM is the session's
  ``served_reward`` (one start-up less). Both actors score through that router (neither
  starts a server of its own), and the learner logs the scores that came with their
  batches.
* sync, async: the run starts its router over the session's servers (``served_reward`` as
  the DisRM, the policy server ``served`` as the judge: one API key for both) and stops
  it. Starting vLLM servers is the same code in every mode (``reward_router``), checked
  by the pipeline run; more start-ups would cost CI about half a minute each.
"""

from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import urlsplit

import psutil
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed")

from tests.pipeline.helpers import require_redis_server  # noqa: E402
from tests.vllm_reward.helpers import API_KEY  # noqa: E402

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
    """The ``ludic serve`` processes (vLLM servers, routers) below this test process."""
    found = set()
    for proc in psutil.Process().children(recursive=True):
        try:
            if "ludic serve" in " ".join(proc.cmdline()):
                found.add(proc.pid)
        except psutil.Error:
            pass
    return found


def _session_disrm(request: pytest.FixtureRequest) -> list[str]:
    """Overrides that put the run's DisRM on the session's reward server."""
    reward = urlsplit(request.getfixturevalue("served_reward").url)
    return [
        "reward_loop.disrm.num_servers=1",
        "reward_loop.disrm.server.start_server=false",
        f"reward_loop.disrm.server.port={reward.port}",
        f"reward_loop.disrm.server.api_key={API_KEY}",
    ]


def _session_judge(request: pytest.FixtureRequest) -> list[str]:
    """Overrides that make the session's policy server the run's GenRM judge."""
    judge = urlsplit(request.getfixturevalue("served").server.url)
    return [
        "reward_loop.genrm.server.start_server=false",
        f"reward_loop.genrm.server.port={judge.port}",
    ]


@pytest.mark.parametrize("mode", ["sync", "async", "pipeline"])
def test_the_hybrid_example_trains_on_rule_disrm_and_genrm(
    tmp_path: Path, request: pytest.FixtureRequest, mode: str
) -> None:
    overrides = [f"output_dir={tmp_path}", *TINY, f"trainer.mode={mode}"]
    overrides += _session_disrm(request)  # the router's balancing is test_router_vllm's
    if mode == "pipeline":
        require_redis_server()
        overrides += ["pipeline.num_actors=2"]
        started = ["genrm_0"]
    else:
        overrides += _session_judge(request)
        started = []
    before = _ludic_servers()  # the session's servers
    run_dir = jobs.train(load_config(EXAMPLE, overrides))
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
    # one router and one set of servers, in RUN_DIR: in pipeline mode no actor started any
    assert sorted(run_dir.rglob("reward_router.log")) == [run_dir / "reward_router.log"]
    assert "Traceback" not in (run_dir / "reward_router.log").read_text()
    assert sorted(run_dir.rglob("vllm_*.log")) == [run_dir / f"vllm_{n}.log" for n in started]
    assert _ludic_servers() <= before  # the servers and the router stopped with the run
