"""Where a run's models come from: the policy and the reward model loaded from
``model.path`` / ``reward_model.path`` (or the tiny model built into the run directory),
and the path helpers that tell a local folder from a hub id and name the field when a
load fails."""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ludic.models.tiny import build_tiny_causal_lm, build_tiny_tokenizer
from ludic.run.config import RewardModelSection, RunConfig
from ludic.run.errors import RunError
from ludic.training.reward_model.trainer import save_reward_model


def local_path(path: str) -> Path | None:
    """The local path ``path`` names (``~`` expanded), or ``None`` for a hub id such as
    ``Qwen/Qwen2.5-0.5B-Instruct``: a path that exists, starts with ``.``, ``/`` or ``~``,
    or has more than one ``/`` is local."""
    local = Path(path).expanduser()
    looks_local = local.exists() or path.startswith((".", "/", "~")) or path.count("/") > 1
    return local if looks_local else None


def check_model_path(field: str, path: str | None) -> None:
    """``path`` must name a model folder that exists and holds a ``config.json``, or a hub
    id ``org/name``. A bare name (no ``/``) is taken for a hub id only when the local
    Hugging Face cache has it, and an ``org/name`` only when it is cached or downloads
    are allowed (``HF_HUB_OFFLINE`` unset): anything else fails here, not after the hub
    client's retries."""
    if path is None:
        return
    local = local_path(path)
    if local is None:
        _check_hub_id(field, path)
        return
    if local.is_file():
        raise RunError(
            f"{field}: {path!r} is a file, not a folder; give the model folder "
            "save_pretrained wrote (it holds config.json)"
        )
    if not local.is_dir():
        raise RunError(f"{field}: folder {path!r} does not exist")
    config = local / "config.json"
    if config.is_dir():
        raise RunError(
            f"{field}: {str(config)!r} is a folder, not a file; give the model folder "
            "save_pretrained wrote"
        )
    if not config.is_file():
        raise RunError(
            f"{field}: folder {path!r} holds no config.json; give the model folder "
            "save_pretrained wrote (config.json, weights, tokenizer)"
        )


def _check_hub_id(field: str, repo_id: str) -> None:
    if _hub_cached(repo_id):
        return
    if "/" not in repo_id:
        raise RunError(
            f"{field}: folder {repo_id!r} does not exist, and {repo_id!r} is not a hub id of "
            "the form org/name; give a model folder (./models/NAME) or a full hub id such as "
            "Qwen/Qwen2.5-0.5B-Instruct"
        )
    if _hub_offline():
        raise RunError(
            f"{field}: hub model {repo_id!r} is not in the local Hugging Face cache and "
            f"HF_HUB_OFFLINE is set; download it first (hf download {repo_id}) or give a "
            "model folder"
        )


def _hub_cached(repo_id: str) -> bool:
    """Whether the local Hugging Face cache holds ``repo_id``'s ``config.json``."""
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except Exception:  # noqa: BLE001 (an invalid repo id is not cached)
        return False


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def reward_model_folder(path: str) -> Path:
    """``reward.path`` as a folder holding a saved reward model (a ``config.json``)."""
    folder = Path(path).expanduser()
    if not (folder / "config.json").is_file():
        raise RunError(
            f"reward.path: {path!r} is not a model folder (no config.json); train one with a "
            "task: reward_model run and point at its RUN_DIR/reward_model"
        )
    return folder


@contextlib.contextmanager
def naming_load_errors(field: str, path: str) -> Iterator[None]:
    """Any failure loading a model from ``path`` becomes a :class:`RunError` naming
    ``field``, the path and the error type (a corrupt weights file raises safetensors'
    ``SafetensorError``, which names no file)."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 (OSError, ValueError, SafetensorError, ...)
        raise RunError(
            f"{field}: cannot load {path!r} ({type(e).__name__}: {_reason(e)}); check the "
            "folder holds a complete save_pretrained checkpoint (config, weights, tokenizer)"
        ) from None


def _reason(error: BaseException, limit: int = 400) -> str:
    """``error``'s whole message on one line (transformers splits a reason over lines:
    "... from one of: (1) ..., (2) ..."), cut at a word past ``limit`` characters."""
    text = " ".join(str(error).split())
    if len(text) <= limit:
        return text
    return text[:limit].rsplit(" ", 1)[0] + " ..."


def load_policy(config: RunConfig, model_dir: Path) -> tuple[torch.nn.Module, Any]:
    """The policy model and its tokenizer.

    ``model.path`` null: build the tiny model and save it (with its tokenizer) to
    ``model_dir`` -- an ordinary HF folder -- then load it back through the same path a
    real model takes.
    """
    path = policy_folder(config, model_dir)
    model, tokenizer = _from_pretrained(path, attn_implementation=config.model.attn_implementation)
    if config.model.lora is not None:
        model = _with_lora(model, config)
    return model.to(config.model.device), tokenizer


def policy_folder(config: RunConfig, model_dir: Path) -> str:
    """``model.path``, else ``model_dir`` holding the tiny model and its tokenizer (built
    there, from ``model.tiny``, unless it already is)."""
    if config.model.path is not None:
        return config.model.path
    if not (model_dir / "config.json").is_file():
        tiny = config.model.tiny
        tokenizer = build_tiny_tokenizer()
        model = build_tiny_causal_lm(
            tokenizer,
            seed=tiny.seed,
            hidden_size=tiny.hidden_size,
            num_layers=tiny.num_layers,
            num_heads=tiny.num_heads,
        )
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        model.save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
    return str(model_dir)


def _from_pretrained(
    path: str, *, attn_implementation: str | None = None
) -> tuple[torch.nn.Module, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the run has its own progress display

    check_model_path("model.path", path)
    source = str(local_path(path) or path)
    with naming_load_errors("model.path", path):
        tokenizer = AutoTokenizer.from_pretrained(source)
        extra = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, **extra)
    if tokenizer.chat_template is None:
        raise RunError(f"model.path: the tokenizer of {path!r} has no chat template")
    return model, tokenizer


def _with_lora(model: torch.nn.Module, config: RunConfig) -> torch.nn.Module:
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise RunError("model.lora needs peft: pip install 'ludic-rl[peft]'") from None
    lora = config.model.lora
    assert lora is not None
    try:
        peft_config = LoraConfig(
            r=lora.r,
            lora_alpha=lora.alpha,
            lora_dropout=lora.dropout,
            target_modules=list(lora.target_modules),
            task_type="CAUSAL_LM",
        )
        return get_peft_model(model, peft_config)
    except ValueError as e:
        raise RunError(f"model.lora.target_modules: {e}") from None


def serving_copy(policy: torch.nn.Module) -> torch.nn.Module:
    """A plain (non-peft) copy of the policy for the in-process backend to sample from.
    For a sharded (FSDP2) policy, a model of the same config whose weights the trainer's
    first publish sets (rank 0 gathers the full weights for it)."""
    from ludic.training.checkpoint import is_sharded

    if is_sharded(policy):
        from transformers import AutoModelForCausalLM

        serving = AutoModelForCausalLM.from_config(
            policy.config, dtype=next(policy.parameters()).dtype
        )
        serving.requires_grad_(False)
        return serving.to(next(policy.parameters()).device)
    base = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
    serving = copy.deepcopy(base)
    if hasattr(policy, "get_base_model"):  # peft layers in the copy -> merge them away
        from peft import PeftModel

        serving = PeftModel(serving, policy.peft_config["default"]).merge_and_unload()
    serving.requires_grad_(False)
    return serving


def load_reward_model(rm: RewardModelSection, model_dir: Path) -> tuple[torch.nn.Module, Any]:
    """The reward model and its tokenizer from ``reward_model.path``; with path null, the
    tiny reward model is built and saved to ``model_dir`` first (an ordinary HF folder)
    and loaded back the way a real one is."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the run has its own progress display
    path = rm.path
    if path is None:
        if not (model_dir / "config.json").is_file():
            from ludic.models.tiny import build_tiny_reward_model, build_tiny_tokenizer

            tokenizer = build_tiny_tokenizer()
            tiny = build_tiny_reward_model(
                tokenizer,
                seed=rm.tiny.seed,
                hidden_size=rm.tiny.hidden_size,
                num_layers=rm.tiny.num_layers,
                num_heads=rm.tiny.num_heads,
            )
            save_reward_model(tiny, tokenizer, model_dir)
        path = str(model_dir)
    return reward_model_from_folder(path)


def reward_model_from_folder(path: str) -> tuple[torch.nn.Module, Any]:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    check_model_path("reward_model.path", path)
    source = str(local_path(path) or path)
    with naming_load_errors("reward_model.path", path):
        tokenizer = AutoTokenizer.from_pretrained(source)
        model = AutoModelForSequenceClassification.from_pretrained(
            source, num_labels=1, dtype=torch.float32
        )
    if tokenizer.pad_token_id is None:
        raise RunError(
            f"reward_model.path: the tokenizer of {path!r} has no pad token; the reward model "
            "pools at the last non-pad token, so it needs one"
        )
    if model.config.pad_token_id is None:
        # HF classifiers find the last real token through config.pad_token_id.
        model.config.pad_token_id = tokenizer.pad_token_id
    elif model.config.pad_token_id != tokenizer.pad_token_id:
        raise RunError(
            f"reward_model.path: {path!r} has config.pad_token_id={model.config.pad_token_id}"
            f" but its tokenizer pads with {tokenizer.pad_token_id}; make them agree"
        )
    return model, tokenizer
