"""Asynchronous rollouts' settings (:class:`AsyncConfig`; the runtime is :mod:`treejax.rl.collect`)."""

from __future__ import annotations

import dataclasses

from treejax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class AsyncConfig:
    """Asynchronous rollouts (:mod:`treejax.rl.collect`): a sampler thread fills a queue of rollouts while the
    learner trains on earlier ones.

    ``enabled``: off (default) runs today's synchronous loop. ``max_staleness`` ``k``: the rollouts learned at
    step ``i`` were sampled by policy version ``max(0, i - k)`` (the version after that many updates), so the
    sampler runs up to ``k`` steps ahead; the bound is used as the lag (the schedule is fixed, hence a run is
    reproducible and resumes exactly; it is also the fastest one the bound allows). ``k = 0`` samples every step
    with the newest weights: the synchronous loop's numbers, bit for bit. ``sampler_devices``: the first ``n``
    devices sample and the rest learn (``RunConfig.mesh`` then describes the learner's devices; the sampler's mesh
    keeps ``MeshConfig.tensor`` and puts the rest on ``fsdp``), weights cast to the sampler dtype and copied
    learner -> sampler after every update; ``0``: both share every device (one device only: programs of two
    threads on a multi-device mesh could interleave their collectives differently on different devices).
    ``split_staleness``: also compute the trainer's log-probs under the parameters that sampled each rollout
    (one more forward per step; the learner keeps up to ``k + 1`` parameter versions), splitting the importance
    weight into a staleness and a numerics part (``offpolicy/stale_iw_...``, ``mismatch/numerics_...``).
    The correction is decoupled PPO (AReaL): the PPO ratio is taken against the trainer's recomputed log-probs
    (``old_logp = "trainer"``, the proximal policy) and ``LossConfig.tis_cap`` weights each token by
    ``min(pi_prox / q, C)``, ``q`` the sampler's recorded log-probs of the stale policy."""

    enabled: bool = False
    max_staleness: int = 1
    sampler_devices: int = 0
    split_staleness: bool = False

    def __post_init__(self):
        for name in ("max_staleness", "sampler_devices"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ConfigError(f"AsyncConfig.{name} must be an int >= 0, got {v!r}")


class OffPolicyWarning(UserWarning):
    """Stale rollouts are trained without the behaviour importance weight (``RunConfig._check_async``)."""
