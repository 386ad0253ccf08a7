"""The pure pieces of the vLLM integration, without a server: update checks, the max_think
state machine, finish-reason mapping, CPU default arguments and connection retries."""

from __future__ import annotations

import argparse
import contextlib
import http.server
import threading
import time

import httpx
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed")

import torch  # noqa: E402

from ludic.distributed.weight_transfer.groups import free_port  # noqa: E402
from ludic.inference.vllm.client import VLLMServerError, _finish_reason  # noqa: E402
from ludic.inference.vllm.http import VLLMControlPlane  # noqa: E402
from ludic.inference.vllm.logits_processors import _MaxThink  # noqa: E402
from ludic.inference.vllm.process import CPU_DEFAULT_ARGS, _missing_defaults  # noqa: E402
from ludic.inference.vllm.server import (  # noqa: E402
    requested_sampling_only,
    sampled_logprobs_mode,
)
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
    assert out == ["--compilation-config", '{"mode": 0}', "--no-enable-chunked-prefill"]
    assert "--dtype" not in _missing_defaults(CPU_DEFAULT_ARGS, ["--dtype=half"])
    # --x and --no-x are one flag: a user who turns chunked prefill on gets no "off" added.
    assert "--no-enable-chunked-prefill" not in _missing_defaults(
        CPU_DEFAULT_ARGS, ["--enable-chunked-prefill"]
    )


def _serve_health_after(port: int, delay_s: float) -> threading.Thread:
    """Start answering ``GET /health`` on ``port`` after ``delay_s`` (a server coming up)."""

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's naming)
            body = b'{"status": "ok"}'
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    def serve():
        time.sleep(delay_s)
        with http.server.HTTPServer(("127.0.0.1", port), Health) as server:
            server.handle_request()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


def test_the_policy_server_returns_the_logprobs_of_the_sampling_distribution():
    """processed_logprobs (after temperature): the trainer scores a trace at its
    logprob_temperature, so vLLM's raw default would train another policy than the
    sampler's; asking for another mode is refused by name."""
    args = argparse.Namespace(logprobs_mode="raw_logprobs")
    assert sampled_logprobs_mode(args, ["--model", "m"]).logprobs_mode == "processed_logprobs"
    for argv in (["--logprobs-mode", "raw_logprobs"], ["--logprobs-mode=raw_logits"]):
        args = argparse.Namespace(logprobs_mode=argv[-1].split("=")[-1])
        with pytest.raises(SystemExit, match="--logprobs-mode raw_.*processed_logprobs"):
            sampled_logprobs_mode(args, argv)
    args = argparse.Namespace(logprobs_mode="processed_logprobs")
    assert sampled_logprobs_mode(args, ["--logprobs-mode", "processed_logprobs"]) is args


def test_the_policy_server_samples_as_requested_not_as_the_model_folder_says():
    """vLLM's own defaults, not the folder's generation_config.json (top_k, penalties),
    unless --generation-config is given."""
    args = argparse.Namespace(generation_config="auto")
    assert requested_sampling_only(args, ["--model", "m"]).generation_config == "vllm"
    for argv in (["--generation-config", "auto"], ["--generation-config=/cfg"]):
        args = argparse.Namespace(generation_config=argv[-1].split("=")[-1])
        assert requested_sampling_only(args, argv).generation_config == argv[-1].split("=")[-1]


def test_connection_failures_are_retried_until_the_server_comes_up():
    port = free_port()
    thread = _serve_health_after(port, delay_s=0.3)
    control = VLLMControlPlane(f"http://127.0.0.1:{port}", timeout_s=5, max_retries=3)
    try:
        assert control.health() == {"status": "ok"}  # retried at 0, 0.5, 1.0 s
    finally:
        control.close()
        thread.join(timeout=5)


def test_without_retries_a_server_not_yet_up_is_unreachable():
    port = free_port()
    thread = _serve_health_after(port, delay_s=0.5)
    control = VLLMControlPlane(f"http://127.0.0.1:{port}", timeout_s=5, max_retries=0)
    try:
        with pytest.raises(ConnectionError, match=r"unreachable \(/health, 1 attempt"):
            control.health()
    finally:
        control.close()
        thread.join(timeout=5)
        with contextlib.suppress(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)  # let the server thread end


def test_invalid_timeout_or_retries_are_refused():
    with pytest.raises(ValueError, match="timeout_s"):
        VLLMControlPlane("http://127.0.0.1:1", timeout_s=0)
    with pytest.raises(ValueError, match="max_retries"):
        VLLMControlPlane("http://127.0.0.1:1", max_retries=-1)


def test_an_untested_vllm_is_refused_at_start_naming_the_tested_range():
    import tomllib
    from pathlib import Path

    import vllm

    from ludic.inference.vllm.versions import TESTED_VLLM, check_vllm_version

    check_vllm_version(vllm.__version__)  # the installed one is tested
    for untested in ("0.31.2", "0.33.0", "not-a-version"):
        with pytest.raises(SystemExit, match=f"vllm{TESTED_VLLM}.*--allow-untested-vllm"):
            check_vllm_version(untested)
    check_vllm_version("0.12.0", allow_untested=True)  # warns, starts
    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    assert pyproject["project"]["optional-dependencies"]["vllm"] == [f"vllm{TESTED_VLLM}"]
