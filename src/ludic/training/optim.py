"""Optimizer and learning-rate schedule built from a ``TrainerConfig``."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import NoReturn

import torch
from torch.optim.lr_scheduler import LambdaLR

from ludic.training.config import TrainerConfig

MAX_PARAMETER_NORM = 1e6
"""A weight tensor whose L2 norm passes this has exploded: trained transformer weight
tensors sit orders of magnitude below it (an element above it implies a norm above it),
and the next forward overflows to inf/NaN logits."""


class DivergedError(FloatingPointError):
    """An optimizer step left non-finite or exploded weights."""


def parameter_problem(weights: torch.nn.Module | Iterable[torch.Tensor]) -> str | None:
    """Why these weights (a model's parameters, or the given tensors) must not be trained on
    or saved (a NaN/inf, or a tensor whose L2 norm passes :data:`MAX_PARAMETER_NORM`), or
    ``None`` when they are fine. Per-tensor L2 norms (NaN/inf propagate into them) cost
    about one pass over the weights and one device sync; an infinity-norm pass is many
    times slower on CPU."""
    tensors = list(weights.parameters() if isinstance(weights, torch.nn.Module) else weights)
    norms: dict[torch.device, list[torch.Tensor]] = {}
    for p in tensors:
        norms.setdefault(p.device, []).append(torch.linalg.vector_norm(p.detach()))
    if not norms:
        return None
    largest = max(float(torch.stack(n).max()) for n in norms.values())
    if largest <= MAX_PARAMETER_NORM:  # False for NaN
        return None
    if any(not bool(torch.isfinite(p).all()) for p in tensors):
        return "the weights contain NaN/inf"
    return f"the weights exploded (a tensor's L2 norm is {largest:.3g} > {MAX_PARAMETER_NORM:g})"


def build_optimizer(model: torch.nn.Module, config: TrainerConfig) -> torch.optim.AdamW:
    """AdamW over the parameters that require grad (frozen base weights of a LoRA model
    are left out)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError(
            f"{type(model).__name__} has no parameter with requires_grad=True; unfreeze "
            "the weights to train (or attach a LoRA adapter with peft)"
        )
    return torch.optim.AdamW(
        params,
        lr=config.lr,
        betas=config.betas,
        eps=config.eps,
        weight_decay=config.weight_decay,
        fused=_can_fuse(params) or None,
    )


def _can_fuse(params: list[torch.nn.Parameter]) -> bool:
    """Torch's fused AdamW (one kernel over every tensor, not a loop over them) takes plain
    floating-point tensors on one CPU or CUDA device; sharded (DTensor) parameters keep the
    default implementation."""
    devices = {p.device.type for p in params}
    return (
        len(devices) == 1
        and devices <= {"cpu", "cuda"}
        and all(type(p) is torch.nn.Parameter and p.dtype.is_floating_point for p in params)
    )


def lr_multiplier(config: TrainerConfig) -> Callable[[int], float]:
    """The factor applied to ``config.lr`` at optimizer step ``s`` (0-based).

    Warmup: ``(s + 1) / warmup_steps`` for ``s < warmup_steps``. Then ``constant``: 1;
    ``linear``: ``1 - p``; ``cosine``: ``0.5 * (1 + cos(pi * p))``, where
    ``p = (s - warmup_steps) / (total_steps - warmup_steps)`` clamped to [0, 1].
    """
    warmup, total, schedule = config.warmup_steps, config.total_steps, config.lr_schedule

    def multiplier(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if schedule == "constant":
            return 1.0
        assert total is not None  # TrainerConfig checks it for linear/cosine
        progress = min(max((step - warmup) / (total - warmup), 0.0), 1.0)
        if schedule == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return multiplier


def build_lr_scheduler(optimizer: torch.optim.Optimizer, config: TrainerConfig) -> LambdaLR:
    """A ``LambdaLR`` following :func:`lr_multiplier`; step it once per optimizer step."""
    return LambdaLR(optimizer, lr_multiplier(config))


def clipped_optimizer_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: LambdaLR,
    max_grad_norm: float | None,
    *,
    abort: Callable[[str], NoReturn],
    schedule: bool = True,
) -> float:
    """Check the gradient is finite (else ``abort(reason)``, which must raise), clip it to
    ``max_grad_norm``, step the optimizer (and the schedule unless ``schedule=False``: a
    trainer step with several updates advances the schedule once), zero the grads; returns
    the norm before clipping. Raises :class:`DivergedError` naming the step when the step left non-finite
    or exploded weights (see :func:`parameter_problem`)."""
    params = [p for p in model.parameters() if p.requires_grad]
    grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    if not bool(torch.isfinite(grad_norm)):
        abort(f"gradient norm is {float(grad_norm)}")
    if max_grad_norm is not None:
        torch.nn.utils.clip_grads_with_norm_(params, max_grad_norm, grad_norm)
    optimizer.step()
    if schedule:
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    problem = parameter_problem(params)  # a step changes only the trainable tensors
    if problem is not None:
        lr = optimizer.param_groups[0]["lr"]
        raise DivergedError(
            f"optimizer step {scheduler.last_epoch} (lr={lr:g}, gradient norm "
            f"{float(grad_norm):.3g} before clipping): {problem}. The run stops here and these "
            "weights are not checkpointed; lower the learning rate (trainer.lr / "
            "TrainerConfig.lr) or set trainer.max_grad_norm, then resume from the last checkpoint"
        )
    return float(grad_norm)
