"""Reward sections of the run config: ``reward_model`` (``task: reward_model``, training a
reward model on preference pairs), ``reward`` (a learned reward for RL) and
``reward_loop`` (spec 5: rule, DisRM and GenRM rewards scored per sample behind a router)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from ludic._imports import absolute_spec, is_code_spec, split_spec
from ludic.run.config_common import (
    Device,
    LoraConfig,
    ModuleReference,
    RewardFunctionName,
    Section,
    TinyModelConfig,
    VLLMConfig,
    settings_section,
)
from ludic.training.reward_model.config import PreferenceTrainerConfig

__all__ = [
    "DisRMConfig",
    "GenRMConfig",
    "PreferenceDataConfig",
    "RewardLoopSection",
    "RewardRouterConfig",
    "RewardServersConfig",
    "RewardModelSection",
    "RewardSection",
    "SyntheticPreferencesConfig",
]


class SyntheticPreferencesConfig(Section):
    """Preference pairs over arithmetic problems (``ludic.training.reward_model.preferences.
    synthetic_arithmetic_preferences``): prompt ``"3+4="``, chosen the answer, rejected
    the answer off by 1..max_offset."""

    num_pairs: int = Field(512, ge=2)
    """Pairs generated in all (the eval split is taken from them)."""
    seed: int = 0
    operators: list[Literal["+", "-", "*"]] = Field(["+"], min_length=1)
    min_digits: int = Field(1, ge=1)
    max_digits: int = Field(1, ge=1)
    max_offset: int = Field(9, ge=1)
    """Wrong answers differ from the right one by 1..max_offset."""

    @model_validator(mode="after")
    def _digits(self) -> SyntheticPreferencesConfig:
        if self.min_digits > self.max_digits:
            raise ValueError(
                f"min_digits={self.min_digits} > max_digits={self.max_digits}; need "
                "min_digits <= max_digits"
            )
        return self


class PreferenceDataConfig(Section):
    """Where the preference pairs come from, and the held-out evaluation split."""

    path: str | None = None
    """A JSONL file of {"prompt", "chosen", "rejected"[, "margin", "meta"]} lines; null
    generates ``synthetic`` arithmetic pairs."""
    synthetic: SyntheticPreferencesConfig = SyntheticPreferencesConfig()
    """Used when ``path`` is null."""
    eval_size: int = Field(64, ge=1)
    """Pairs held out to measure pairwise accuracy before, during and after training."""
    holdout: Literal["pairs", "prompts"] = "pairs"
    """pairs: random pairs (exact duplicates are dropped from training); prompts: whole
    prompts, so every eval prompt is unseen in training."""

    @model_validator(mode="after")
    def _one_source(self) -> PreferenceDataConfig:
        if self.path is not None and self.synthetic != SyntheticPreferencesConfig():
            raise ValueError(
                "path is set, so synthetic is not used; remove the synthetic settings or "
                "set path: null"
            )
        return self


REWARD_TRAINER_SETTINGS = (
    "lr",
    "batch_size",
    "weight_decay",
    "max_grad_norm",
    "lr_schedule",
    "warmup_steps",
    "publish_every",
)
"""The :class:`~ludic.training.reward_model.config.PreferenceTrainerConfig` fields the
``reward_model`` section sets by the same name (``total_steps`` is ``steps``; ``seed`` and
``device`` come from the run config)."""

RewardTrainerSettings = settings_section(
    "RewardTrainerSettings",
    PreferenceTrainerConfig,
    REWARD_TRAINER_SETTINGS,
    doc="The PreferenceTrainerConfig fields of the reward_model section.",
)


class RewardModelSection(RewardTrainerSettings):  # type: ignore[misc,valid-type]
    """Reward-model training (``task: reward_model``): a sequence classifier with one
    label (backbone + linear ``score`` head) trained on preference pairs with the
    Bradley-Terry loss; the optimizer settings are those of
    :data:`REWARD_TRAINER_SETTINGS` (declared once, in ``PreferenceTrainerConfig``)."""

    training_mode: Literal["head_only", "lora", "full"] = "full"
    """head_only: the head alone; lora: LoRA adapters + head; full: every weight."""
    path: str | None = None
    """An HF folder or hub id (a sequence classifier, or a causal LM that gets a fresh
    one-label head); null builds the tiny reward model in RUN_DIR/model."""
    tiny: TinyModelConfig = TinyModelConfig()
    """Used when ``path`` is null."""
    lora: LoraConfig | None = None
    """LoRA adapters for training_mode lora (null there: the defaults)."""
    device: Device = "cpu"
    steps: int = Field(300, ge=1)
    """Optimizer steps."""
    eval_every: int = Field(0, ge=0)
    """Also evaluate every N steps (0: only before and after training)."""
    server: VLLMConfig | None = None
    """A vLLM reward server (``ludic serve reward``) kept in sync with the training model:
    started on the initial model unless ``server.start_server`` is false. Null: none."""
    checkpoint_every: int = Field(100, ge=1)
    keep_last: int = Field(2, ge=1)
    data: PreferenceDataConfig = PreferenceDataConfig()

    @model_validator(mode="after")
    def _consistent(self) -> RewardModelSection:
        if self.lora is not None and self.training_mode != "lora":
            raise ValueError(
                f"lora is set but training_mode={self.training_mode!r}; set training_mode: "
                "lora or remove lora"
            )
        if self.path is not None and self.tiny != TinyModelConfig():
            raise ValueError(
                "path is set, so tiny is not used; remove the tiny settings or set path: null"
            )
        if self.server is not None and self.publish_every == 0:
            raise ValueError(
                "server is set but publish_every=0: set publish_every >= 1 to keep the "
                "server in sync, or remove server"
            )
        if self.lr_schedule != "constant" and self.warmup_steps >= self.steps:
            raise ValueError(
                f"lr_schedule={self.lr_schedule!r} decays to 0 at steps={self.steps}, so "
                f"warmup_steps={self.warmup_steps} must be smaller"
            )
        try:
            self.trainer_config()
        except ValueError as e:  # "PreferenceTrainerConfig.lr=0 is invalid" -> "lr=0 is ..."
            raise ValueError(str(e).replace("PreferenceTrainerConfig.", "")) from None
        return self

    def trainer_config(self, **rest: Any) -> PreferenceTrainerConfig:
        """The :class:`PreferenceTrainerConfig` of these settings, ``total_steps=steps``
        and ``rest`` (``seed``)."""
        return self.settings_object(total_steps=self.steps, device=self.device, **rest)


class RewardSection(Section):
    """A learned reward for RL (``algorithm.name: reward_rl``): a reward model with one
    label scores each completion (``format_reward_input(question, completion)``), and the
    score replaces or combines with the env's reward."""

    path: str
    """The reward model: an HF sequence-classifier folder, e.g. RUN_DIR/reward_model of a
    ``task: reward_model`` run."""
    backend: Literal["transformers", "vllm"] = "transformers"
    """transformers: scored in process; vllm: a vLLM reward server (``server``)."""
    server: VLLMConfig = VLLMConfig()
    """The reward server when backend is vllm (started on ``path`` unless
    ``server.start_server`` is false)."""
    mode: Literal["replace", "add", "multiply", "weighted"] = "replace"
    """How score s and env reward r combine: s, r + s, r * s, or weight*r + (1-weight)*s."""
    weight: float = Field(0.5, ge=0.0, le=1.0)
    """The env reward's share in mode weighted."""
    normalize: bool = True
    """Score with the sigmoid of the reward model's logit (false: the raw logit)."""


class RewardServersConfig(Section):
    """N vLLM servers of one model, started by the run behind its reward router (or
    running already: ``server.start_server: false`` with ``server.port`` for one)."""

    path: str | None = None
    """The model folder: a one-label sequence classifier (``disrm``) or a causal LM with a
    chat template (``genrm``, the judge). null: a tiny random one built in
    RUN_DIR/{disrm,genrm}_model, to try the plumbing."""
    num_servers: int = Field(1, ge=1)
    """Servers started on ``path``, each on its own port, all behind the router."""
    weight: float = 1.0
    """This component's weight in the hybrid reward."""
    server: VLLMConfig = VLLMConfig()
    """Settings of each server (``port`` must be null when num_servers > 1)."""
    sleep: Literal["off", "keep_weights", "reload_weights"] = "off"
    """``reward_loop.mode: colocate`` on CUDA: the servers sleep (vLLM sleep mode) while
    the policy generates and the trainer trains, and wake to score each batch, so the GPU
    they share holds their memory only then. keep_weights: level 1, the weights wait in
    CPU memory; reload_weights: level 2, dropped, and read again from ``path`` at each
    wake (``POST /load_weights_from_disk``, verified). The KV cache is freed either way.
    off: they stay awake. Only for servers the run starts."""

    @model_validator(mode="after")
    def _ports(self) -> RewardServersConfig:
        if self.num_servers > 1 and self.server.port is not None:
            raise ValueError(
                f"server.port={self.server.port} with num_servers={self.num_servers}: each "
                "server needs its own port; leave server.port null (free ports are picked)"
            )
        if self.sleep != "off" and not self.server.start_server:
            raise ValueError(
                f"sleep={self.sleep} puts the servers the run starts to sleep; a running "
                "server (server.start_server: false) is not one: set sleep: off"
            )
        if not self.server.start_server and self.num_servers > 1:
            raise ValueError(
                "server.start_server=false connects to one running server; list several "
                "running servers behind a router of your own (reward_loop.router.address)"
            )
        return self


class DisRMConfig(RewardServersConfig):
    """A discriminative reward model (``ludic serve reward``) scoring ``question`` +
    ``solution``."""

    normalize: bool = True
    """The sigmoid of the reward model's logit (false: the raw logit)."""


class GenRMConfig(RewardServersConfig):
    """A generative judge (``ludic serve policy`` on a causal LM) asked through chat
    completions; its reply is parsed into a score (``ludic.rewards.genrm``)."""

    template: str | None = None
    """Prompt with {question}, {solution}, {ground_truth} and any extra_info key (null:
    ``ludic.rewards.genrm.DEFAULT_TEMPLATE``)."""
    pattern: str = r"Score:\s*(\d+(?:\.\d+)?)"
    """Regex whose last match's group is the judgement."""
    scale: float = Field(10.0, gt=0)
    """score = judgement / scale."""
    sampling: dict[str, Any] = {"temperature": 0.0, "max_tokens": 16}
    """Chat-completion parameters, e.g. {"structured_outputs": {"regex": "Score: [0-9]"}}
    to force the judgement's format."""


class GroupJudgeConfig(RewardServersConfig):
    """A group-relative judge (``ludic serve policy`` on a causal LM): the G completions of
    one prompt judged together in one chat-completions call, its scores or its ranking
    forced into compact JSON of G entries (``ludic.rewards.group_judge``; in the manner of
    ART's RULER). Every member of a group is scored by the same call, hence the same judge
    version, also in async mode. ``weight`` is unused: the judge's score is the loop's."""

    mode: Literal["scores", "ranking"] = "scores"
    """scores: an integer 0..10 per answer, reward score / 10; ranking: the answers' order,
    best first, reward 1 - position / (G - 1)."""
    template: str | None = None
    """Prompt with {n}, {question}, {ground_truth}, {answers} (numbered, one per line),
    {instruction} (the mode's reply format) and any extra_info key (null:
    ``ludic.rewards.group_judge.GROUP_TEMPLATE``)."""
    sampling: dict[str, Any] = {"temperature": 0.0}
    """Chat-completion parameters (max_tokens defaults to 16 + 4 per answer; the
    structured_outputs regex is set unless given here)."""

    @model_validator(mode="after")
    def _no_weight(self) -> GroupJudgeConfig:
        if "weight" in self.model_fields_set:
            raise ValueError("weight: the group judge's score is the reward loop's; remove it")
        return self


class RewardRouterConfig(Section):
    """The router every reward server sits behind (``ludic serve router``)."""

    address: str | None = None
    """A running router (e.g. http://host:port) to use instead: then disrm/genrm name no
    servers to start (their ``path`` still picks nothing; only ``weight``, ``normalize``
    and the judge settings are read). In pipeline mode ``ludic train`` starts the servers
    once for all its actors; a learner or actor started by hand, or ``ludic launch``,
    needs this address."""
    api_key: str | None = Field(None, exclude=True, repr=False)
    """The running router's key (null: $LUDIC_API_KEY). A router the run starts gets the
    run's server key. Never saved."""
    port: int | None = Field(None, ge=1, le=65535)
    health_interval_s: float = Field(2.0, gt=0)
    request_timeout_s: float = Field(300.0, gt=0)


class RewardLoopSection(Section):
    """The reward loop (spec 5): every rollout scored per sample by a reward function
    (rule, discriminative and generative reward models, or a weighted mix), as its episode
    ends (standalone) or after the batch (colocate); the score replaces or joins the env's
    reward before the algorithm's credit assignment."""

    function: RewardFunctionName | None = None
    """A reward function: yours, ``path/to/file.py:fn`` or ``module:fn`` with the
    signature (data_source, solution_str, ground_truth, extra_info, **kwargs), sync or
    async, or a built-in one (``ludic.run.registries.REWARD_FUNCTIONS``: rules, gsm8k,
    math, arithmetic, format); null: ``rules``, the built-in rule chosen by data_source
    (gsm8k, math, arithmetic)."""
    function_kwargs: dict[str, Any] = {}
    """Extra keyword arguments for the function (those it accepts)."""
    data_source: str | None = None
    """The data_source the function sees (null: env.kind)."""
    rule_weight: float = 1.0
    """The function's weight when disrm or genrm is set (0 leaves it out)."""
    disrm: DisRMConfig | None = None
    genrm: GenRMConfig | None = None
    group_judge: GroupJudgeConfig | None = None
    """Score each prompt's group of completions together with an LLM judge instead of each
    sample alone (needs a group preset such as grpo); not with function, disrm or genrm."""
    router: RewardRouterConfig = RewardRouterConfig()
    manager: str = "naive"
    """A registered reward manager: naive, dapo, rate_limited; or yours, a
    ``RewardManager`` subclass named as ``path/to/file.py:MyManager`` or
    ``module:MyManager`` (or registered with ``@ludic.rewards.register`` in
    ``manager_module``)."""
    manager_kwargs: dict[str, Any] = {}
    """Arguments of the manager, e.g. dapo: {overlong_buffer_len: 16}; rate_limited:
    {requests_per_s: 10, max_concurrency: 4}."""
    manager_module: ModuleReference | None = None
    """A module or .py file imported first, so that its @register runs."""
    mode: Literal["standalone", "colocate"] = "standalone"
    """standalone: score each rollout as its episode ends, overlapping generation;
    colocate: after the whole batch."""
    num_workers: int = Field(8, ge=1)
    """Samples scored at once."""
    timeout_s: float | None = Field(60.0, gt=0)
    """Most seconds one sample's scoring may take (a longer one is a failure)."""
    on_error: float | Literal["drop"] = "drop"
    """The score of a sample whose scoring failed, or drop (its group trains on nothing);
    failures are counted in batch/reward_loop/errors either way."""
    max_failure_fraction: float = Field(0.5, ge=0.0, le=1.0)
    """A batch in which more than this fraction of the samples failed to score stops the
    run with the first error and its sample (1: never; 0: any failure). Each new kind of
    failure is printed once either way."""
    combine: Literal["replace", "add", "weighted"] = "replace"
    """How score s and env return r combine: s, r + s, or env_weight*r + (1-env_weight)*s."""
    env_weight: float = Field(0.5, ge=0.0, le=1.0)

    @field_validator("manager")
    @classmethod
    def _manager(cls, manager: str) -> str:
        if not is_code_spec(manager):
            return manager  # a registered name: checked when the manager is built
        split_spec(manager, field=None)
        return absolute_spec(manager)

    @model_validator(mode="after")
    def _router_or_servers(self) -> RewardLoopSection:
        if self.group_judge is not None:
            mixed = [
                name
                for name, value in (
                    ("function", self.function),
                    ("disrm", self.disrm),
                    ("genrm", self.genrm),
                )
                if value is not None
            ]
            if mixed:
                raise ValueError(
                    f"group_judge scores whole groups; it does not mix with the per-sample "
                    f"{mixed} yet: remove {mixed} or group_judge"
                )
            return self
        if self.rule_weight == 0 and self.disrm is None and self.genrm is None:
            raise ValueError("rule_weight=0 leaves no reward: set disrm or genrm, or rule_weight")
        return self

    def sleeping_servers(self) -> list[str]:
        """The server groups (``disrm``, ``genrm``, ``group_judge``) set to sleep."""
        return [
            name
            for name in ("disrm", "genrm", "group_judge")
            if getattr(self, name) is not None and getattr(self, name).sleep != "off"
        ]

    @model_validator(mode="after")
    def _sleep_in_colocate_mode(self) -> RewardLoopSection:
        for name in self.sleeping_servers():
            sleep = getattr(self, name).sleep
            if self.mode != "colocate":
                raise ValueError(
                    f"{name}.sleep={sleep} with mode={self.mode}: a standalone loop scores "
                    "while the policy generates, so its servers never sleep; set mode: "
                    "colocate (or sleep: off)"
                )
            if self.router.address is not None:
                raise ValueError(
                    f"{name}.sleep={sleep} with router.address: the run starts no server to "
                    "put to sleep; set sleep: off"
                )
        return self
