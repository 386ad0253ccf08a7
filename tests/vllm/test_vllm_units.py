"""The pure pieces of the vLLM integration, without a server: update checks, the max_think
state machine, finish-reason mapping, CPU default arguments and retry delays."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed")

import torch  # noqa: E402

from ludic.inference.vllm.client import (  # noqa: E402
    VLLMServerError,
    _finish_reason,
    _Retrying,
)
from ludic.inference.vllm.logits_processors import _MaxThink  # noqa: E402
from ludic.inference.vllm.process import CPU_DEFAULT_ARGS, _missing_defaults  # noqa: E402
from ludic.inference.vllm.worker import check_update  # noqa: E402

QWEN2_PACKED = {
    "qkv_proj": ["q_proj", "k_proj", "v_proj"],
    "gate_up_proj": ["gate_proj", "up_proj"],
}
CHECKPOINT = {
    "model.embed_tokens.weight": [10, 4],
    "model.layers.0.self_attn.q_proj.weight": [4, 4],
    "model.layers.0.self_attn.k_proj.weight": [4, 4],
    "model.layers.0.self_attn.v_proj.weight": [4, 4],
    "model.layers.0.self_attn.q_proj.bias": [4],
    "model.layers.0.self_attn.k_proj.bias": [4],
    "model.layers.0.self_attn.v_proj.bias": [4],
    "model.layers.0.mlp.down_proj.weight": [4, 8],
}


def _check(names_shapes: dict[str, list[int]], *, tied: bool = True) -> None:
    named = {name: torch.zeros(shape) for name, shape in names_shapes.items()}
    check_update(named, CHECKPOINT, packed_modules=QWEN2_PACKED, tied_embeddings=tied)


def test_check_update_accepts_whole_fused_groups_and_the_tied_head():
    attn = {n: s for n, s in CHECKPOINT.items() if "self_attn" in n}
    _check({**attn, "lm_head.weight": [10, 4], "model.layers.0.mlp.down_proj.weight": [4, 8]})


def test_check_update_refuses_unknown_names_wrong_shapes_and_partial_fused_groups():
    with pytest.raises(ValueError, match="does not have"):
        _check({"model.layers.0.mlp.nope.weight": [4]})
    with pytest.raises(ValueError, match="does not have"):
        _check({"lm_head.weight": [10, 4]}, tied=False)
    with pytest.raises(ValueError, match=r"shape \[4, 4\].*\[4, 8\]"):
        _check({"model.layers.0.mlp.down_proj.weight": [4, 4]})
    with pytest.raises(ValueError, match="v_proj.bias"):
        weights = {
            n: s for n, s in CHECKPOINT.items() if "self_attn" in n and "v_proj.bias" not in n
        }
        _check(weights)


def test_check_update_without_checkpoint_still_checks_fused_groups():
    named = {"model.layers.0.mlp.gate_proj.weight": torch.zeros(2)}
    with pytest.raises(ValueError, match="up_proj"):
        check_update(named, None, packed_modules=QWEN2_PACKED, tied_embeddings=True)
    check_update(named, None, packed_modules={}, tied_embeddings=True)  # GPU: no fused check


START, END = 7, 8


def _run_max_think(budget: int, prompt: list[int], tokens: list[int]) -> list[bool]:
    """Feed ``tokens`` one by one; True where the processor forced ``</think>``."""
    state = _MaxThink(budget, START, END)
    output: list[int] = []
    forced = []
    for tok in tokens:
        logits = state(prompt, output, torch.zeros(10))
        forced.append(bool(torch.isinf(logits).sum() == 9 and logits[END] == 0))
        output.append(END if forced[-1] else tok)
    return forced


def test_max_think_counts_from_an_open_think_in_the_prompt():
    assert _run_max_think(2, [1, START], [3, 3, 3, 3]) == [False, False, True, False]
    assert _run_max_think(0, [1, START], [3, 3]) == [True, False]


def test_max_think_counts_from_a_think_the_model_opens():
    assert _run_max_think(1, [1, 2], [3, START, 3, 3, 3]) == [False, False, False, True, False]


def test_max_think_ignores_closed_or_absent_thinking():
    assert _run_max_think(0, [START, 3, END], [3, 3]) == [False, False]
    assert _run_max_think(0, [1, 2], [3, 3]) == [False, False]
    assert _run_max_think(5, [START], [3, END, 3, 3, 3, 3, 3, 3]) == [False] * 8


def test_finish_reasons_map_to_ludic_values():
    assert _finish_reason("stop") == "stop"
    assert _finish_reason("length") == "length"
    assert _finish_reason("abort") == "abort"
    assert _finish_reason("repetition") == "abort"
    assert _finish_reason(None) is None
    with pytest.raises(VLLMServerError, match="FINISH_REASON_MAP"):
        _finish_reason("weird")


def test_cpu_defaults_yield_to_explicit_flags():
    assert _missing_defaults(CPU_DEFAULT_ARGS, []) == list(CPU_DEFAULT_ARGS)
    out = _missing_defaults(CPU_DEFAULT_ARGS, ["--dtype", "bfloat16", "--enforce-eager"])
    assert out == ["--compilation-config", '{"mode": 0}']
    assert "--dtype" not in _missing_defaults(CPU_DEFAULT_ARGS, ["--dtype=half"])


def test_retry_delays_back_off_exponentially_within_the_deadline():
    far = time.monotonic() + 60
    policy = _Retrying("u", timeout_s=60, max_retries=3, backoff_s=0.5)
    assert [policy.retry_delay(i, far) for i in range(4)] == [0.5, 1.0, 2.0, None]
    assert policy.retry_delay(0, time.monotonic() + 0.2) is None  # would overrun the deadline
    with pytest.raises(ValueError):
        _Retrying("u", timeout_s=0, max_retries=1, backoff_s=0.1)
