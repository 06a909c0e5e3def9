"""Rewards from a scorer model (:mod:`treejax.scorers`) as wrapper stages of the rollout chain.

Each method is a wrapper stage (``RunConfig.rollouts = [@FAPOConfig()]``; a chain that starts with a wrapper gets
the task source as its planner): the planner's rollouts are decoded, the judge scores the leaves it needs, and the
rewards the estimator sees are rewritten (:class:`base.JudgedRollouts`); the verifier's ``scores_PxW``, the
forest and everything else pass unchanged. Without such a stage nothing here runs.

* :mod:`.fapo`: FAPO's flawed-positive penalty (arXiv 2510.22543);
* :mod:`.ssl`: SSL's tiered, progressively amplified, order-preserving rewards (a reconstruction).
"""
