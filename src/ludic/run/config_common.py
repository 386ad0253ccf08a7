"""Config sections shared by policy and reward-model runs (see :mod:`ludic.run.config`).

The base of every section (frozen, unknown fields refused, no inf/nan), the checked
string types (devices, registered names), the tiny model, LoRA and a vLLM server.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from ludic.run.registries import ALGORITHMS, ENVS, PARSERS, check_name

__all__ = [
    "AlgorithmName",
    "Device",
    "EnvKind",
    "LoraConfig",
    "ParserName",
    "Section",
    "TinyModelConfig",
    "VLLMConfig",
]


def _registered(kind: str, registry: Mapping[str, str]) -> AfterValidator:
    return AfterValidator(lambda name: check_name(kind, name, registry))


def _device(name: str) -> str:
    if not re.fullmatch(r"(cpu|cuda|mps|xpu)(:\d+)?", name):
        raise ValueError("not a device; use cpu, cuda, cuda:N, mps or xpu")
    return name


Device = Annotated[str, AfterValidator(_device)]
"""A torch device string, checked without importing torch (availability is checked by
``ludic.run.preflight`` before the run starts)."""
EnvKind = Annotated[str, _registered("env", ENVS)]
ParserName = Annotated[str, _registered("parser", PARSERS)]
AlgorithmName = Annotated[str, _registered("algorithm", ALGORITHMS)]


class Section(BaseModel):
    """The base of every config section."""

    # allow_inf_nan=False: lr=inf (or nan) is refused here, not after the warm start.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class TinyModelConfig(Section):
    """The locally built tiny Qwen2 (used when ``model.path`` is null)."""

    hidden_size: int = Field(128, ge=32, description="hidden width; head size must be >= 32")
    num_layers: int = Field(2, ge=1)
    num_heads: int = Field(2, ge=1)
    seed: int = 0

    @model_validator(mode="after")
    def _head_size(self) -> TinyModelConfig:
        if self.hidden_size % self.num_heads or self.hidden_size // self.num_heads < 32:
            raise ValueError(
                f"hidden_size={self.hidden_size} / num_heads={self.num_heads} must give an "
                "integer head size >= 32 (vLLM's CPU backend needs it)"
            )
        return self


class LoraConfig(Section):
    """peft LoRA adapters on the policy; published weights are merged."""

    r: int = Field(8, ge=1)
    alpha: int = Field(16, ge=1)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    target_modules: list[str] = ["q_proj", "v_proj"]


class VLLMConfig(Section):
    """A vLLM policy server (the vLLM backend; see the policy-serving docs)."""

    host: str = "127.0.0.1"
    port: int | None = Field(None, ge=1, le=65535)
    """HTTP port (null: a free one when ludic starts the server)."""
    group_port: int | None = Field(None, ge=1, le=65535)
    """Rendezvous port of the weight-sync group, hosted by the trainer (null: a free one)."""
    start_server: bool = True
    """Start (and stop) the server as a subprocess; false = connect to a running one."""
    sync_backend: Literal["nccl", "gloo"] | None = None
    """Process-group backend of the weight sync (null: nccl when model.device is cuda,
    else gloo)."""
    gpu_memory_utilization: float = Field(0.5, gt=0.0, le=1.0)
    extra_args: list[str] = []
    timeout_s: float = Field(120.0, gt=0)
    api_key: str | None = Field(None, exclude=True, repr=False)
    """The server's API key (every route but /health needs it). null: $LUDIC_API_KEY if
    set, else a fresh random key for a server ludic starts (none for a running one).
    Never saved to the run directory nor shown in logs."""
    partial_rollouts: Literal["off", "continue", "restart"] = "off"
    """What happens to a completion aborted by a weight update: off (kept as it is,
    finish reason "abort"), continue (continued from the tokens generated so far; per-token
    policy versions show the switch) or restart (sent again). Any mode but off makes each
    publish pause the server (abort in flight, load, resume); see
    ``ludic.inference.vllm.partial``."""

    @field_validator("partial_rollouts", mode="before")
    @classmethod
    def _yaml_off(cls, value: Any) -> Any:
        return "off" if value is False else value  # YAML 1.1 reads a bare `off` as false
