"""Tic-tac-toe: a single-agent env against a built-in opponent, and a two-player env.

Actions (both envs): a cell ``"1"``..``"9"``, row-major from the top left, or a coordinate
``"A1"``..``"C3"`` (column A-C left to right, row 1-3 top to bottom; ``"B2"`` is cell 5);
case and whitespace are ignored. The observation is the board with the numbers of the empty
cells showing, three lines such as ``X|2|3``, ``4|O|6``, ``7|8|9``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

from ludic.envs.env import LudicEnv
from ludic.envs.single_agent_env import DEFAULT_AGENT_ID, SingleAgentEnv
from ludic.types import AgentId, Info, Observation, StepOutcome

Board = list[str]
"""Nine cells, row-major; each ``"X"``, ``"O"`` or ``""`` (empty)."""

LINES = ((0, 1, 2), (3, 4, 5), (6, 7, 8), (0, 3, 6), (1, 4, 7), (2, 5, 8), (0, 4, 8), (2, 4, 6))
IllegalMovePolicy = Literal["terminate", "retry"]
OpponentKind = Literal["random", "heuristic"]


@dataclass(frozen=True)
class TicTacToeRewards:
    """Rewards for the end of a game and for an illegal move (unparsable or taken cell)."""

    win: float = 1.0
    draw: float = 0.0
    loss: float = -1.0
    illegal_move: float = -1.0


def parse_move(action: str) -> int | None:
    """The 0-based cell index of ``action`` (``"5"``, ``" b2 "``), or ``None``."""
    s = "".join(action.split()).upper()
    if len(s) == 1 and s in "123456789":
        return int(s) - 1
    if len(s) == 2 and s[0] in "ABC" and s[1] in "123":
        return (int(s[1]) - 1) * 3 + "ABC".index(s[0])
    return None


def winner(board: Board) -> str | None:
    for a, b, c in LINES:
        if board[a] and board[a] == board[b] == board[c]:
            return board[a]
    return None


def empty_cells(board: Board) -> list[int]:
    return [i for i, cell in enumerate(board) if not cell]


def render_board(board: Board) -> str:
    cells = [cell or str(i + 1) for i, cell in enumerate(board)]
    return "\n".join("|".join(cells[r * 3 : r * 3 + 3]) for r in range(3))


def board_string(board: Board) -> str:
    """A compact 9-character form for ``info`` (``"."`` = empty)."""
    return "".join(cell or "." for cell in board)


def _check_move(board: Board, action: str) -> tuple[int | None, str]:
    """``(cell, "")`` for a legal move, else ``(None, reason)``."""
    cell = parse_move(action)
    if cell is None:
        return None, f"Illegal move {action.strip()[:20]!r}: answer with a cell number 1-9."
    if board[cell]:
        return None, f"Illegal move: cell {cell + 1} is taken."
    return cell, ""


def heuristic_move(board: Board, me: str, rng: random.Random) -> int:
    """Win if possible, else block the opponent's win, else centre, a corner, any cell."""
    other = "O" if me == "X" else "X"
    for player in (me, other):
        for a, b, c in LINES:
            line = [board[a], board[b], board[c]]
            if line.count(player) == 2 and line.count("") == 1:
                return (a, b, c)[line.index("")]
    free = empty_cells(board)
    if 4 in free:
        return 4
    corners = [i for i in (0, 2, 6, 8) if i in free]
    return rng.choice(corners or free)


def _validate(policy: str, opponent: str | None = None) -> None:
    if policy not in ("terminate", "retry"):
        raise ValueError(f"illegal_move={policy!r}; expected 'terminate' or 'retry'")
    if opponent is not None and opponent not in ("random", "heuristic"):
        raise ValueError(f"opponent={opponent!r}; expected 'random' or 'heuristic'")


class TicTacToeEnv(SingleAgentEnv):
    """The agent plays X against a built-in O opponent.

    * ``opponent``: ``"random"`` (uniform over empty cells) or ``"heuristic"`` (see
      :func:`heuristic_move`). Its RNG is seeded by ``reset(seed)``; ``seed=None`` draws a
      seed from the env's own RNG (``rng_seed``), so games are reproducible either way.
    * ``agent_starts=False`` lets the opponent move first (its move is in the first obs).
    * Rewards (``rewards``): win +1, draw 0, loss -1 at the end; 0 on ordinary moves.
    * Illegal move (unparsable or taken cell): reward ``rewards.illegal_move``; with
      ``illegal_move="terminate"`` (default) the episode ends (``info["result"] ==
      "illegal"``), with ``"retry"`` the board is unchanged, the opponent does not move
      and the obs asks again. Use ``max_episode_steps`` to bound retries.
    * Info: ``board`` (9 chars, ``"."`` empty), ``illegal_move``, ``opponent_move``
      (1-9 or ``None``) and, once the game ends, ``result`` in ``win/loss/draw/illegal``.
    """

    def __init__(
        self,
        *,
        opponent: OpponentKind = "random",
        agent_starts: bool = True,
        illegal_move: IllegalMovePolicy = "terminate",
        rewards: TicTacToeRewards | None = None,
        max_episode_steps: int | None = None,
        system_prompt: str | None = None,
        agent_id: AgentId = DEFAULT_AGENT_ID,
        rng_seed: int | None = None,
    ) -> None:
        _validate(illegal_move, opponent)
        super().__init__(
            agent_id=agent_id, max_episode_steps=max_episode_steps, system_prompt=system_prompt
        )
        self.opponent = opponent
        self.agent_starts = agent_starts
        self.illegal_move = illegal_move
        self.rewards = rewards or TicTacToeRewards()
        self._seed_rng = random.Random(rng_seed)
        self._rng = random.Random(0)
        self.board: Board = [""] * 9

    def _opponent_move(self) -> int:
        if self.opponent == "heuristic":
            cell = heuristic_move(self.board, "O", self._rng)
        else:
            cell = self._rng.choice(empty_cells(self.board))
        self.board[cell] = "O"
        return cell

    def _obs(self, prefix: str, ask: bool = True) -> Observation:
        ask_line = "\nYou play X. Your move (1-9):" if ask else ""
        return f"{prefix}{render_board(self.board)}{ask_line}"

    def _info(self, **extra: object) -> Info:
        return {"board": board_string(self.board), **extra}

    def env_reset(self, seed: int | None = None) -> tuple[Observation, Info]:
        if seed is None:
            seed = self._seed_rng.randrange(2**31)
        self._rng = random.Random(seed)
        self.board = [""] * 9
        prefix, opp = "", None
        if not self.agent_starts:
            opp = self._opponent_move() + 1
            prefix = f"O played {opp}.\n"
        return self._obs(prefix), self._info(opponent_move=opp)

    def _end(self, result: str, reward: float, text: str, opp: int | None) -> StepOutcome:
        return StepOutcome(
            obs=self._obs(f"{text}\n", ask=False),
            reward=reward,
            terminated=True,
            info=self._info(result=result, illegal_move=False, opponent_move=opp),
        )

    def env_step(self, action: str) -> StepOutcome:
        cell, reason = _check_move(self.board, action)
        if cell is None:
            done = self.illegal_move == "terminate"
            info = self._info(illegal_move=True, opponent_move=None)
            if done:
                info["result"] = "illegal"
            return StepOutcome(
                obs=self._obs(f"{reason}\n", ask=not done),
                reward=self.rewards.illegal_move,
                terminated=done,
                info=info,
            )
        self.board[cell] = "X"
        if winner(self.board) == "X":
            return self._end("win", self.rewards.win, "You win.", None)
        if not empty_cells(self.board):
            return self._end("draw", self.rewards.draw, "Draw.", None)
        opp = self._opponent_move() + 1
        if winner(self.board) == "O":
            return self._end("loss", self.rewards.loss, f"O played {opp}. You lose.", opp)
        if not empty_cells(self.board):
            return self._end("draw", self.rewards.draw, f"O played {opp}. Draw.", opp)
        return StepOutcome(
            obs=self._obs(f"O played {opp}.\n"),
            reward=0.0,
            info=self._info(illegal_move=False, opponent_move=opp),
        )


class TicTacToeTwoPlayerEnv(LudicEnv):
    """Two agents, ``"X"`` and ``"O"``, alternate moves; X moves first.

    ``active_agents`` is the player to move (empty once the game is over), and ``step``
    takes exactly that player's action. It returns an outcome for the mover and, when
    the board changed or the game ended, also for the waiting player (its obs shows the
    new board; at the end it carries that player's final reward), so each agent learns
    the result of a game it did not end itself. Rewards as in :class:`TicTacToeEnv`
    (win/draw/loss per player). An illegal move gives the mover ``rewards.illegal_move``;
    with ``illegal_move="terminate"`` (default) the game ends and the waiting player
    gets 0.0 (``result="opponent_illegal"``), with ``"retry"`` the mover stays active.
    ``reset(seed)`` accepts a seed for the contract; the game itself is deterministic.
    """

    def __init__(
        self,
        *,
        illegal_move: IllegalMovePolicy = "terminate",
        rewards: TicTacToeRewards | None = None,
        system_prompt: str | None = None,
    ) -> None:
        _validate(illegal_move)
        self.illegal_move = illegal_move
        self.rewards = rewards or TicTacToeRewards()
        if system_prompt is not None:
            self.system_prompt = system_prompt
        self.board: Board = [""] * 9
        self._to_move: AgentId | None = None

    @property
    def agent_ids(self) -> list[AgentId]:
        return ["X", "O"]

    @property
    def active_agents(self) -> list[AgentId]:
        return [] if self._to_move is None else [self._to_move]

    def _obs(self, player: AgentId, prefix: str = "", ask: bool = True) -> Observation:
        ask_line = f"\nYou play {player}. Your move (1-9):" if ask else ""
        return f"{prefix}{render_board(self.board)}{ask_line}"

    def reset(self, seed: int | None = None) -> dict[AgentId, tuple[Observation, Info]]:
        self.board = [""] * 9
        self._to_move = "X"
        info: Info = {"board": board_string(self.board)}
        return {
            "X": (self._obs("X"), dict(info)),
            "O": (self._obs("O", ask=False) + "\nYou play O. X moves first.", dict(info)),
        }

    def step(self, actions: dict[AgentId, str]) -> dict[AgentId, StepOutcome]:
        if self._to_move is None:
            raise RuntimeError(
                "TicTacToeTwoPlayerEnv.step called with no game in progress (before reset() "
                "or after the game ended); call reset()"
            )
        mover = self._to_move
        if set(actions) != {mover}:
            raise ValueError(
                f"TicTacToeTwoPlayerEnv.step got actions for {sorted(actions)}; it is "
                f"{mover!r}'s turn, so pass exactly {{{mover!r}: move}}"
            )
        waiter = "O" if mover == "X" else "X"
        cell, reason = _check_move(self.board, actions[mover])
        if cell is None:
            return self._illegal(mover, waiter, reason)
        self.board[cell] = mover
        info: Info = {"board": board_string(self.board), "move": cell + 1, "illegal_move": False}
        if winner(self.board) == mover or not empty_cells(self.board):
            won = winner(self.board) == mover
            self._to_move = None
            r = self.rewards
            text = {mover: "You win." if won else "Draw.", waiter: "You lose." if won else "Draw."}
            reward = {mover: r.win if won else r.draw, waiter: r.loss if won else r.draw}
            result = {mover: "win" if won else "draw", waiter: "loss" if won else "draw"}
            return {
                p: StepOutcome(
                    obs=self._obs(p, f"{text[p]}\n", ask=False),
                    reward=reward[p],
                    terminated=True,
                    info={**info, "result": result[p]},
                )
                for p in (mover, waiter)
            }
        self._to_move = waiter
        return {
            mover: StepOutcome(
                obs=self._obs(mover, ask=False) + f"\nWaiting for {waiter}.", reward=0.0, info=info
            ),
            waiter: StepOutcome(
                obs=self._obs(waiter, f"{mover} played {cell + 1}.\n"),
                reward=0.0,
                info=dict(info),
            ),
        }

    def _illegal(self, mover: AgentId, waiter: AgentId, reason: str) -> dict[AgentId, StepOutcome]:
        info: Info = {"board": board_string(self.board), "move": None, "illegal_move": True}
        penalty = self.rewards.illegal_move
        if self.illegal_move == "retry":
            return {mover: StepOutcome(self._obs(mover, f"{reason}\n"), penalty, info=info)}
        self._to_move = None
        return {
            mover: StepOutcome(
                self._obs(mover, f"{reason}\n", ask=False),
                penalty,
                terminated=True,
                info={**info, "result": "illegal"},
            ),
            waiter: StepOutcome(
                self._obs(waiter, f"{mover} made an illegal move. Game over.\n", ask=False),
                0.0,
                terminated=True,
                info={**info, "result": "opponent_illegal"},
            ),
        }
