"""``TrainerConfig``: every optimisation hyperparameter of the Trainer in one typed object.

Each field is documented where it is declared; invalid values fail at construction with
a ``ValueError`` that names the field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

LRSchedule = Literal["constant", "linear", "cosine"]
LogprobsMode = Literal["chunked", "full"]
LOGPROBS_MODES: tuple[str, ...] = ("chunked", "full")
LR_SCHEDULES: tuple[str, ...] = ("constant", "linear", "cosine")
DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class TrainerConfig:
    """Hyperparameters of one training run (optimizer, schedule, batching, sync)."""

    lr: float = 1e-5
    """AdamW peak learning rate (reached after ``warmup_steps``)."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW (beta1, beta2), each in [0, 1)."""
    eps: float = 1e-8
    """AdamW epsilon."""
    max_grad_norm: float | None = 1.0
    """Clip the global gradient L2 norm to this value; ``None`` turns clipping off."""
    lr_schedule: LRSchedule = "constant"
    """After warmup: ``"constant"``, or ``"linear"`` / ``"cosine"`` decay to 0 at
    ``total_steps``."""
    warmup_steps: int = 0
    """Linear warmup from ``lr / warmup_steps`` to ``lr`` over this many optimizer steps."""
    total_steps: int | None = None
    """Length of the run in optimizer steps; required by the linear and cosine schedules."""
    max_tokens_per_microbatch: int = 8192
    """Token budget of one forward/backward pass: ``B * T_max <= budget`` padded, or
    ``R * L <= budget`` packed into ``R`` rows of ``L`` tokens (``packing``). Lower it to
    save activation memory; the loss and gradient do not depend on it."""
    pad_token_id: int = 0
    """Token id used to right-pad sequences (padded positions are masked out of attention
    and of the loss; use ``tokenizer.pad_token_id``)."""
    max_staleness: int | None = None
    """Drop items with a token older than ``trainer.step - max_staleness`` (an item's
    oldest token version; stale experience in asynchronous RL); ``None`` keeps everything.
    A batch source with a bound of its own (``AsyncBatchSource``, ``PipelineBatchSource``)
    tightens it. Must be at least ``publish_every - 1``: the newest published version can
    be that many steps old."""
    ppo_epochs: int = 1
    """Passes over each batch (PPO epochs); each pass makes ``num_minibatches`` optimizer
    updates. Ratio losses compare against the behaviour (or proximal) logprobs, so later
    passes are corrected off-policy updates."""
    num_minibatches: int = 1
    """Optimizer updates per pass: the batch is shuffled (seeded by ``seed`` and the step)
    and split into this many mini-batches of near-equal size, each normalized on its own.
    One trainer step (one policy version) makes ``ppo_epochs * num_minibatches`` updates;
    the LR schedule advances once per trainer step."""
    publish_every: int = 1
    """Publish weights to the inference side every this many optimizer steps (with
    ``version = step``); 0 never publishes."""
    shared_prefix: bool = True
    """Run a prefix that several rows of a micro-batch share (a GRPO group's prompt) once,
    its KV cache expanded to every row (:mod:`ludic.training.shared_prefix`): the same
    logits and gradients up to float rounding, for fewer tokens through the model. Off:
    one plain forward pass over the padded micro-batch."""
    packing: bool = True
    """Pack a micro-batch's sequences end to end without padding, position ids restarting
    per sequence (:mod:`ludic.training.packing`), when that runs fewer tokens than padding
    or a shared prefix: the same logprobs and gradients. Micro-batches are then budgeted
    by packed tokens. Needs a model that reads packed position ids (Hugging Face decoders
    with sdpa, eager or flash-attention). With flash-attention, or sdpa (which the trainer
    switches to ``ludic_varlen_sdpa``: the same attention, one causal sdpa call per
    sequence, :mod:`ludic.training.varlen_attention`), a micro-batch is one row of the
    whole budget with no padding; with eager, rows as long as its longest sequence."""
    logprobs: LogprobsMode = "chunked"
    """How token logprobs are computed from the model: ``"chunked"`` runs the decoder and
    applies the output head to the action tokens a chunk at a time, so the float32
    ``[tokens, vocab]`` logits never exist in full (:mod:`ludic.training.logprobs`);
    ``"full"`` takes the model's logits and a log-softmax over the whole vocabulary (for
    models whose head cannot be split off, e.g. with logit soft-capping)."""
    logprob_chunk_tokens: int | None = None
    """Tokens per output-head chunk with ``logprobs="chunked"``; None: as many as keep a
    chunk's float32 logits at 256 MiB (V = 151,936: 441 tokens)."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass instead of storing
    them (Hugging Face ``gradient_checkpointing_enable``, non-reentrant). Turns the KV
    cache off in training, so it needs ``shared_prefix=False``."""
    reference_device: str | None = None
    """Device of the reference model (KL penalties); None: ``device``. Its logprobs are
    computed once per step, without gradient."""
    flat_parameters: bool = False
    """Keep the model's parameters back to back in one buffer per dtype
    (:func:`ludic.training.flat_parameters.flatten_parameters`), so weight sync sends
    chunks of small tensors without a packing copy."""
    seed: int = 0
    """Seeds python, numpy and torch RNGs when the Trainer is built."""
    device: str = "cpu"
    """Device the model (and reference model) is moved to, e.g. ``"cuda"``."""
    dtype: str | None = None
    """Forward-pass compute dtype via ``torch.autocast`` (``"bfloat16"``, ``"float16"``,
    ``"float32"``); ``None`` runs in the model's own dtype. Logprobs are always computed
    in float32."""
    update_threads: int | None = None
    """Torch's CPU threads (``torch.set_num_threads``) while a synchronous trainer updates,
    restored after; ``None`` leaves them as they are. A concurrent trainer (async: generation
    runs beside the update) ignores it."""

    def __post_init__(self) -> None:
        _check(
            self.update_threads is None or self.update_threads >= 1,
            "update_threads",
            self.update_threads,
            "None or >= 1",
        )
        self._check_optimizer()
        self._check_batching()
        self._check_forward()

    def _check_optimizer(self) -> None:
        """AdamW and the learning-rate schedule."""
        _check(self.lr > 0 and math.isfinite(self.lr), "lr", self.lr, "a finite value > 0")
        _check(self.weight_decay >= 0, "weight_decay", self.weight_decay, ">= 0")
        object.__setattr__(self, "betas", tuple(self.betas))
        _check(
            len(self.betas) == 2 and all(0.0 <= b < 1.0 for b in self.betas),
            "betas",
            self.betas,
            "two values in [0, 1)",
        )
        _check(self.eps > 0, "eps", self.eps, "> 0")
        _check(
            self.max_grad_norm is None or self.max_grad_norm > 0,
            "max_grad_norm",
            self.max_grad_norm,
            "> 0, or None to turn clipping off",
        )
        _check(self.lr_schedule in LR_SCHEDULES, "lr_schedule", self.lr_schedule, LR_SCHEDULES)
        _check(self.warmup_steps >= 0, "warmup_steps", self.warmup_steps, ">= 0")
        if self.total_steps is not None:
            _check(self.total_steps >= 1, "total_steps", self.total_steps, ">= 1")
        if self.lr_schedule != "constant" and (
            self.total_steps is None or self.total_steps <= self.warmup_steps
        ):
            raise ValueError(
                f"TrainerConfig.total_steps={self.total_steps}: lr_schedule="
                f"{self.lr_schedule!r} decays to 0 at total_steps, so it needs total_steps > "
                f"warmup_steps={self.warmup_steps}; set total_steps or use "
                "lr_schedule='constant'"
            )

    def _check_batching(self) -> None:
        """Micro-batches, mini-batches, epochs, staleness and publishing."""
        _check(
            self.max_tokens_per_microbatch >= 2,
            "max_tokens_per_microbatch",
            self.max_tokens_per_microbatch,
            ">= 2 (one sequence of at least two tokens)",
        )
        _check(self.pad_token_id >= 0, "pad_token_id", self.pad_token_id, ">= 0")
        _check(
            self.max_staleness is None or self.max_staleness >= 0,
            "max_staleness",
            self.max_staleness,
            ">= 0, or None to keep stale items",
        )
        _check(self.ppo_epochs >= 1, "ppo_epochs", self.ppo_epochs, ">= 1")
        _check(self.num_minibatches >= 1, "num_minibatches", self.num_minibatches, ">= 1")
        _check(self.publish_every >= 0, "publish_every", self.publish_every, ">= 0 (0 = never)")
        _check(
            self.max_staleness is None or self.max_staleness >= self.publish_every - 1,
            "max_staleness",
            self.max_staleness,
            f">= publish_every - 1 = {self.publish_every - 1}: weights are published every "
            f"{self.publish_every} steps, so items from the newest published version are up "
            "to that many steps old and would all be dropped; raise max_staleness or lower "
            "publish_every",
        )

    def _check_forward(self) -> None:
        """How the forward pass runs: dtype, logprobs, gradient checkpointing."""
        _check(self.dtype is None or self.dtype in DTYPES, "dtype", self.dtype, DTYPES)
        _check(self.logprobs in LOGPROBS_MODES, "logprobs", self.logprobs, LOGPROBS_MODES)
        _check(
            self.logprob_chunk_tokens is None or self.logprob_chunk_tokens >= 1,
            "logprob_chunk_tokens",
            self.logprob_chunk_tokens,
            ">= 1, or None for 256 MiB of logits per chunk",
        )
        _check(
            not (self.gradient_checkpointing and self.shared_prefix),
            "gradient_checkpointing",
            self.gradient_checkpointing,
            "shared_prefix=False alongside: checkpointed layers keep no KV cache, which the "
            "shared-prefix forward needs (set shared_prefix=False; packing still applies)",
        )


def _check(ok: bool, name: str, value: object, expected: object) -> None:
    if not ok:
        raise ValueError(f"TrainerConfig.{name}={value!r} is invalid; expected {expected}")
