"""The frozen reference model of ``algorithm.kl_coef``: the policy as RL starts.

Without a warm start that is the initial model, loaded again from its folder (``model.path``
or the tiny model in RUN_DIR/model). After a warm start it is the warm-started policy,
written once to ``RUN_DIR/reference`` (a Hugging Face folder, LoRA merged) when RL first
starts, and read from there on every later start, so a resumed run -- or a pipeline learner
started again -- penalizes the distance to the same model.
"""

from __future__ import annotations

from typing import Any

import torch

from ludic.run.config import RunConfig
from ludic.run.errors import RunError
from ludic.run.export import save_policy_folder
from ludic.run.models import load_policy
from ludic.run.run_dir import RunDirectory

REFERENCE_DIR = "reference"


def reference_policy(
    config: RunConfig, run: RunDirectory, policy: torch.nn.Module, tokenizer: Any
) -> torch.nn.Module | None:
    """The reference model (frozen, on ``model.device``), or None when ``kl_coef`` is 0.
    Call it before the first RL step: ``policy`` must still be the RL start's."""
    if config.algorithm.kl_coef == 0:
        return None
    model = {"lora": None}  # a LoRA policy starts as its base model (B = 0)
    if config.warm_start.steps > 0:
        folder = run.path / REFERENCE_DIR
        if not (folder / "config.json").is_file():
            if run.has_checkpoint("rl"):
                raise RunError(
                    f"algorithm.kl_coef: {folder} is missing, but the run has RL checkpoints: "
                    "the reference (the policy after the warm start) cannot be rebuilt"
                )
            save_policy_folder(policy, tokenizer, folder)
        model["path"] = str(folder)
    reference_config = config.model_copy(update={"model": config.model.model_copy(update=model)})
    reference, _ = load_policy(reference_config, run.model_dir)
    reference.eval()
    reference.requires_grad_(False)
    return reference
