"""The typed run configuration behind ``ludic train CONFIG``.

One frozen pydantic model per component, nested into :class:`RunConfig`. Unknown fields
are errors; every field is documented here (the sections shared with reward-model runs,
such as ``model.tiny``, ``model.lora`` and ``inference.vllm``, in
:mod:`ludic.run.config_common`; ``reward_model`` and ``reward`` in
:mod:`ludic.run.config_reward`), so these files are the reference for config files. Values that name parts (env kinds, parsers, algorithms, credit assigners, reward
functions, tools) take a built-in name or your own code as ``package.module:attr`` or
``path/to/file.py:attr`` (:mod:`ludic.run.registries`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from ludic.run.config_common import (
    AlgorithmName,
    CreditAssignerName,
    Device,
    EnvKind,
    LoraConfig,
    ParserName,
    PolicyServersConfig,
    ProgramName,
    Section,
    TinyModelConfig,
    ToolName,
    VLLMConfig,
    settings_section,
)
from ludic.run.config_reward import (
    PreferenceDataConfig,
    RewardLoopSection,
    RewardModelSection,
    RewardSection,
    SyntheticPreferencesConfig,
)
from ludic.training.config import TrainerConfig

__all__ = [
    "LoraConfig",
    "PolicyServersConfig",
    "PreferenceDataConfig",
    "RewardLoopSection",
    "RewardModelSection",
    "RewardSection",
    "RunConfig",
    "SyntheticPreferencesConfig",
    "TinyModelConfig",
    "VLLMConfig",
]


class ModelConfig(Section):
    path: str | None = None
    """A Hugging Face model folder (with its config.json) or a hub id ``org/name`` (a bare
    name only when the local cache has it); null builds the tiny model in the run dir."""
    tiny: TinyModelConfig = TinyModelConfig()
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Training compute dtype (autocast); weights stay in float32."""
    lora: LoraConfig | None = None
    device: Device = "cpu"
    """Trainer device, e.g. "cpu" or "cuda"."""
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] | None = None
    """The policy's attention kernel (Hugging Face ``attn_implementation``); null: the
    library's default (sdpa). flash_attention_2 needs a GPU and the flash-attn package."""
    gradient_checkpointing: bool = False
    """Recompute decoder activations in the backward pass instead of keeping them (less
    memory, about a third more compute); needs trainer.shared_prefix: false."""


class InferenceConfig(Section):
    backend: Literal["transformers", "vllm"] = "transformers"
    """transformers: in-process, embedded; vllm: a vLLM server with live weight sync."""
    max_batch_size: int = Field(64, ge=1)
    lean_decode: bool = True
    """transformers backend: decode Llama, Mistral, Qwen2 and Qwen3 models with
    ``KVDecoder`` (the model's modules, a preallocated KV cache); false, or another model:
    the model's own forward."""
    vllm: PolicyServersConfig = PolicyServersConfig()


class SamplingConfig(Section):
    temperature: float = Field(1.0, ge=0.0)
    """Sampling temperature T (0: greedy). The trainer scores the samples under the policy
    that drew them, softmax(logits / T), as the backend's logprobs are."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling (1: off). The behaviour logprobs are those of the truncated
    distribution, the trainer's of the whole one: a ratio loss sees the mass cut as
    off-policy."""
    top_k: int = -1
    """Sample among the k likeliest tokens (-1: off); as ``top_p`` for the logprobs."""
    max_tokens: int = Field(8, ge=1)
    """Generation budget per model call."""
    structured_outputs: dict[str, Any] | None = None
    """vLLM's structured outputs for every model call, e.g. ``{regex: "[0-9]+"}``,
    ``{json: SCHEMA}``, ``{choice: [a, b]}`` (inference.backend: vllm only): the sampled
    tokens are constrained, and their logprobs are those of the constrained sampler."""


class EnvConfig(Section):
    kind: EnvKind = "arithmetic"
    """A built-in env (``ludic.run.registries.ENVS``: arithmetic, dataset_qa, tic_tac_toe,
    tic_tac_toe_two_player, reasoning_gym, textarena,
    verifiers, openenv) or yours: ``path/to/file.py:MyEnv`` or
    ``package.module:MyEnv``, a ``LudicEnv`` class (e.g. a ``SingleAgentEnv`` subclass) or
    a function returning one. A relative file is taken from the current directory (the
    saved config holds its absolute path)."""
    kwargs: dict[str, Any] = {}
    """Constructor arguments of that env (the class's or function's keyword arguments)."""
    eval_kwargs: dict[str, Any] = {}
    """Overrides of ``kwargs`` for evaluation (e.g. a held-out problem_seed)."""
    episode_timeout_s: float | None = Field(600.0, gt=0)
    """An episode (env reset and steps, model calls) running longer fails the run with a
    TimeoutError naming the env kind and seed; null: no limit. A blocking env call on the
    event loop delays the error until it returns: set ``run_in_thread`` for such envs."""
    run_in_thread: bool = False
    """Run env ``reset``/``step`` in a thread, so ``episode_timeout_s`` cuts a blocking env
    (sandbox, simulator, remote call) short. Off by default: the built-in envs are fast, and
    calls on the event loop keep batching, hence results, deterministic."""


PROGRAM_IGNORES = ("context", "parser", "system_prompt", "incomplete_completion_penalty")
"""Agent settings an agent program does not use (set, they are refused)."""


class AgentConfig(Section):
    kind: Literal["plain", "tool", "react", "program"] = "plain"
    """plain: one model call per turn (``Agent``); tool: calls the ``tools`` below until it
    answers (``ToolAgent``); react: the same with a final-answer shot clock after
    ``max_react_steps`` calls (``ReActAgent``); program: your agent program (``program``)
    against an OpenAI-compatible endpoint of the policy, every call recorded with its exact
    tokens (``ludic.interaction.program``). Tool calls are ``<tool_call>{"name": ...,
    "arguments": {...}}</tool_call>`` blocks; the tools' schemas go to the chat template."""
    program: ProgramName | None = None
    """program: ``verifiers`` (plays ``env.kind: verifiers`` tasks), or yours,
    ``path/to/file.py:fn`` or ``module:fn``, ``async def fn(client:
    openai.AsyncOpenAI, task: dict)`` returning a reward, an answer for the env to score,
    or ``{reward | answer: ..., metrics: {...}}``; ``task`` is ``{prompt, seed, **the env's
    reset info}``. ``max_steps`` bounds its model calls per episode."""
    program_host: str = "127.0.0.1"
    """program: the address the endpoint listens on (always with a fresh API key, which
    the program's client carries); another host only for programs that run elsewhere
    (e.g. in a sandbox)."""
    protocol: Literal["single_agent", "multi_agent"] = "single_agent"
    """multi_agent: one agent per env agent id (e.g. ``tic_tac_toe_two_player``'s X and O),
    all sampling from the one policy: self-play. Each player's rollouts form its own
    GRPO groups."""
    context: Literal["full_dialog", "latest_observation"] = "full_dialog"
    """What the model sees each turn: full_dialog, every message so far
    (``ludic.context.FullDialog``); latest_observation, the system prompt and the newest
    observation on (``LatestObservation``), for envs whose observation already holds the
    whole state or history, such as TextArena's games."""
    parser: ParserName = "answer"
    """A built-in parser (``ludic.run.registries.PARSERS``: answer, xml_answer, boxed,
    think_then_answer, identity) or yours, ``file.py:parser`` / ``module:parser``: a
    function (text: str) -> ``ludic.parsers.ParseResult``."""
    system_prompt: str | None = None
    max_steps: int = Field(1, ge=1)
    """Protocol limit on env steps per episode (parse failures count); for agent.kind
    program, on model calls per episode."""
    incomplete_completion_penalty: float | None = None
    """If set, a completion cut by max_tokens is a parse failure with this reward."""
    tools: list[ToolName] = []
    """tool / react: Python functions the agent may call, as ``package.module:function`` or
    ``path/to/file.py:function`` (type hints and docstring give the schema)."""
    max_tool_calls: int = Field(8, ge=1)
    """tool / react: most tool calls in one turn; more is a parse failure."""
    tool_error_penalty: float = 0.0
    """tool / react: reward of a malformed tool call or of too many calls."""
    max_react_steps: int = Field(5, ge=1)
    """react: model calls per turn that may use tools before a final answer is forced."""

    @model_validator(mode="after")
    def _tools_match_kind(self) -> AgentConfig:
        if (self.kind == "program") != (self.program is not None):
            raise ValueError(
                "agent.kind=program needs agent.program (file.py:fn), and agent.program "
                "needs agent.kind: program"
                if self.kind == "program"
                else f"agent.program is set but agent.kind is {self.kind!r}; use agent.kind: "
                "program"
            )
        if self.kind == "program":
            if self.tools or self.protocol != "single_agent":
                raise ValueError(
                    "agent.kind=program: the program calls its own tools and plays one agent; "
                    "leave agent.tools empty and agent.protocol single_agent"
                )
            unused = sorted(self.non_default(PROGRAM_IGNORES))
            if unused:
                raise ValueError(
                    f"agent.kind=program does not use {unused}: the program builds its own "
                    "prompts and reads its own replies; remove them"
                )
            return self
        if self.kind == "plain" and self.tools:
            raise ValueError(
                f"agent.tools is set but agent.kind is 'plain'; use agent.kind: tool (or "
                f"react) to let the agent call {self.tools}"
            )
        if self.kind != "plain" and not self.tools:
            raise ValueError(
                f"agent.kind={self.kind!r} needs agent.tools: Python functions as "
                "package.module:function or path/to/file.py:function"
            )
        return self


PRESET_FIELDS = (
    "clip_eps_low",
    "clip_eps_high",
    "dual_clip_c",
    "behaviour_weight_cap",
    "behaviour_weight_mode",
    "truncated_is_cap",
    "group_std",
)
"""``AlgorithmConfig`` fields handed to the preset, by the same name, when written in the
config (unset: the preset's default; a preset without that argument is an error)."""


class AlgorithmConfig(Section):
    """The RL algorithm: a registered ``make_*`` preset and its settings. The clip and
    off-policy fields below go to the preset only when written in the config; unset, the
    preset's own default applies (e.g. GSPO's 3e-4 clip)."""

    name: AlgorithmName = "grpo"
    """A built-in preset (``ludic.run.registries.ALGORITHMS``) or yours,
    ``file.py:make_mine`` / ``module:make_mine``: a function returning an ``RLAlgorithm``,
    called with ``algorithm.kwargs`` (and ``group_size`` and the fields below that it
    takes, as the presets are)."""
    group_size: int = Field(8, ge=2)
    """Samples per problem; group-relative presets normalize rewards within the group."""
    clip_eps_low: float | None = Field(None, ge=0)
    """Lower clip range: ratios below 1 - clip_eps_low are clipped (null for cispo: no
    lower bound)."""
    clip_eps_high: float | None = Field(None, ge=0)
    """Upper clip range: ratios above 1 + clip_eps_high are clipped."""
    dual_clip_c: float | None = Field(None, gt=1)
    """Dual clip (verl's clip_ratio_c, usually 3): for negative advantages a token's loss
    is at most -c * A (grpo, dr_grpo, decoupled_ppo, decoupled_grpo)."""
    behaviour_weight_cap: float | None = Field(None, ge=1)
    """decoupled_*: cap on the behaviour weight pi_prox / pi_behav (preset default 5.0;
    written as null: no cap)."""
    behaviour_weight_mode: Literal["truncate", "mask"] | None = None
    """decoupled_*: a token over the cap gets weight = cap (truncate) or 0 (mask, AReaL's
    choice and the preset default)."""
    truncated_is_cap: float | None = Field(None, ge=1)
    """grpo: weight each token by min(pi_prox / pi_behav, cap), pi_behav the inference
    server's logprobs and pi_prox the trainer's own at the step start (truncated
    importance sampling for the train/inference mismatch, e.g. 2.0)."""
    group_std: Literal["population", "sample"] | None = None
    """grpo, gspo, cispo, gmpo, decoupled_grpo: the group std divides by G (population,
    the preset default) or G - 1 (sample, as verl and TRL); see
    ``ludic.training.credit_assignment.GroupNormalizedReturn``."""
    kwargs: dict[str, Any] = {}
    """Extra preset arguments, e.g. {normalize_std: false}."""
    credit_assigner: CreditAssignerName | None = None
    """Replace the preset's credit assigner: a built-in one
    (``ludic.run.registries.CREDIT_ASSIGNERS``: monte_carlo, group_normalized, episodic,
    per_step, constant) or yours, ``file.py:MyAssigner`` / ``module:MyAssigner``: a class
    or function called with ``credit_assigner_kwargs`` (and ``group_size`` if it takes
    it), returning an object with ``compute(rollouts) -> list[list[float]]`` (one weight
    per turn). null: the preset's own."""
    credit_assigner_kwargs: dict[str, Any] = {}
    """Arguments of ``credit_assigner``, e.g. {gamma: 0.99} for monte_carlo."""
    kl_coef: float = Field(0.0, ge=0)
    """beta of a KL penalty towards a frozen reference model, added to the preset's loss:
    L = L_policy + beta * agg_t(k(logp_t, ref_logp_t)), aggregated like the policy loss
    (``ludic.training.losses.KLPenalty``; GRPO's beta is 0.04, arXiv:2402.03300 eq. 3).
    The reference is the policy as RL starts (after the warm start), loaded once and kept
    as RUN_DIR/reference when a warm start ran, so a resumed run has the same one. 0: no
    reference model and no KL term."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """The per-token KL estimate (Schulman, http://joschu.net/blog/kl-approx.html), with
    l = ref_logp - logp: k1 = -l, k2 = l^2 / 2, k3 = exp(l) - 1 - l (GRPO's)."""
    negative_group_coef: float = Field(0.0, ge=0)
    """c > 0: a group whose returns are all equal and below the batch mean (for 0/1
    rewards: no sample right) gets the advantage c * (R - batch mean) instead of GRPO's 0,
    which lowers the probability of the answers it gave
    (``ludic.training.credit_assignment.GroupNormalizedReturn``). Needs group-relative
    credit (grpo, dr_grpo, gspo, cispo, gmpo, decoupled_grpo, reward_rl, or
    ``credit_assigner: group_normalized``); another preset is an error. 0: GRPO's."""
    entropy_coef: float = Field(0.0, ge=0)
    """c of an entropy bonus added to the preset's loss: L = L_policy - c * agg_t(H_t),
    H_t the current policy's next-token entropy (at the sampling temperature), aggregated
    like the policy loss (``ludic.training.losses.EntropyBonus``; PPO's c2, arXiv:1707.06347
    eq. 9; verl's entropy_coeff). It raises the token entropy, meant to slow the collapse of
    a group's samples onto one answer. 0: no term."""

    @model_validator(mode="after")
    def _no_setting_twice(self) -> AlgorithmConfig:
        twice = sorted(set(self.kwargs) & set(PRESET_FIELDS) & self.model_fields_set)
        if twice:
            raise ValueError(
                f"{twice[0]} is set both as algorithm.{twice[0]} and in algorithm.kwargs; "
                "keep one (algorithm.kwargs entries only for preset arguments without a field)"
            )
        if self.kl_estimator != "k3" and self.kl_coef == 0:  # (a saved config writes k3)
            raise ValueError(
                "kl_estimator is set but kl_coef is 0 (no KL term); set algorithm.kl_coef, "
                "e.g. 0.04, or remove kl_estimator"
            )
        if self.credit_assigner_kwargs and self.credit_assigner is None:
            raise ValueError(
                "credit_assigner_kwargs is set but credit_assigner is null; name the credit "
                "assigner they are for (or set the preset's arguments in algorithm.kwargs)"
            )
        return self


class WarmStartConfig(Section):
    """Supervised warm start before RL (``steps: 0`` skips it)."""

    steps: int = Field(300, ge=0)
    lr: float = Field(3e-3, gt=0)
    batch_size: int = Field(32, ge=1)
    demos: str = "dataset_answers"
    """"dataset_answers": the env's own reference answers (QA envs), or a JSONL of rollouts."""
    num_demos: int = Field(100, ge=1)
    """How many problems (env seeds 0..num_demos-1) "dataset_answers" demonstrates."""


TRAINER_SETTINGS = (
    "lr",
    "weight_decay",
    "betas",
    "eps",
    "max_grad_norm",
    "lr_schedule",
    "warmup_steps",
    "max_tokens_per_microbatch",
    "max_staleness",
    "ppo_epochs",
    "num_minibatches",
    "publish_every",
    "flat_parameters",
    "shared_prefix",
    "packing",
    "logprobs",
    "logprob_chunk_tokens",
)
"""The :class:`~ludic.training.config.TrainerConfig` fields a run config sets as
``trainer.<field>``: same type, default and docstring (the rest come from elsewhere in the
run config: ``total_steps`` is ``trainer.steps``; ``seed``, ``model.device``,
``model.dtype`` and ``model.gradient_checkpointing``; ``pad_token_id`` from the
tokenizer)."""

TrainerSettings = settings_section(
    "TrainerSettings",
    TrainerConfig,
    TRAINER_SETTINGS,
    doc="The TrainerConfig fields of the trainer section (see TRAINER_SETTINGS).",
)


class TrainerSection(TrainerSettings):  # type: ignore[misc,valid-type]
    """The RL phase: its length, batches, mode, checkpoints and ranks, and every
    ``TrainerConfig`` setting in :data:`TRAINER_SETTINGS` (declared once, there)."""

    removed = {
        "max_lag": (None, "use trainer.max_staleness (one bound for every mode)"),
        "version_span": (
            "drop",
            "trainer.max_version_span drops items straddling more weight updates; to keep "
            "and correct them per token, leave max_version_span null and use algorithm.name: "
            "decoupled_ppo or decoupled_grpo",
        ),
    }

    steps: int = Field(100, ge=1)
    """RL optimizer steps."""
    prompts_per_step: int = Field(8, ge=1)
    """Distinct problems per step (each sampled group_size times)."""
    mode: Literal["sync", "async", "pipeline"] = "sync"
    """sync: each step waits for its rollouts; async: generation keeps running while the
    trainer trains, at most ``max_staleness`` policy versions ahead (default 1; spec 4);
    pipeline: actor processes generate into Redis and a learner process trains (the
    ``pipeline`` section; ``ludic train`` starts both, or run ``ludic learner`` / ``ludic
    actor``). In every mode no token older than ``step - max_staleness`` is trained on."""
    max_version_span: int | None = Field(None, ge=0)
    """Drop items whose tokens straddle more than this many weight updates (continued
    partial rollouts); null: keep them (each token's behaviour logprob is the one that
    sampled it, and a decoupled loss, algorithm decoupled_ppo or decoupled_grpo, also
    corrects them per token). The staleness filter proper is max_staleness, on by default
    in async and pipeline mode (1): it drops an item by its oldest token, and since no
    token is newer than the trainer's weights, a kept item spans at most max_staleness
    updates; this setting only tightens that."""
    checkpoint_every: int = Field(25, ge=1)
    keep_last: int = Field(2, ge=1)
    """Checkpoints kept per phase."""
    checkpoint_policy: bool = True
    """Each checkpoint also holds its policy as a Hugging Face folder (step_N/policy:
    safetensors, tokenizer, LoRA merged); false saves the disk space on a large model
    (``ludic export`` can still write any kept checkpoint)."""
    world_size: int = Field(1, ge=1)
    """Trainer processes: more than one shards the policy with FSDP2 over them
    (``ludic.training.data_parallel``); ``ludic train`` starts them with torchrun (one per
    GPU with model.device cuda; gloo processes on CPU). Rank 0 generates, logs, publishes;
    checkpoints go through torch.distributed.checkpoint (resumable at another world
    size). In mode: pipeline the learner is the group (``ludic learner`` starts it with
    torchrun; ``ludic launch`` places its ranks on Ray) and rank 0 reads the queue. Not
    with LoRA, flat_parameters, a learned reward or a KL reference model."""

    @model_validator(mode="after")
    def _settings_and_staleness(self) -> TrainerSection:
        if self.publish_every < 1:
            raise ValueError(
                f"publish_every={self.publish_every}: a run publishes its weights to the "
                "inference backend; set publish_every >= 1"
            )
        try:
            self.trainer_config(pad_token_id=0)
        except ValueError as e:  # "TrainerConfig.lr=-1 is invalid; ..." -> "lr=-1 is ..."
            message = str(e).replace("TrainerConfig.", "").replace("total_steps", "steps")
            raise ValueError(message) from None
        if self.mode != "sync" and self.staleness < self.publish_every - 1:
            raise ValueError(
                f"max_staleness={self.staleness} (the async/pipeline default when unset) < "
                f"publish_every - 1 = {self.publish_every - 1}: the newest published weights "
                "are up to that many versions old, so generation could never start; raise "
                "max_staleness or lower publish_every"
            )
        return self

    @property
    def staleness(self) -> int:
        """``max_staleness`` with its async/pipeline default (1)."""
        return 1 if self.max_staleness is None else self.max_staleness

    def trainer_config(self, **rest: Any) -> TrainerConfig:
        """The :class:`TrainerConfig` of these settings, ``total_steps=steps`` and ``rest``
        (``pad_token_id``, ``seed``, ``device``, ...)."""
        return self.settings_object(total_steps=self.steps, **rest)


class PipelineConfig(Section):
    """The actor/learner pipeline over Redis (``trainer.mode: pipeline``): actors generate
    batches into a Redis queue, the learner trains on them and publishes weights (to the
    vLLM server with ``inference.backend: vllm``, through Redis with ``transformers``)."""

    redis_url: str | None = None
    """An existing Redis, e.g. redis://host:6379/0. null: ``ludic train`` (or a ``ludic
    learner`` started alone) starts a local redis-server with an fsync-always AOF in
    RUN_DIR/redis and a fresh password, and stops it at the end; actors find it through
    RUN_DIR/pipeline.json and RUN_DIR/redis_password (mode 0600)."""
    prefix: str | None = None
    """Key prefix of this run in Redis, so several runs can share one. null: the run
    directory's name (NAME-TIMESTAMP), the same for the learner and every actor given
    that directory."""
    num_actors: int = Field(1, ge=1)
    """Actor processes ``ludic train`` starts (``ludic actor`` starts one each)."""
    max_queued: int = Field(4, ge=1)
    """Batches waiting in Redis before actors block (backpressure)."""
    batch_timeout_s: float = Field(600.0, gt=0)
    """The learner fails (checkpointing first) when no batch arrives for this long."""
    actor_timeout_s: float = Field(600.0, gt=0)
    """An actor fails when the learner makes it wait this long: to announce itself
    (including its warm start), to admit the next batch (max_staleness), or to make room
    in a full queue. So actors never outlive a crashed learner by more than this."""
    reconnect_timeout_s: float = Field(60.0, ge=0)
    """How long every process retries while Redis is unreachable (e.g. restarting)."""
    stop_timeout_s: float = Field(60.0, gt=0)
    """``ludic train``: how long the learner gets to checkpoint and actors to exit after
    the run ends or is interrupted, before they are killed."""

    @field_validator("prefix")
    @classmethod
    def _prefix(cls, prefix: str | None) -> str | None:
        if prefix is not None and (not prefix or any(c.isspace() for c in prefix)):
            raise ValueError("must be non-empty without spaces")
        return prefix

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, url: str | None) -> str | None:
        if url is not None and not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(
                "not a Redis URL; use redis://HOST:PORT/DB (or null to start a local redis-server)"
            )
        return url


class PlacementConfig(Section):
    """The Ray resources one placed process reserves (``ludic launch``)."""

    cpus: float = Field(1.0, gt=0)
    gpus: float = Field(0.0, ge=0)
    """GPUs (Ray sets CUDA_VISIBLE_DEVICES); a policy or reward server on CUDA needs one,
    and so does the learner."""
    resources: dict[str, float] = {}
    """Custom Ray resources, e.g. ``{inference_node: 1}`` to put servers on nodes started
    with ``ray start --resources '{"inference_node": 8}'``."""


class LaunchConfig(Section):
    """``ludic launch CONFIG``: a pipeline run (``trainer.mode: pipeline``) placed on a Ray
    cluster: the learner on the launching node (it owns the run directory), the policy
    servers, the reward server and ``pipeline.num_actors`` rollout actors in placement
    groups."""

    address: str | None = None
    """The Ray cluster, e.g. ``auto`` or ``HEAD_IP:6379`` (run ``ludic launch`` on a node of
    it). null: ``$RAY_ADDRESS``, else a local Ray started for the run."""
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """Placement-group strategy of the servers' group and of the rollout actors' group."""
    learner: PlacementConfig = PlacementConfig()
    """Each learner rank's reservation (``trainer.world_size`` of them)."""
    learner_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """Placement-group strategy of the learner's ranks. Rank 0 runs on the launching node
    (it owns the run directory); ``STRICT_SPREAD`` puts each rank on a node of its own.
    Ranks on other nodes read and write the run directory (policy, sharded checkpoints)
    at the same path: they need a shared filesystem."""
    policy_server: PlacementConfig = PlacementConfig()
    reward_server: PlacementConfig = PlacementConfig()
    rollout_actor: PlacementConfig = PlacementConfig()
    max_restarts: int = Field(3, ge=0)
    """Times Ray restarts a rollout actor that died (its process killed, its node lost);
    the restarted actor regenerates the batch it had claimed. An actor that exits with an
    error is not restarted: the run fails."""
    placement_timeout_s: float = Field(300.0, gt=0)
    """How long to wait for the cluster to grant a placement group or a server to answer
    /health before the launch fails, naming what it asked for."""


class EvalConfig(Section):
    num_problems: int = Field(100, ge=1)
    """Evaluated on env seeds first_problem .. first_problem + num_problems - 1, greedy
    decoding."""
    first_problem: int = Field(0, ge=0)
    """The first env seed evaluated. The warm start's ``dataset_answers`` demonstrate seeds
    0 .. warm_start.num_demos - 1: starting past them evaluates on problems held out from
    the demonstrations (with a QA env whose problems differ by index, e.g. arithmetic
    with ``distinct: true``)."""
    every: int = Field(0, ge=0)
    """Also evaluate every N RL steps (0: only before and after RL)."""


class LoggingConfig(Section):
    wandb: bool = False
    """One wandb run for the whole run (every phase, evaluations, resumes), with the
    resolved config; see ``ludic.run.run_loggers``. Needs the wandb extra."""
    wandb_project: str = "ludic"
    wandb_mode: Literal["online", "offline"] | None = None
    """offline: write under RUN_DIR/wandb without a network (``wandb sync`` later); null:
    wandb's own default (``WANDB_MODE``, else online)."""
    tensorboard: bool = False
    """Event files of every phase in RUN_DIR/tensorboard. Needs the tensorboard extra."""
    console_every: int = Field(10, ge=1)
    """Print a metrics line every N steps (the progress bar updates every step)."""
    num_sample_rollouts: int = Field(4, ge=0)
    """Rollouts written to samples.jsonl per logged step."""


POLICY_SECTIONS = (
    "model",
    "inference",
    "env",
    "agent",
    "sampling",
    "algorithm",
    "warm_start",
    "trainer",
    "eval",
    "reward",
    "reward_loop",
    "pipeline",
    "launch",
)
"""Sections only policy training (``task: policy``) reads."""


class RunConfig(Section):
    task: Literal["policy", "reward_model"] = "policy"
    """policy: RL (optionally after an SFT warm start) of a policy on an env;
    reward_model: train a reward model on preference pairs (the ``reward_model`` section)."""
    name: str = "run"
    """The NAME in OUTPUT_DIR/NAME-TIMESTAMP: one folder name (no ``/``, ``\\`` or ``..``)."""
    output_dir: str = "runs"
    """Run directories are created as OUTPUT_DIR/NAME-TIMESTAMP."""
    seed: int = 0
    torch_threads: int | None = Field(None, ge=1)
    """CPU threads of torch's ops (sampling in process, the update; see ``update_threads``)
    in a sync or async run and ``ludic eval``; null: the ``OMP_NUM_THREADS`` environment variable when set, else the
    usable cores, divided among the trainer ranks of one machine, less one left to the event
    loop (envs, agent, chat template, rewards). A pipeline's processes keep torch's default."""
    update_threads: int | None = Field(None, ge=1)
    """CPU threads of torch's ops during the update of a ``trainer.mode: sync`` run (the
    event loop waits for it); null: ``torch_threads`` when set, else the ``OMP_NUM_THREADS``
    environment variable's setting when set, else every usable core, divided among the
    trainer ranks of one machine."""
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
    pipeline: PipelineConfig = PipelineConfig()
    """Read only with ``trainer.mode: pipeline``."""
    launch: LaunchConfig = LaunchConfig()
    """Read only by ``ludic launch`` (a pipeline run placed on Ray)."""
    reward_model: RewardModelSection = RewardModelSection()
    """Read only with ``task: reward_model``."""
    reward: RewardSection | None = None
    """A learned reward for ``algorithm.name: reward_rl`` (required there, unused otherwise)."""
    reward_loop: RewardLoopSection | None = None
    """The reward loop (rule / DisRM / GenRM rewards per sample); null: the env's reward."""

    @model_validator(mode="after")
    def _colocated_server(self) -> RunConfig:
        """A CUDA IPC weight sync needs the trainer on the GPU; sleeping needs the sync
        loop (every step generates, trains, then publishes and wakes the server)."""
        v = self.inference.vllm
        if self.inference.backend != "vllm" or v.sync_strategy == "broadcast":
            return self
        if not self.model.device.startswith("cuda"):
            raise ValueError(
                f"inference.vllm.sync_strategy={v.sync_strategy} with model.device="
                f"{self.model.device}: CUDA IPC shares GPU memory; use model.device: cuda or "
                "sync_strategy: broadcast"
            )
        if v.sleep_level and (self.trainer.mode != "sync" or self.trainer.publish_every != 1):
            raise ValueError(
                f"inference.vllm.sleep_level={v.sleep_level} needs trainer.mode: sync and "
                f"trainer.publish_every: 1 (got {self.trainer.mode!r}, "
                f"{self.trainer.publish_every}): the server sleeps through each step and the "
                "step's publish wakes it"
            )
        return self

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        if not name.strip() or "/" in name or "\\" in name or ".." in name:
            raise ValueError(
                "must be one folder name (no '/', '\\' or '..': the run directory is "
                "OUTPUT_DIR/NAME-TIMESTAMP); set output_dir to put runs elsewhere"
            )
        return name

    @model_validator(mode="after")
    def _sections_match_task(self) -> RunConfig:
        if self.task == "policy" and self.reward_model != RewardModelSection():
            raise ValueError(
                "reward_model is set but task is 'policy'; add task: reward_model to train a "
                "reward model (or remove the reward_model section)"
            )
        if self.task == "reward_model":
            unused = self.non_default(POLICY_SECTIONS)
            if unused:
                raise ValueError(
                    f"task is 'reward_model', which does not read {unused}; put reward-model "
                    "settings under reward_model (e.g. reward_model.lr, reward_model.path) "
                    "or remove those sections"
                )
        return self

    @model_validator(mode="after")
    def _pipeline_matches_mode(self) -> RunConfig:
        if self.trainer.mode != "pipeline" and self.pipeline != PipelineConfig():
            raise ValueError(
                f"pipeline is set but trainer.mode={self.trainer.mode!r}; set trainer.mode: "
                "pipeline to run actors and a learner over Redis, or remove the pipeline section"
            )
        return self

    @model_validator(mode="after")
    def _reward_matches_algorithm(self) -> RunConfig:
        if self.task != "policy":
            return self
        if self.algorithm.name == "reward_rl" and self.reward is None:
            raise ValueError(
                "algorithm.name=reward_rl needs a reward section (reward.path: a reward "
                "model folder, e.g. RUN_DIR/reward_model of a task: reward_model run)"
            )
        sleeping = self.reward_loop is not None and self.reward_loop.sleeping_servers()
        if sleeping and not self.model.device.startswith("cuda"):
            raise ValueError(
                f"reward_loop.{sleeping[0]}.sleep: vLLM sleep mode frees GPU memory and exists "
                f"on CUDA only; with model.device={self.model.device} set sleep: off"
            )
        if sleeping and self.trainer.mode == "pipeline":
            raise ValueError(
                f"reward_loop.{sleeping[0]}.sleep with trainer.mode=pipeline: the actors share "
                "the reward servers and score at any time; set sleep: off"
            )
        if self.reward_loop is not None and self.algorithm.name == "reward_rl":
            raise ValueError(
                "reward_loop and algorithm.name=reward_rl are two ways to score samples; "
                "pick one (reward_loop.disrm runs a reward model inside the reward loop)"
            )
        if self.reward is not None and self.algorithm.name != "reward_rl":
            raise ValueError(
                f"reward is set but algorithm.name={self.algorithm.name!r}; use "
                "algorithm.name: reward_rl to train on the reward model's scores, or remove reward"
            )
        return self

    @model_validator(mode="after")
    def _structured_outputs_need_vllm(self) -> RunConfig:
        if self.sampling.structured_outputs is not None and self.inference.backend != "vllm":
            raise ValueError(
                "sampling.structured_outputs needs inference.backend=vllm (the in-process "
                f"transformers backend cannot constrain sampling); got {self.inference.backend!r}"
            )
        return self

    @model_validator(mode="after")
    def _checkpointing_without_shared_prefix(self) -> RunConfig:
        if self.model.gradient_checkpointing and self.trainer.shared_prefix:
            raise ValueError(
                "model.gradient_checkpointing=true needs trainer.shared_prefix: false "
                "(checkpointed layers keep no KV cache, which the shared-prefix forward "
                "needs; packing still applies)"
            )
        return self

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

    @model_validator(mode="after")
    def _sharded_trainer(self) -> RunConfig:
        n = self.trainer.world_size
        if n == 1:
            return self
        unsupported = {
            "model.lora (merging sharded adapters is not supported yet)": self.model.lora
            is not None,
            "trainer.flat_parameters (FSDP2 shards parameters itself)": (
                self.trainer.flat_parameters
            ),
            "a learned reward (algorithm reward_rl)": self.reward is not None,
            "algorithm.kl_coef (the reference model is not sharded yet)": (
                self.algorithm.kl_coef > 0
            ),
            "task: reward_model": self.task != "policy",
        }
        bad = [what for what, on in unsupported.items() if on]
        if bad:
            raise ValueError(
                f"trainer.world_size={n} (FSDP2) does not work with {', '.join(bad)}; "
                "set trainer.world_size: 1 or change those settings"
            )
        return self
