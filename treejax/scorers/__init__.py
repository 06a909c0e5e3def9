"""Scorer models: a second model in the RL loop (issue 47), read as a judge or a process reward model.

* :mod:`treejax.scorers.config`: :class:`ScorerConfig`, the gin-facing settings (which model, its compute dtype,
  the prompt template, the verdict tokens, the batch size, the verdict mode);
* :mod:`treejax.scorers.model`: :func:`load_scorer` -> :class:`Scorer` through the policy's own loader
  (:func:`treejax.models.registry.load_model`): an embedded name, an HF folder, a GGUF file, or ``"policy"``
  (a frozen copy of the policy's initial weights: ``RunConfig.model`` loaded again);
* :mod:`treejax.scorers.verdicts`: the verdict tokens' ids and the regex parser of a decoded verdict;
* :mod:`treejax.scorers.judge`: the judge's score of (question, response) pairs, by verdict-token log-probs in one
  teacher-forced forward (no decoding) or by decoding a verdict with the sampler and parsing it;
* :mod:`treejax.scorers.prm`: per-step scores of a response in one teacher-forced pass (a step tag after each
  step; the verdict probability at each tag).
* :mod:`treejax.scorers.trainable`: a trainable scorer (a head with its own optax state, ``scorer_update(state,
  batch) -> (state, metrics)``), trained alternately with the policy; SPA-RL's progress head
  (:mod:`treejax.rl.shaping.spa` trains it in a run).

The rollout stages that turn scores into rewards (FAPO, SSL) are in :mod:`treejax.rl.judges`; the shaper that
trains a scorer and turns it into step advantages (SPA-RL) in :mod:`treejax.rl.shaping.spa`. Nothing here imports
:mod:`treejax.rl`."""

from treejax.scorers.config import ScorerConfig

__all__ = ["ScorerConfig"]
