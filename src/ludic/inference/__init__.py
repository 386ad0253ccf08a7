"""Inference contracts (``ChatClient``), request data, chat templates and tool-call parsing."""

from ludic.inference.client import ChatClient
from ludic.inference.request import CompletionRequest, InferenceSpec, ReturnSpec, SamplingSpec

__all__ = ["ChatClient", "CompletionRequest", "InferenceSpec", "ReturnSpec", "SamplingSpec"]
