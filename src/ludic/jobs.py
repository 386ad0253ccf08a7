"""``ludic train`` / ``ludic eval`` as plain functions that pick the job a config asks for.

* ``task: reward_model`` -- :func:`ludic.run.reward_job.train_reward_model`;
* ``trainer.mode: pipeline`` -- :func:`ludic.pipeline.launch.launch_pipeline` (a local
  Redis, one learner and ``pipeline.num_actors`` actor processes);
* otherwise -- :func:`ludic.run.rl_job.train_rl`, here or as ``trainer.world_size`` ranks.

Every part the config names is checked before a run directory is made. Ctrl-C or SIGTERM
stops at a step boundary with a checkpoint; ``train(config, resume=RUN_DIR)`` continues.
"""

from __future__ import annotations

from pathlib import Path

from ludic.pipeline.launch import launch_pipeline
from ludic.run.config import RunConfig
from ludic.run.errors import RunError
from ludic.run.preflight import check_config, check_local_servers
from ludic.run.reward_job import evaluate_reward_model, train_reward_model
from ludic.run.rl_job import evaluate_rl, train_rl
from ludic.run.signals import terminate_as_interrupt

__all__ = ["RunError", "evaluate", "train"]


def train(config: RunConfig, *, resume: str | Path | None = None) -> Path:
    """Run (or resume) the job ``config`` describes; returns the run directory."""
    with terminate_as_interrupt():
        if config.task == "reward_model":
            return train_reward_model(config, resume=resume)
        check_config(config)  # every part buildable before the run directory or a step
        check_local_servers(config)
        if config.trainer.mode == "pipeline":
            return launch_pipeline(config, resume=resume)
        return train_rl(config, resume=resume)


def evaluate(config: RunConfig, *, run_dir: str | Path | None = None) -> dict[str, float]:
    """Greedy evaluation of the newest checkpoint in ``run_dir`` (the config's initial
    model when None) -- a policy, or for ``task: reward_model`` a reward model; returns
    the metrics."""
    check_config(config)
    if config.task == "reward_model":
        return evaluate_reward_model(config, run_dir=run_dir)
    return evaluate_rl(config, run_dir=run_dir)
