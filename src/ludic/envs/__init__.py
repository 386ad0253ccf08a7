"""Environments: the multi-agent kernel, the single-agent convenience layer and ready envs."""

from ludic.envs.arithmetic import ArithmeticQAEnv, make_arithmetic_samples
from ludic.envs.dataset_qa_env import (
    DatasetQAEnv,
    Verifier,
    exact_match,
    numeric_match,
    parse_number,
)
from ludic.envs.env import LudicEnv
from ludic.envs.single_agent_env import SingleAgentEnv
from ludic.envs.tic_tac_toe import TicTacToeEnv, TicTacToeRewards, TicTacToeTwoPlayerEnv

__all__ = [
    "ArithmeticQAEnv",
    "DatasetQAEnv",
    "LudicEnv",
    "SingleAgentEnv",
    "TicTacToeEnv",
    "TicTacToeRewards",
    "TicTacToeTwoPlayerEnv",
    "Verifier",
    "exact_match",
    "make_arithmetic_samples",
    "numeric_match",
    "parse_number",
]
