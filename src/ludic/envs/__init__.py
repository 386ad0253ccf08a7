"""Environments: the multi-agent kernel, the single-agent convenience layer and ready envs."""

from __future__ import annotations

from ludic._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "ArithmeticQAEnv": "ludic.envs.arithmetic",
    "make_arithmetic_samples": "ludic.envs.arithmetic",
    "DatasetQAEnv": "ludic.envs.dataset_qa_env",
    "Verifier": "ludic.envs.dataset_qa_env",
    "exact_match": "ludic.envs.dataset_qa_env",
    "numeric_match": "ludic.envs.dataset_qa_env",
    "parse_number": "ludic.envs.dataset_qa_env",
    "LudicEnv": "ludic.envs.env",
    "ReferenceAnswerEnv": "ludic.envs.env",
    "OpenEnvEnv": "ludic.envs.openenv_env",
    "ReasoningGymEnv": "ludic.envs.reasoning_gym_env",
    "SingleAgentEnv": "ludic.envs.single_agent_env",
    "TextArenaEnv": "ludic.envs.textarena_env",
    "TicTacToeEnv": "ludic.envs.tic_tac_toe",
    "TicTacToeRewards": "ludic.envs.tic_tac_toe",
    "TicTacToeTwoPlayerEnv": "ludic.envs.tic_tac_toe",
    "VerifiersEnv": "ludic.envs.verifiers_env",
}

__getattr__, __all__ = lazy_exports(__name__, globals(), _EXPORTS)
