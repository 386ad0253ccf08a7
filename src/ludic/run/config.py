"""The typed run configuration behind ``ludic train CONFIG``.

One frozen pydantic model per component, nested into :class:`RunConfig`. Unknown fields
are errors; every field is documented here, so this file is the reference for config
files. Values that name registered parts (env kinds, parsers, algorithms) are checked
against the registries in :mod:`ludic.run.registries`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from ludic.run.registries import ALGORITHMS, ENVS, PARSERS, check_name


def _registered(kind: str, registry: Mapping[str, str]) -> AfterValidator:
    return AfterValidator(lambda name: check_name(kind, name, registry))


EnvKind = Annotated[str, _registered("env", ENVS)]
ParserName = Annotated[str, _registered("parser", PARSERS)]
AlgorithmName = Annotated[str, _registered("algorithm", ALGORITHMS)]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TinyModelConfig(_Section):
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


class LoraConfig(_Section):
    """peft LoRA adapters on the policy; published weights are merged."""

    r: int = Field(8, ge=1)
    alpha: int = Field(16, ge=1)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    target_modules: list[str] = ["q_proj", "v_proj"]


class ModelConfig(_Section):
    path: str | None = None
    """A Hugging Face model folder or hub id; null builds the tiny model in the run dir."""
    tiny: TinyModelConfig = TinyModelConfig()
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Training compute dtype (autocast); weights stay in float32."""
    lora: LoraConfig | None = None
    device: str = "cpu"
    """Trainer device, e.g. "cpu" or "cuda"."""


class VLLMConfig(_Section):
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


class InferenceConfig(_Section):
    backend: Literal["transformers", "vllm"] = "transformers"
    """transformers: in-process, embedded; vllm: a vLLM server with live weight sync."""
    max_batch_size: int = Field(64, ge=1)
    vllm: VLLMConfig = VLLMConfig()


class SamplingConfig(_Section):
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = -1
    max_tokens: int = Field(8, ge=1)
    """Generation budget per model call."""


class EnvConfig(_Section):
    kind: EnvKind = "arithmetic"
    """A registered env: see ``ludic.run.registries.ENVS``."""
    kwargs: dict[str, Any] = {}
    """Constructor arguments of that env."""
    eval_kwargs: dict[str, Any] = {}
    """Overrides of ``kwargs`` for evaluation (e.g. a held-out problem_seed)."""


class AgentConfig(_Section):
    parser: ParserName = "answer"
    """A registered parser: see ``ludic.run.registries.PARSERS``."""
    system_prompt: str | None = None
    max_steps: int = Field(1, ge=1)
    """Protocol limit on env steps per episode (parse failures count)."""
    incomplete_completion_penalty: float | None = None
    """If set, a completion cut by max_tokens is a parse failure with this reward."""


class AlgorithmConfig(_Section):
    name: AlgorithmName = "grpo"
    """A registered preset: see ``ludic.run.registries.ALGORITHMS``."""
    group_size: int = Field(8, ge=2)
    """Samples per problem; group-relative presets normalize rewards within the group."""
    kwargs: dict[str, Any] = {}
    """Extra preset arguments, e.g. {clip_eps_high: 0.28}."""


class WarmStartConfig(_Section):
    """Supervised warm start before RL (``steps: 0`` skips it)."""

    steps: int = Field(300, ge=0)
    lr: float = Field(3e-3, gt=0)
    batch_size: int = Field(32, ge=1)
    demos: str = "dataset_answers"
    """"dataset_answers": the env's own reference answers (QA envs), or a JSONL of rollouts."""
    num_demos: int = Field(100, ge=1)
    """How many problems (env seeds 0..num_demos-1) "dataset_answers" demonstrates."""


class TrainerSection(_Section):
    steps: int = Field(100, ge=1)
    """RL optimizer steps."""
    lr: float = Field(5e-4, gt=0)
    prompts_per_step: int = Field(8, ge=1)
    """Distinct problems per step (each sampled group_size times)."""
    max_grad_norm: float | None = Field(1.0, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    warmup_steps: int = Field(0, ge=0)
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    max_tokens_per_microbatch: int = Field(16384, ge=1)
    publish_every: int = Field(1, ge=1)
    """Push weights to the inference backend every N steps (version = step)."""
    max_lag: int | None = Field(None, ge=0)
    checkpoint_every: int = Field(25, ge=1)
    keep_last: int = Field(2, ge=1)
    """Checkpoints kept per phase."""


class EvalConfig(_Section):
    num_problems: int = Field(100, ge=1)
    """Evaluated on env seeds 0..num_problems-1, greedy decoding."""
    every: int = Field(0, ge=0)
    """Also evaluate every N RL steps (0: only before and after RL)."""


class LoggingConfig(_Section):
    wandb: bool = False
    tensorboard: bool = False
    console_every: int = Field(10, ge=1)
    """Print a metrics line every N steps (the progress bar updates every step)."""
    num_sample_rollouts: int = Field(4, ge=0)
    """Rollouts written to samples.jsonl per logged step."""


class RunConfig(_Section):
    name: str = "run"
    output_dir: str = "runs"
    """Run directories are created as OUTPUT_DIR/NAME-TIMESTAMP."""
    seed: int = 0
    model: ModelConfig = ModelConfig()
    inference: InferenceConfig = InferenceConfig()
    env: EnvConfig = EnvConfig()
    agent: AgentConfig = AgentConfig()
    sampling: SamplingConfig = SamplingConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    warm_start: WarmStartConfig = WarmStartConfig()
    trainer: TrainerSection = TrainerSection()
    eval: EvalConfig = EvalConfig()
    logging: LoggingConfig = LoggingConfig()

    @model_validator(mode="after")
    def _nccl_needs_cuda(self) -> RunConfig:
        if self.inference.vllm.sync_backend == "nccl" and not self.model.device.startswith("cuda"):
            raise ValueError(
                "inference.vllm.sync_backend=nccl needs model.device=cuda (the trainer's "
                "tensors go over NCCL); use gloo on CPU or leave it null for automatic"
            )
        return self

    @property
    def sync_backend(self) -> str:
        """The weight-sync backend in effect."""
        chosen = self.inference.vllm.sync_backend
        return chosen or ("nccl" if self.model.device.startswith("cuda") else "gloo")
