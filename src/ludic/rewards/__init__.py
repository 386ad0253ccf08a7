"""The reward loop (spec 5): reward functions scored per sample, asynchronously.

* :mod:`ludic.rewards.sample`: what a reward function sees (:class:`RewardSample`) and what
  scoring returns (:class:`RewardResult`).
* :mod:`ludic.rewards.functions`: user reward functions with the spec's signature
  ``compute_score(data_source, solution_str, ground_truth, extra_info, **kwargs)``, sync
  or async (detected), loaded from ``path/to/file.py:function`` or ``package.module:function``.
* :mod:`ludic.rewards.rules`: built-in rule rewards chosen by ``data_source`` (GSM8K,
  MATH through ``math-verify``, format).
* :mod:`ludic.rewards.managers`: reward managers by name (``naive``, ``dapo``,
  ``rate_limited``; ``@register("name")`` adds yours).
* :mod:`ludic.rewards.genrm`: an LLM judge through chat completions (``GenRMJudge``,
  ``chat_complete``, ``parse_judgement``).
* :mod:`ludic.rewards.group_judge`: the G completions of one prompt judged together
  (``GroupJudge``: scores or a ranking in one call, in the manner of ART's RULER).
* :mod:`ludic.rewards.hybrid`: a discriminative reward model as a reward function
  (``DisRMScore``) and weighted sums of functions (``WeightedReward``: rule + DisRM + GenRM).
* :mod:`ludic.rewards.loop`: ``RewardLoop``, N workers scoring rollouts as their
  episodes end (standalone) or after the batch (colocate).
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
