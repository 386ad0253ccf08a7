"""ludic: a hackable library for reinforcement learning of LLMs with policy gradients.

The names most scripts need are importable from here (lazily, so ``import ludic`` is
cheap); everything else lives in its subpackage:

* ``ludic.envs``, ``ludic.agents``, ``ludic.context``, ``ludic.parsers``, ``ludic.interaction``
  -- environments and the agent harness; ``ludic.inference`` -- ``ChatClient`` and backends;
* ``ludic.rollouts`` -- the rollout engine; ``ludic.training`` -- credit, losses, the Trainer;
* ``ludic.eval`` -- evaluation; ``ludic.distributed`` -- weight publishing.
"""

from __future__ import annotations

from ludic._lazy import lazy_exports

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    # data
    "Rollout": "ludic.types",
    "AgentStep": "ludic.types",
    "EnvironmentStep": "ludic.types",
    "StepOutcome": "ludic.types",
    "TokenTrace": "ludic.types",
    "ChatResponse": "ludic.types",
    "ParseResult": "ludic.parsers",
    # harness
    "LudicEnv": "ludic.envs",
    "SingleAgentEnv": "ludic.envs",
    "DatasetQAEnv": "ludic.envs",
    "Agent": "ludic.agents",
    "ToolAgent": "ludic.agents",
    "ReActAgent": "ludic.agents",
    "FullDialog": "ludic.context",
    "SingleAgentProtocol": "ludic.interaction",
    "MultiAgentProtocol": "ludic.interaction",
    # inference
    "ChatClient": "ludic.inference",
    "HFChatTemplate": "ludic.inference",
    "InferenceSpec": "ludic.inference",
    "SamplingSpec": "ludic.inference",
    "ReturnSpec": "ludic.inference",
    "TransformersChatClient": "ludic.inference",
    # training
    "RolloutRequest": "ludic.training",
    "EnvSpec": "ludic.training",
    "ProtocolSpec": "ludic.training",
    "RolloutEngine": "ludic.training",
    "GRPORequestStrategy": "ludic.training",
    "RolloutBatchSource": "ludic.training",
    "OfflineBatchSource": "ludic.training",
    "Trainer": "ludic.training",
    "TrainerConfig": "ludic.training",
    "RLAlgorithm": "ludic.training",
    "make_reinforce": "ludic.training",
    "make_reinforce_baseline": "ludic.training",
    "make_grpo": "ludic.training",
    "make_dr_grpo": "ludic.training",
    "make_gspo": "ludic.training",
    "make_cispo": "ludic.training",
    "make_gmpo": "ludic.training",
    "make_decoupled_ppo": "ludic.training",
    "make_decoupled_grpo": "ludic.training",
    "make_sft": "ludic.training",
    "run_eval": "ludic.eval",
}

__getattr__, __all__ = lazy_exports(__name__, globals(), _EXPORTS)
