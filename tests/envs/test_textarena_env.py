"""``env.kind: textarena``: TextArena's games through the multi-agent protocol, self-play
from one policy, each player's rollouts in their own GRPO groups."""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path

import pytest

from ludic import jobs
from ludic.envs import TextArenaEnv
from ludic.inference import HFChatTemplate, TransformersChatClient
from ludic.run.builders import make_engine, make_requests, sampling_spec
from ludic.run.loading import load_config
from ludic.training.credit_assignment import GroupNormalizedReturn, rollout_group_key

pytest.importorskip("textarena", reason="the envs extra (textarena) is not installed")

SELF_PLAY = [
    "env.kind=textarena",
    "env.kwargs={game: TicTacToe-v0-train, num_players: 2}",
    "agent.protocol=multi_agent",
    "agent.context=latest_observation",
    "agent.max_steps=12",
    "model.tiny={hidden_size: 64, num_layers: 1, num_heads: 1, seed: 0}",
    "sampling.max_tokens=4",
    "warm_start.steps=0",
    "algorithm.group_size=2",
    "trainer.prompts_per_step=2",
    "eval.num_problems=2",
]


def _play(env: TextArenaEnv, moves: list[str]):
    outcomes = []
    for move in moves:
        (player,) = env.active_agents
        outcomes.append((player, env.step({player: move})))
    return outcomes


def test_a_game_is_played_turn_by_turn_and_scored_when_it_ends() -> None:
    env = TextArenaEnv(game="TicTacToe-v0-train")
    resets = env.reset(5)
    assert env.agent_ids == ["player_0", "player_1"] and env.active_agents == ["player_0"]
    assert (
        "Player 0" in resets["player_0"][0]
        and resets["player_1"][0] == "Waiting for the other players."
    )
    # player_0 wins the top row
    played = _play(env, ["[0]", "[3]", "[1]", "[4]", "[2]"])
    assert [p for p, _ in played] == ["player_0", "player_1"] * 2 + ["player_0"]
    for _, outcome in played[:-1]:  # the mover waits, the next player sees the board
        assert {o.reward for o in outcome.values()} == {0.0}
        assert not any(o.terminated for o in outcome.values())
    final = played[-1][1]
    assert final["player_0"].reward == 1.0 and final["player_1"].reward == -1.0
    assert all(o.terminated for o in final.values()) and env.active_agents == []
    with pytest.raises(RuntimeError, match="call reset"):
        env.step({"player_0": "[5]"})


def test_an_illegal_move_is_warned_then_loses_and_an_unmoved_player_gets_nothing() -> None:
    env = TextArenaEnv(game="TicTacToe-v0-train")
    env.reset(0)
    (first,) = _play(env, ["no move here"])[0][1].values()
    assert env.active_agents == ["player_0"] and not first.terminated  # a retry
    final = _play(env, ["still none"])[0][1]
    assert final["player_0"].reward == -1.0 and final["player_0"].info["invalid_move"]
    # TextArena would give player_1 +1, but it never moved: nothing to credit
    assert final["player_1"].reward == 0.0 and final["player_1"].info["moved"] is False


def test_episodes_keep_their_own_randomness_when_interleaved(monkeypatch) -> None:
    """Liar's Dice rolls dice from the global random generators (again after a call): two
    games stepped in turn show what each shows alone -- and would not without the swap."""
    moves = ["[Bid: 1, 2]", "[Call]", "[Bid: 1, 3]", "[Call]"]

    def play(seed: int) -> TextArenaEnv:
        env = TextArenaEnv(game="LiarsDice-v0-train", num_players=3)
        env.reset(seed)
        return env

    def observe(env: TextArenaEnv, move: str) -> list[str]:
        if not env.active_agents:
            return []
        (player,) = env.active_agents
        return sorted(o.obs for o in env.step({player: move}).values())

    def alone(seed: int) -> list[list[str]]:
        env = play(seed)
        return [observe(env, m) for m in moves]

    def interleaved() -> tuple[list[list[str]], list[list[str]]]:
        a, b = play(1), play(2)
        seen_a, seen_b = [], []
        for move in moves:
            seen_b.append(observe(b, move))
            seen_a.append(observe(a, move))
        return seen_a, seen_b

    expected = alone(1), alone(2)
    assert interleaved() == expected
    monkeypatch.setattr(TextArenaEnv, "_own_random", lambda self: contextlib.nullcontext())
    assert interleaved() != expected  # the swap is what keeps them apart


def test_bad_games_name_what_is_wrong() -> None:
    with pytest.raises(ValueError, match=r"'TicTacToe-v9' is not a TextArena env id; close"):
        TextArenaEnv(game="TicTacToe-v9")
    with pytest.raises(ValueError, match="num_players=3: The number of players has to be 2"):
        TextArenaEnv(game="TicTacToe-v0", num_players=3).reset(0)


def _rollouts(config, tiny_model, tiny_tokenizer, seeds=range(2)):
    client = TransformersChatClient(tiny_model, tiny_tokenizer)
    engine = make_engine(config, client, HFChatTemplate(tiny_tokenizer))
    requests = make_requests(config, list(seeds), sampling_spec(config))
    return asyncio.run(engine.generate_rollouts(requests))


def test_self_play_from_one_policy_gives_each_player_its_own_groups(
    tiny_model, tiny_tokenizer
) -> None:
    """Three players of one policy: every player's rollouts, grouped by player."""
    config = load_config(
        None,
        [*SELF_PLAY, "env.kwargs={game: LiarsDice-v0-train, num_players: 3}"],
    )
    rollouts = _rollouts(config, tiny_model, tiny_tokenizer, seeds=[0, 0, 1, 1])
    players = sorted({r.meta["agent_id"] for r in rollouts})
    assert players == ["player_0", "player_1", "player_2"] and len(rollouts) == 12
    for r in rollouts:
        r.meta["group_id"] = r.meta["env_seed"]  # a group per problem, as GRPO samples
    keys = {rollout_group_key(r) for r in rollouts}
    assert len(keys) == 2 * 3  # two problems x three players: never one group across players
    weights = GroupNormalizedReturn(group_size=2).compute(rollouts)  # 6 groups of 2
    assert len(weights) == 12


def test_a_word_game_runs_offline_with_a_local_word_list(
    tmp_path, monkeypatch, tiny_model, tiny_tokenizer
) -> None:
    nltk = pytest.importorskip("nltk")
    words = tmp_path / "corpora" / "words"
    words.mkdir(parents=True)
    for name in ("en", "en-basic"):
        (words / name).write_text("cat\ntiger\nrat\ntoad\ndog\ngoat\n")
    monkeypatch.setattr(nltk.data, "path", [str(tmp_path), *nltk.data.path])
    config = load_config(None, [*SELF_PLAY, "env.kwargs={game: WordChains-v0-train}"])
    rollouts = _rollouts(config, tiny_model, tiny_tokenizer, seeds=[0])
    assert sorted(r.meta["agent_id"] for r in rollouts) == ["player_0", "player_1"]
    assert "Word Chains" in rollouts[0].meta["initial_obs"]


def test_self_play_trains_from_the_command_config(tmp_path: Path) -> None:
    run_dir = jobs.train(
        load_config(
            None,
            [f"output_dir={tmp_path}", *SELF_PLAY, "trainer.steps=2", "logging.console_every=1"],
        )
    )
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["phase"] == "rl"] == [1, 2]
    samples = (run_dir / "samples.jsonl").read_text()
    assert "You are Player 0 in Tic Tac Toe" in samples
