"""Inference contracts (``ChatClient``, ``RewardModelClient``), request data, chat templates and tool-call parsing."""

from __future__ import annotations

from ludic._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "ChatTemplate": "ludic.inference.chat_template",
    "HFChatTemplate": "ludic.inference.chat_template",
    "ChatClient": "ludic.inference.client",
    "CompletionRequest": "ludic.inference.request",
    "InferenceSpec": "ludic.inference.request",
    "ReturnSpec": "ludic.inference.request",
    "SamplingSpec": "ludic.inference.request",
    "RewardModelClient": "ludic.inference.reward_client",
    "RewardModelTrainingMode": "ludic.inference.reward_client",
    "ScoringRequest": "ludic.inference.reward_client",
    "ScoringResponse": "ludic.inference.reward_client",
    "format_reward_input": "ludic.inference.reward_client",
    "to_openai_params": "ludic.inference.sampling",
    "ScriptedChatClient": "ludic.inference.scripted_client",
    "ScriptExhaustedError": "ludic.inference.scripted_client",
    "ToolCallParse": "ludic.inference.tool_parser",
    "ToolCallParser": "ludic.inference.tool_parser",
    "XMLJsonToolCallParser": "ludic.inference.tool_parser",
    "TransformersChatClient": "ludic.inference.transformers_client",
    "TransformersRewardClient": "ludic.inference.transformers_reward_client",
    # vLLM clients and process helpers (importing them does not import vLLM)
    "VLLMChatClient": "ludic.inference.vllm.client",
    "VLLMRewardClient": "ludic.inference.vllm.reward_client",
    "VLLMServerError": "ludic.inference.vllm.http",
    "start_vllm_server": "ludic.inference.vllm.process",
}

__getattr__, __all__ = lazy_exports(__name__, globals(), _EXPORTS)
