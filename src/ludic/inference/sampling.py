"""``InferenceSpec`` -> request parameters of an OpenAI-compatible (vLLM) completions API.

The result is the JSON body of ``POST /v1/completions`` minus ``model`` and ``prompt``.
Fields vLLM adds to the OpenAI schema (``top_k``, ``return_token_ids``, ``vllm_xargs``) are
top-level keys, as vLLM's server reads them; with the ``openai`` Python client pass them
through ``extra_body``.
"""

from __future__ import annotations

from typing import Any

from ludic.inference.request import InferenceSpec

MAX_THINK_XARG = "max_think"
"""The ``vllm_xargs`` key read by ludic's max-think logits processor."""


def to_openai_params(spec: InferenceSpec) -> dict[str, Any]:
    """Map sampling, return options, ``max_think`` and ``extra`` to request parameters.

    * ``temperature``, ``top_p``, ``max_tokens`` always; ``top_k`` unless ``-1`` (off);
      ``stop`` when non-empty; ``seed`` when set.
    * ``return_logprobs`` -> ``logprobs=0`` (the chosen token's logprob only).
    * ``return_token_ids`` -> ``return_token_ids=True`` (prompt and completion ids).
    * ``max_think=n`` -> ``vllm_xargs={"max_think": n}``.
    * ``spec.extra`` is merged last. A key that collides with one set above raises
      ``ValueError``, except ``vllm_xargs``, whose dicts are merged (again without
      collisions).
    """
    s = spec.sampling
    params: dict[str, Any] = {
        "temperature": s.temperature,
        "top_p": s.top_p,
        "max_tokens": s.max_tokens,
    }
    if s.top_k != -1:
        params["top_k"] = s.top_k
    if s.stop:
        params["stop"] = list(s.stop)
    if s.seed is not None:
        params["seed"] = s.seed
    if spec.returns.return_logprobs:
        params["logprobs"] = 0
    if spec.returns.return_token_ids:
        params["return_token_ids"] = True
    if spec.max_think is not None:
        params["vllm_xargs"] = {MAX_THINK_XARG: spec.max_think}

    for key, value in spec.extra.items():
        if key == "vllm_xargs" and "vllm_xargs" in params:
            params["vllm_xargs"] = _merge_xargs(params["vllm_xargs"], value)
        elif key in params:
            raise ValueError(
                f"InferenceSpec.extra[{key!r}]={value!r} collides with {key}={params[key]!r} "
                "derived from the spec; set it through InferenceSpec.sampling/returns instead"
            )
        else:
            params[key] = value
    return params


def _merge_xargs(derived: dict[str, Any], extra: Any) -> dict[str, Any]:
    if not isinstance(extra, dict):
        raise ValueError(f"InferenceSpec.extra['vllm_xargs'] must be a dict, got {extra!r}")
    clash = sorted(set(derived) & set(extra))
    if clash:
        raise ValueError(
            f"InferenceSpec.extra['vllm_xargs'] sets {clash}, already derived from the spec "
            "(e.g. max_think); set them through InferenceSpec fields instead"
        )
    return {**derived, **extra}
