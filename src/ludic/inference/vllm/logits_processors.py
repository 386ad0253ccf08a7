"""vLLM logits processors for ludic's server (vLLM >= 0.11 V1 logits-processor API).

``MaxThinkLogitsProcessor``: a request with ``vllm_xargs={"max_think": N}``
(``InferenceSpec.max_think``) is forced to emit ``</think>`` after ``N`` thinking tokens.
Thinking is open when the prompt's last ``<think>`` is not closed, or from the first
``<think>`` the model emits; other requests are untouched. Both tags must be single tokens:
the server resolves them at start-up (:data:`THINK_TOKENS_ENV`); a plain ``vllm serve
--logits-processors ...:MaxThinkLogitsProcessor`` worker loads the tokenizer itself.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from vllm.sampling_params import SamplingParams
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

from ludic.inference.sampling import MAX_THINK_XARG

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)

THINK_START = "<think>"
THINK_END = "</think>"
THINK_TOKENS_ENV = "LUDIC_THINK_TOKEN_IDS"
"""JSON ``{"start": id | null, "end": id | null}`` set by the ludic server before the
engine starts (inherited by its workers)."""

MAX_THINK_FQCN = "ludic.inference.vllm.logits_processors:MaxThinkLogitsProcessor"
"""The ``--logits-processors`` entry for :class:`MaxThinkLogitsProcessor`."""


def think_token_ids(tokenizer: Any) -> dict[str, int | None]:
    """``{"start": id, "end": id}`` of ``<think>`` / ``</think>``; ``None`` where the
    marker is not a single token of ``tokenizer``."""
    out: dict[str, int | None] = {}
    for key, marker in (("start", THINK_START), ("end", THINK_END)):
        ids = tokenizer.encode(marker, add_special_tokens=False)
        out[key] = int(ids[0]) if len(ids) == 1 else None
    return out


class _MaxThink:
    """Per-request state; scans each new output token once (O(1) amortised per step).

    Called by vLLM as ``(prompt_ids, output_ids, logits[V]) -> logits[V]``, where
    ``output_ids`` is the request's live list of generated tokens.
    """

    def __init__(self, budget: int, start_id: int | None, end_id: int) -> None:
        self.budget = budget
        self.start_id = start_id
        self.end_id = end_id
        self.open_in_prompt: bool | None = None  # known at the first call
        self._reset()

    def _reset(self) -> None:
        self.seen = 0  # output tokens scanned so far
        self.closed = False
        self.think_from: int | None = 0 if self.open_in_prompt else None

    def __call__(
        self, prompt_ids: list[int], output_ids: list[int], logits: torch.Tensor
    ) -> torch.Tensor:
        if self.open_in_prompt is None:
            self.open_in_prompt = self.start_id is not None and _open_in(
                prompt_ids, self.start_id, self.end_id
            )
            self._reset()
        if len(output_ids) < self.seen:  # preempted and recomputed: rescan
            self._reset()
        for i in range(self.seen, len(output_ids)):
            tok = output_ids[i]
            if tok == self.end_id and self.think_from is not None:
                self.closed = True
            elif tok == self.start_id and self.think_from is None:
                self.think_from = i + 1
        self.seen = len(output_ids)
        if self.closed or self.think_from is None:
            return logits
        if len(output_ids) - self.think_from >= self.budget:
            forced = torch.full_like(logits, float("-inf"))
            forced[self.end_id] = 0.0
            return forced
        return logits


def _open_in(prompt_ids: Sequence[int], start_id: int, end_id: int) -> bool:
    """True when the prompt's last think marker is an opening ``<think>``."""
    for tok in reversed(prompt_ids):
        if tok == end_id:
            return False
        if tok == start_id:
            return True
    return False


class MaxThinkLogitsProcessor(AdapterLogitsProcessor):
    """Forces ``</think>`` after ``max_think`` thinking tokens (per request, via
    ``SamplingParams.extra_args["max_think"]``)."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool) -> None:
        super().__init__(vllm_config, device, is_pin_memory)
        ids = _ids_from_env()
        if ids is None:
            ids = _ids_from_tokenizer(vllm_config)
        self.start_id = ids.get("start")
        self.end_id = ids.get("end")

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        value = (sampling_params.extra_args or {}).get(MAX_THINK_XARG)
        if value is None:
            return
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(
                f"vllm_xargs.{MAX_THINK_XARG}={value!r}; expected an integer >= 0 "
                "(InferenceSpec.max_think)"
            )
        ids = _ids_from_env()
        if ids is not None and ids.get("end") is None:
            raise ValueError(
                f"vllm_xargs.{MAX_THINK_XARG} needs a tokenizer where {THINK_END!r} is a "
                "single token; the served tokenizer splits it. Leave InferenceSpec.max_think "
                "unset for this model."
            )

    def is_argmax_invariant(self) -> bool:
        return False  # it changes which token wins

    def new_req_logits_processor(self, params: SamplingParams) -> _MaxThink | None:
        budget = (params.extra_args or {}).get(MAX_THINK_XARG)
        if budget is None:
            return None
        if self.end_id is None:
            logger.warning("max_think ignored: %r is not a single token", THINK_END)
            return None
        return _MaxThink(int(budget), self.start_id, self.end_id)


def _ids_from_env() -> dict[str, int | None] | None:
    raw = os.environ.get(THINK_TOKENS_ENV)
    if not raw:
        return None
    data = json.loads(raw)
    return {"start": data.get("start"), "end": data.get("end")}


def _ids_from_tokenizer(vllm_config: VllmConfig) -> dict[str, int | None]:
    from transformers import AutoTokenizer

    model_config = vllm_config.model_config
    tokenizer = AutoTokenizer.from_pretrained(
        model_config.tokenizer, trust_remote_code=model_config.trust_remote_code
    )
    return think_token_ids(tokenizer)
