"""The reward loop (spec 5, docs/reward-loop.md): reward functions scored per sample, async.

* ``sample``: :class:`RewardSample`, :class:`RewardResult`; ``functions``: user functions
  ``compute_score(data_source, solution_str, ground_truth, extra_info, **kwargs)``, loaded
  from ``file.py:fn`` or ``module:fn``; ``rules``: built-in rules by ``data_source``;
* ``managers``: reward managers by name (``naive``, ``dapo``, ``rate_limited``, yours);
* ``genrm``, ``group_judge``, ``hybrid``: an LLM judge (``GenRMJudge``), a group judge
  (``GroupJudge``), a DisRM (``DisRMScore``) and weighted sums (``WeightedReward``);
* ``loop``: ``RewardLoop``, N workers scoring rollouts as episodes end or after the batch.
"""

from ludic._lazy import lazy_exports

__getattr__, __all__ = lazy_exports(
    __name__,
    globals(),
    {
        "RewardSample": "ludic.rewards.sample",
        "RewardResult": "ludic.rewards.sample",
        "RewardFunctionError": "ludic.rewards.functions",
        "call_reward_function": "ludic.rewards.functions",
        "load_reward_function": "ludic.rewards.functions",
        "default_compute_score": "ludic.rewards.rules",
        "RewardManager": "ludic.rewards.managers",
        "NaiveRewardManager": "ludic.rewards.managers",
        "DAPORewardManager": "ludic.rewards.managers",
        "RateLimitedRewardManager": "ludic.rewards.managers",
        "REWARD_MANAGERS": "ludic.rewards.managers",
        "make_reward_manager": "ludic.rewards.managers",
        "register": "ludic.rewards.managers",
        "overlong_penalty": "ludic.rewards.managers",
        "GenRMJudge": "ludic.rewards.genrm",
        "chat_complete": "ludic.rewards.genrm",
        "parse_judgement": "ludic.rewards.genrm",
        "GroupJudge": "ludic.rewards.group_judge",
        "group_pattern": "ludic.rewards.group_judge",
        "parse_group_judgement": "ludic.rewards.group_judge",
        "GroupScorer": "ludic.rewards.loop",
        "ScoringServers": "ludic.rewards.loop",
        "DisRMScore": "ludic.rewards.hybrid",
        "WeightedReward": "ludic.rewards.hybrid",
        "REWARD_KEY": "ludic.rewards.loop",
        "RewardLoop": "ludic.rewards.loop",
        "RewardLoopError": "ludic.rewards.loop",
        "reward_loop_metrics": "ludic.rewards.loop",
        "rollout_reward_sample": "ludic.rewards.loop",
    },
)
