"""Shapers: per-token advantage and clip-range rewrites that read the trainer's own forward (one file per method).

Interface and registry: :mod:`treejax.rl.shaping.base`. A new shaper is one file with a ``@register("name")``
frozen dataclass subclassing :class:`Shaper` plus its import line below (gin then knows it by its class name:
``RunConfig.shapers = [@EchoShaping()]``). Applied by :func:`treejax.rl.shaping.apply.apply_shapers` in order.

  ``echo``         :class:`EchoShaping`                ECHO: entropy-confidence shaping, adaptive per-sample clip;
  ``ear``          :class:`EntropyAdvantageReshaping`  ETTRL's EAR: scale by the group-relative response entropy;
  ``rose_length``  :class:`RoseLengthPenalty`          ROSE: correct answers longer than the shortest lose advantage;
  ``prl``          :class:`ProcessRewardShaping`       PRL: per-step KL-to-go correction of the outcome advantage;
  ``verl_rank``    :class:`EffectiveRankBonus`         VERL: effective rank / velocity / acceleration bonus (stateful);
  ``arrol_head``   :class:`QualityHead`                ARRoL: online success probe on hidden states (stateful; feeds
                                                       the ``arrol`` pruning rule);
  ``spa_rl``       :class:`SPARLShaping`               SPA-RL: a progress head trained so step contributions sum to
                                                       the outcome; they become step advantages (stateful);
  ``oprl``         :class:`OPRLShaping`                OPRL: an implicit reward head trained by trajectory DPO; its
                                                       step rewards are added as step advantages (stateful);
  ``dart_entropy`` :class:`DARTEntropyMask`            DART: only the top-rho highest-entropy steps (or tokens) stay
                                                       in the loss (``Shaped.keep``);
  ``r3l_amplify``  :class:`PositiveAmplification`      R3L: correct leaves' advantages times a factor;
  ``prm_steps``    :class:`PRMStepReward`              a PRM's step scores (the ``PRMStepsConfig`` stage), normalised,
                                                       added as a per-step term to any estimator's advantages.
"""

from treejax.rl.shaping.base import (SHAPERS, STATS, Shaped, Shaper, ShapingInputs, check_shapers, init_states,
                                     needed_stats, probes, register, shaper_classes)
from treejax.rl.shaping.echo import EchoShaping
from treejax.rl.shaping.entropy import EntropyAdvantageReshaping
from treejax.rl.shaping.length import RoseLengthPenalty
from treejax.rl.shaping.process import ProcessRewardShaping
from treejax.rl.shaping.effrank import EffectiveRankBonus
from treejax.rl.shaping.quality import QualityHead
from treejax.rl.shaping.spa import SPARLShaping
from treejax.rl.shaping.oprl import OPRLShaping
from treejax.rl.shaping.dart import DARTEntropyMask
from treejax.rl.shaping.r3l import PositiveAmplification
from treejax.rl.shaping.prm import PRMStepReward
from treejax.rl.shaping.apply import apply_shapers, shaping_inputs

__all__ = ["SHAPERS", "STATS", "Shaped", "Shaper", "ShapingInputs", "check_shapers", "init_states", "needed_stats",
           "probes",
           "register", "shaper_classes", "EchoShaping", "EntropyAdvantageReshaping", "RoseLengthPenalty",
           "ProcessRewardShaping", "EffectiveRankBonus", "QualityHead", "SPARLShaping", "OPRLShaping", "DARTEntropyMask", "PositiveAmplification", "PRMStepReward", "apply_shapers", "shaping_inputs"]
