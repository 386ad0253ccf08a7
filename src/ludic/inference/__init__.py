"""Inference contracts (``ChatClient``, ``RewardModelClient``), request data, chat templates and tool-call parsing."""

from ludic.inference.chat_template import ChatTemplate, HFChatTemplate
from ludic.inference.client import ChatClient
from ludic.inference.request import CompletionRequest, InferenceSpec, ReturnSpec, SamplingSpec
from ludic.inference.reward_client import (
    RewardModelClient,
    RewardModelTrainingMode,
    ScoringRequest,
    ScoringResponse,
    format_reward_input,
)
from ludic.inference.sampling import to_openai_params
from ludic.inference.scripted_client import ScriptedChatClient, ScriptExhaustedError
from ludic.inference.tool_parser import ToolCallParse, ToolCallParser, XMLJsonToolCallParser
from ludic.inference.transformers_client import TransformersChatClient
from ludic.inference.transformers_reward_client import TransformersRewardClient

__all__ = [
    "TransformersChatClient",
    "TransformersRewardClient",
    "RewardModelClient",
    "RewardModelTrainingMode",
    "ScoringRequest",
    "ScoringResponse",
    "format_reward_input",
    "ChatClient",
    "ChatTemplate",
    "CompletionRequest",
    "HFChatTemplate",
    "InferenceSpec",
    "ReturnSpec",
    "SamplingSpec",
    "ScriptExhaustedError",
    "ScriptedChatClient",
    "ToolCallParse",
    "ToolCallParser",
    "XMLJsonToolCallParser",
    "to_openai_params",
]
