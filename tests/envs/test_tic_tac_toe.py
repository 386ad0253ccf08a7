"""Tic-tac-toe: move parsing, the single-agent env vs its opponent, the two-player env."""

from __future__ import annotations

import random

import pytest

from ludic.envs import TicTacToeEnv, TicTacToeRewards, TicTacToeTwoPlayerEnv
from ludic.envs.tic_tac_toe import heuristic_move, parse_move, render_board

# -- helpers ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("action", "cell"),
    [("1", 0), (" 5\n", 4), ("9", 8), ("A1", 0), ("b2", 4), (" c 3 ", 8), ("C1", 2), ("A3", 6)],
)
def test_parse_move_accepts_numbers_and_coordinates(action: str, cell: int) -> None:
    assert parse_move(action) == cell


@pytest.mark.parametrize("action", ["0", "10", "D1", "A4", "", "five", "B2 please"])
def test_parse_move_rejects_anything_else(action: str) -> None:
    assert parse_move(action) is None


def test_render_board_shows_marks_and_free_cell_numbers() -> None:
    board = ["X", "", "", "", "O", "", "", "", "X"]
    assert render_board(board) == "X|2|3\n4|O|6\n7|8|X"


def test_heuristic_wins_before_blocking() -> None:
    board = ["O", "O", "", "X", "X", "", "", "", ""]
    assert heuristic_move(board, "O", random.Random(0)) == 2


def test_heuristic_blocks_opponent_win() -> None:
    board = ["X", "X", "", "", "O", "", "", "", ""]
    assert heuristic_move(board, "O", random.Random(0)) == 2


# -- single agent ----------------------------------------------------------------------


def play(env: TicTacToeEnv, *moves: str):
    return [env.step({"agent_0": m})["agent_0"] for m in moves]


def test_reset_shows_empty_board_and_asks_for_a_move() -> None:
    obs, info = TicTacToeEnv().reset(seed=0)["agent_0"]
    assert obs.startswith("1|2|3\n4|5|6\n7|8|9")
    assert "Your move" in obs
    assert info == {"board": ".........", "opponent_move": None}


def test_legal_move_places_x_and_opponent_answers() -> None:
    env = TicTacToeEnv()
    env.reset(seed=0)
    (out,) = play(env, "5")
    assert out.reward == 0.0 and not out.terminated
    board = out.info["board"]
    assert board[4] == "X" and board.count("O") == 1
    assert board[out.info["opponent_move"] - 1] == "O"
    assert f"O played {out.info['opponent_move']}." in out.obs


def test_opponent_is_deterministic_by_seed() -> None:
    def game(seed: int) -> list[int]:
        env = TicTacToeEnv()
        env.reset(seed=seed)
        moves = []
        for _ in range(4):
            free = [i + 1 for i, c in enumerate(env.board) if not c]
            out = env.step({"agent_0": str(free[0])})["agent_0"]
            moves.append(out.info["opponent_move"])
            if out.terminated:
                break
        return moves

    assert game(3) == game(3)
    assert len({tuple(game(s)) for s in range(10)}) > 1


def test_reset_without_seed_is_reproducible_via_rng_seed() -> None:
    envs = [TicTacToeEnv(agent_starts=False, rng_seed=1) for _ in range(2)]
    firsts = [[env.reset()["agent_0"][1]["opponent_move"] for _ in range(10)] for env in envs]
    assert firsts[0] == firsts[1]
    assert len(set(firsts[0])) > 1


def test_win_gives_win_reward_and_terminates() -> None:
    env = TicTacToeEnv(opponent="random")
    env.reset(seed=0)
    env.board = ["X", "X", "", "O", "O", "", "", "", ""]
    (out,) = play(env, "3")
    assert out.terminated and out.reward == 1.0
    assert out.info["result"] == "win"
    assert "You win." in out.obs


def test_loss_gives_loss_reward() -> None:
    env = TicTacToeEnv(opponent="heuristic")
    env.reset(seed=0)
    env.board = ["O", "O", "", "X", "", "", "X", "", ""]
    (out,) = play(env, "9")
    assert out.info["opponent_move"] == 3
    assert out.terminated and out.reward == -1.0 and out.info["result"] == "loss"


def test_draw_gives_draw_reward() -> None:
    env = TicTacToeEnv(rewards=TicTacToeRewards(draw=0.5))
    env.reset(seed=0)
    env.board = ["X", "O", "X", "X", "O", "O", "O", "X", ""]
    (out,) = play(env, "9")
    assert out.terminated and out.reward == 0.5 and out.info["result"] == "draw"


def test_illegal_move_terminates_with_penalty_by_default() -> None:
    env = TicTacToeEnv()
    env.reset(seed=0)
    (out,) = play(env, "center please")
    assert out.terminated and out.reward == -1.0
    assert out.info["result"] == "illegal" and out.info["illegal_move"] is True
    assert "Illegal move" in out.obs


def test_taken_cell_is_illegal() -> None:
    env = TicTacToeEnv()
    env.reset(seed=0)
    (first,) = play(env, "5")
    (out,) = play(env, str(first.info["opponent_move"]))
    assert out.info["illegal_move"] and out.reward == -1.0
    assert f"cell {first.info['opponent_move']} is taken" in out.obs


def test_illegal_move_retry_keeps_board_and_asks_again() -> None:
    env = TicTacToeEnv(illegal_move="retry", rewards=TicTacToeRewards(illegal_move=-0.2))
    env.reset(seed=0)
    before = list(env.board)
    (out,) = play(env, "x")
    assert not out.terminated and out.reward == -0.2
    assert env.board == before and out.info["opponent_move"] is None
    assert "Your move" in out.obs
    (ok,) = play(env, "1")
    assert ok.info["board"][0] == "X"


def test_retry_is_bounded_by_max_episode_steps() -> None:
    env = TicTacToeEnv(illegal_move="retry", max_episode_steps=2)
    env.reset(seed=0)
    first, second = play(env, "x", "y")
    assert not first.truncated
    assert second.truncated and not second.terminated


def test_opponent_can_start() -> None:
    obs, info = TicTacToeEnv(agent_starts=False).reset(seed=0)["agent_0"]
    assert info["board"].count("O") == 1
    assert obs.startswith(f"O played {info['opponent_move']}.")


def test_rejects_unknown_opponent_and_policy() -> None:
    with pytest.raises(ValueError, match="opponent='minimax'"):
        TicTacToeEnv(opponent="minimax")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="illegal_move='skip'"):
        TicTacToeEnv(illegal_move="skip")  # type: ignore[arg-type]


# -- two player ------------------------------------------------------------------------


def test_two_player_reset_gives_each_player_an_observation() -> None:
    env = TicTacToeTwoPlayerEnv()
    out = env.reset(seed=0)
    assert set(out) == {"X", "O"}
    assert "You play X" in out["X"][0] and "You play O" in out["O"][0]
    assert env.agent_ids == ["X", "O"] and env.active_agents == ["X"]


def test_two_player_turns_alternate_and_waiting_player_sees_the_move() -> None:
    env = TicTacToeTwoPlayerEnv()
    env.reset()
    out = env.step({"X": "5"})
    assert env.active_agents == ["O"]
    assert set(out) == {"X", "O"}
    assert out["O"].obs.startswith("X played 5.") and "You play O" in out["O"].obs
    assert out["X"].reward == out["O"].reward == 0.0
    env.step({"O": "1"})
    assert env.active_agents == ["X"]
    assert env.board[0] == "O" and env.board[4] == "X"


def test_two_player_rejects_the_wrong_player() -> None:
    env = TicTacToeTwoPlayerEnv()
    env.reset()
    with pytest.raises(ValueError, match=r"\['O'\].*'X'"):
        env.step({"O": "1"})
    with pytest.raises(ValueError, match=r"\['O', 'X'\]"):
        env.step({"X": "1", "O": "2"})


def test_two_player_win_rewards_both_players_and_ends_the_game() -> None:
    env = TicTacToeTwoPlayerEnv()
    env.reset()
    for player, move in [("X", "1"), ("O", "4"), ("X", "2"), ("O", "5")]:
        env.step({player: move})
    out = env.step({"X": "3"})
    assert out["X"].reward == 1.0 and out["O"].reward == -1.0
    assert out["X"].terminated and out["O"].terminated
    assert out["X"].info["result"] == "win" and out["O"].info["result"] == "loss"
    assert env.active_agents == []
    with pytest.raises(RuntimeError, match="no game in progress"):
        env.step({"O": "6"})


def test_two_player_draw() -> None:
    env = TicTacToeTwoPlayerEnv()
    env.reset()
    moves = ["1", "2", "3", "5", "4", "6", "8", "7"]
    for i, move in enumerate(moves):
        env.step({"XO"[i % 2]: move})
    out = env.step({"X": "9"})
    assert out["X"].reward == out["O"].reward == 0.0
    assert out["X"].info["result"] == out["O"].info["result"] == "draw"


def test_two_player_illegal_move_terminates_and_penalises_only_the_mover() -> None:
    env = TicTacToeTwoPlayerEnv()
    env.reset()
    env.step({"X": "5"})
    out = env.step({"O": "5"})
    assert out["O"].reward == -1.0 and out["O"].info["result"] == "illegal"
    assert out["X"].reward == 0.0 and out["X"].info["result"] == "opponent_illegal"
    assert out["O"].terminated and out["X"].terminated
    assert env.active_agents == []


def test_two_player_illegal_move_retry_keeps_the_mover_active() -> None:
    env = TicTacToeTwoPlayerEnv(illegal_move="retry")
    env.reset()
    out = env.step({"X": "nowhere"})
    assert set(out) == {"X"} and out["X"].reward == -1.0 and not out["X"].terminated
    assert env.active_agents == ["X"]
    env.step({"X": "1"})
    assert env.active_agents == ["O"]


def test_two_player_step_before_reset_raises() -> None:
    with pytest.raises(RuntimeError, match="call reset"):
        TicTacToeTwoPlayerEnv().step({"X": "1"})
