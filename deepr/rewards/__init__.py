"""Every reward of the papers, as pure functions shared by `deepr grpo` and `deepr eval`.

- :mod:`~deepr.rewards.plan_reward`: DecomposeR planner reward R_plan (000 Eq. 17–24)
- :mod:`~deepr.rewards.answer_reward`: DecomposeR answerer reward R_ans (000 Eq. 25–31)
- :mod:`~deepr.rewards.rubric_reward`: DeepRubric composite, R_format, R_search, R_cite, R_fmt (002)
- :mod:`~deepr.rewards.decor`: EM / F1 / LJ, R_team, R_total, role-wise advantages (001)
- :mod:`~deepr.rewards.agentcpm`: outline / paragraph / terminate atomic rewards (003)
- :mod:`~deepr.rewards.race`, :mod:`~deepr.rewards.fact`: benchmark-style report scoring
- :mod:`~deepr.rewards.judges`: LLM judges with our prompts, and their extractive twins
- :mod:`~deepr.rewards.trl_adapters`: the same rewards with TRL's reward-function signature

Embeddings are passed in (``embed(list[str]) -> L2-normalised rows``), e.g.
``deepr.corpus.embed.get_embedder().encode``.
"""

from deepr.rewards.answer_reward import AnswerReward, answer_terms, score_answer
from deepr.rewards.decor import exact_match, f1_score, r_team, r_total, role_advantages
from deepr.rewards.judges import Judge, JudgeCache, RewardInputError, Verdict
from deepr.rewards.plan_reward import PlanReward, plan_reward, plan_rewards
from deepr.rewards.rubric_reward import citation_reward, r_format, r_search, rubric_composite, rubric_score

__all__ = ["AnswerReward", "Judge", "JudgeCache", "PlanReward", "RewardInputError", "Verdict",
           "answer_terms", "citation_reward", "exact_match", "f1_score", "plan_reward", "plan_rewards",
           "r_format", "r_search", "r_team", "r_total", "role_advantages", "rubric_composite",
           "rubric_score", "score_answer"]
