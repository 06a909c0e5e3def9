"""SAPO: Swarm sAmpling Policy Optimization (Gensyn AI Team, "Sharing is Caring: Efficient LM Post-Training with
Collective RL Experience Sharing", arXiv 2509.08721; code ``gensyn-ai/rl-swarm``), as a wrapper stage.

A swarm of ``N`` nodes; node ``n`` has its own policy ``pi_n``, its own prompts and its own training (no weight or
gradient synchronisation). Each round (RL step ``s``) node ``n``:

1. samples its batch of prompts and rolls each out into a group of ``W`` responses (the chain before this stage:
   ``I = RunConfig.prompts_per_step`` local prompt rows ``L_n``);
2. publishes ``L_n`` to the swarm: each row's prompt tokens, response tokens, lengths, rewards and verifier scores,
   the task example (question and ground truth) and the tree row;
3. builds its training batch ``B_n = L_n  u  E_n``, where ``E_n`` is ``J = external_rows`` rows drawn from the
   union of the other nodes' rows of round ``s``, ``U_s = u_{m != n} L_m``:
   ``sampling = "uniform"``: ``J`` rows uniformly without replacement from ``U_s``;
   ``sampling = "informative"``: the same from ``{g in U_s : not all r_gw equal}``, i.e. the groups whose
   group-relative advantage ``A_gw = r_gw - mean_w r_gw`` is not zero for every leaf (the paper's filter of
   zero-advantage rollouts before sampling);
   with fewer than ``J`` candidates, every candidate is taken and the rest of ``E_n`` are copies of local row 0
   with ``loss_mask = 0`` (they train on nothing; ``sapo/filler_rows``);
4. trains on ``B_n`` with the run's estimator and loss (GRPO in the paper): each row is its own group.

External rows are treated as the node's own rollouts (the paper: they enter the policy-gradient update like the
local ones). Their tokens are re-scored under the local policy: the sampler log-probs ``log q`` of an external
response are replaced by ``log pi_n^old(y_t | x, y_<t)`` (teacher forcing through this node's sampler,
:func:`treejax.sampling.decode.score_tokens`), so the PPO ratio's denominator is the local policy's old log-prob
(with ``old_logp = "trainer"`` the trainer recomputes it under the same parameters; with ``"sampler"`` it is the
re-scored value) and truncated importance sampling, if set, weighs them about 1. The sender's policy is not
corrected for: an external row is an on-policy-*ish* sample of ``pi_n``, as in the paper.
``sapo/external_logp_shift``: mean ``|log q_sender - log pi_n|`` over the external rows' response tokens, how far
that is from true (0 when both nodes hold the same weights).

**The swarm in treejax**: the processes of one ``jax.distributed`` job (``python -m treejax.launch
--num_processes N``). The stage is ``process_local`` (:class:`~treejax.rl.sources.base.Stage`): each process
builds its learner and sampler on its own devices and draws its own prompt stream (seed ``RunConfig.seed +
process index``); its rollout key is also folded with the process index. The exchange is host-side, through the
job's distributed key-value store (``jax.distributed``'s coordination service): node ``n`` sets
``treejax/sapo/<step>/<n>`` to its rows (pickled, zlib-compressed bytes) and blocks (``timeout_s``) on every
other node's key of the same step, then deletes its own key of step ``s - 2`` (every peer has read it: a peer's
round ``s - 1`` key, which ``n`` just read, is set after that peer's round ``s - 2`` reads). Why the key-value
store rather than ``multihost_utils.process_allgather``: it carries variable-size bytes (the task examples with
their ground truth, for re-scoring and pictures) without padding to a common shape, runs no XLA computation over
the global devices (none exists in a process-local run) and is the closest thing in a JAX job to the paper's
peer-to-peer sharing (rl-swarm publishes rollouts to a DHT). It works on CPU processes (no gloo needed for it).

Checks: a single-process run is refused (``ConfigError``: there is no swarm to share with); checkpoints are
refused (orbax saves one global state with every process; a swarm has one state per process): ``RunConfig.
checkpoint_every = 0`` and ``save_final = False``. Process 0 writes the event files and ``summary.json`` of
*its* node only (the other nodes' metrics are not logged). Requires verifier rewards and synchronous rollouts.

Metrics: ``sapo/external_rows`` (real external rows trained on), ``sapo/filler_rows``, ``sapo/pool_rows`` (rows
the other nodes shared this round), ``sapo/pool_informative_rows``, ``sapo/external_reward_mean``,
``sapo/external_accuracy`` (mean verifier score of the external leaves), ``sapo/local_reward_mean``,
``sapo/external_logp_shift``, ``sapo/exchange_s``.

**Reconstructed** (not stated in what we could read of the paper, or adapted to treejax): the unit of I and J
(here a prompt row with its whole group of ``W`` leaves: GRPO's advantage needs the group); ``I`` is every local
row (a node trains on all it decodes; choose ``I`` with ``RunConfig.prompts_per_step``); each node shares all its
rows; the rewards of an external row are the sender's verifier rewards, not recomputed (one task and one
verifier per job, so the receiver's reward model would give the same rewards); tokens are shared instead of text
(every node loads the same model and tokenizer, so re-tokenising decoded text would give the same ids; a
different vocabulary or shape is refused); the filler rows; the rounds are synchronous (the paper's nodes are
asynchronous and may use whatever was shared most recently).
"""

from __future__ import annotations

import dataclasses
import pickle
import time
import zlib
from typing import Callable, ClassVar

import jax
import numpy as np

from treejax.errors import ConfigError
from treejax.rl.replay import _host_rows, _Row, append_rows
from treejax.rl.sources.base import Stage
from treejax.rl.sources.requirements import SYNCHRONOUS, VERIFIER

#: How the ``J`` external rows are drawn (module docstring, step 3).
SAMPLING_RULES = ("uniform", "informative")


@dataclasses.dataclass(frozen=True)
class SAPOConfig(Stage):
    """SAPO's rollout sharing (module docstring): ``external_rows`` (``J``) rows from the other processes per step,
    drawn by ``sampling`` (``"uniform"`` or ``"informative"``: zero-advantage groups dropped first) with ``seed``;
    ``timeout_s``: how long a node waits for the others' rows of a step."""

    external_rows: int = 4
    sampling: str = "informative"
    seed: int = 0
    timeout_s: int = 600

    role: ClassVar[str] = "wrapper"  # shares the rows of the source before it and adds the swarm's
    requires: ClassVar[tuple] = (VERIFIER, SYNCHRONOUS)
    needs: ClassVar[frozenset[str]] = frozenset({"replayable_rows"})
    keeps: ClassVar[frozenset[str]] = frozenset()
    passes_inputs: ClassVar[bool] = False  # an external row carries no estimator inputs
    process_local: ClassVar[bool] = True

    def __post_init__(self):
        if isinstance(self.external_rows, bool) or not isinstance(self.external_rows, int) or self.external_rows < 1:
            raise ConfigError(f"SAPOConfig.external_rows must be an int >= 1 (J, rows from the swarm per step), got "
                              f"{self.external_rows!r}; fix: SAPOConfig.external_rows = 4")
        if self.sampling not in SAMPLING_RULES:
            raise ConfigError(f"SAPOConfig.sampling must be one of {SAMPLING_RULES}, got {self.sampling!r}; fix: "
                              "SAPOConfig.sampling = 'informative'")
        if self.timeout_s < 1:
            raise ConfigError(f"SAPOConfig.timeout_s must be >= 1, got {self.timeout_s}")

    def added_rows(self) -> int:
        return self.external_rows

    def check(self, facts) -> None:
        if facts.saves_checkpoints:
            raise ConfigError("SAPOConfig: every process trains its own policy, and orbax checkpoints save one global "
                              "state; fix: RunConfig.checkpoint_every = 0 and RunConfig.save_final = False")

    def build(self, inner, ctx):
        if jax.process_count() < 2:
            raise ConfigError("SAPOConfig shares rollouts between the processes of a multi-process job, and this run "
                              "has one process; fix: python -m treejax.launch --num_processes 2 -- <treejax-train "
                              "arguments>, or drop @SAPOConfig() from RunConfig.rollouts")
        return SAPORollouts(inner, self, ctx.sampler_fns, KVExchange(self.timeout_s))


# ------------------------------------------------------------------------------------ pure batch assembly
def zero_advantage_G(rewards_GxW) -> np.ndarray:
    """bool ``[G]``: the groups whose rewards are all equal (group-relative advantage 0 on every leaf)."""
    r = np.asarray(rewards_GxW)
    return np.all(r == r[:, :1], axis=1)


def choose_external(rewards_GxW, num: int, rule: str, seed: int, step: int, process: int) -> np.ndarray:
    """int ``[<= num]``: the pool rows (of ``G``, rewards ``[G, W]``) a node trains on: the candidates (all rows,
    or with ``rule = "informative"`` the rows with a non-zero advantage) drawn uniformly without replacement,
    ``min(num, candidates)`` of them, by a generator seeded with ``(seed, step, process)``."""
    if rule not in SAMPLING_RULES:
        raise ConfigError(f"SAPO sampling rule {rule!r} is not one of {SAMPLING_RULES}")
    rewards = np.asarray(rewards_GxW)
    candidates = np.arange(rewards.shape[0])
    if rule == "informative" and rewards.shape[0]:
        candidates = candidates[~zero_advantage_G(rewards)]
    rng = np.random.default_rng([seed, step, process])
    take = min(num, candidates.size)
    return np.sort(rng.choice(candidates, size=take, replace=False)) if take else np.zeros(0, np.int64)


def pool_of(shared: dict[int, list[_Row]], me: int) -> list[_Row]:
    """The rows the other processes shared, in process order then row order (``me``'s own excluded)."""
    return [r for q in sorted(shared) if q != me for r in shared[q]]


def check_compatible(local: _Row, external: _Row) -> None:
    """A :class:`ConfigError` if an external row's arrays differ in shape from this node's rows (the swarm must run
    one model, tokenizer and tree shape)."""
    mine, theirs = jax.tree.map(np.shape, local.forest), jax.tree.map(np.shape, external.forest)
    if mine != theirs or np.shape(local.prompt) != np.shape(external.prompt):
        raise ConfigError("SAPOConfig: a row shared by another process has other shapes than this process's "
                          f"(forest {theirs} vs {mine}); fix: run every process with the same gin config")


def encode_rows(rows: list[_Row]) -> bytes:
    return zlib.compress(pickle.dumps(rows, protocol=pickle.HIGHEST_PROTOCOL))


def decode_rows(blob: bytes) -> list[_Row]:
    return pickle.loads(zlib.decompress(blob))  # noqa: S301 -- bytes from this job's own processes


# ------------------------------------------------------------------------------------------ the exchange
class KVExchange:
    """One round of sharing through the job's distributed key-value store (module docstring): ``exchange(step,
    blob) -> {process: blob}`` for every other process."""

    def __init__(self, timeout_s: int, prefix: str = "treejax/sapo"):
        self.timeout_ms, self.prefix = int(timeout_s) * 1000, prefix

    def __call__(self, step: int, blob: bytes) -> dict[int, bytes]:
        from jax._src.distributed import global_state  # the coordination service's client (no public handle)

        client = global_state.client
        if client is None:
            raise ConfigError("SAPOConfig needs jax.distributed to be initialised; fix: start the run with "
                              "python -m treejax.launch --num_processes 2 -- ...")
        me, n = jax.process_index(), jax.process_count()
        client.key_value_set_bytes(f"{self.prefix}/{step}/{me}", blob)
        out = {q: client.blocking_key_value_get_bytes(f"{self.prefix}/{step}/{q}", self.timeout_ms)
               for q in range(n) if q != me}
        try:
            client.key_value_delete(f"{self.prefix}/{step - 2}/{me}")
        except Exception:  # noqa: BLE001 -- nothing to delete (the first steps, a resumed run)
            pass
        return out


# ------------------------------------------------------------------------------------------ the source
class SAPORollouts:
    """The loop's source with SAPO's sharing (module docstring). ``base``: a source of ``prompts_per_step`` rows;
    ``exchange(step, bytes) -> {process: bytes}``; ``sampler_fns``: this node's sampler (re-scoring);
    ``score_fn(weights, sampler_fns, prompts, lengths, tokens, token_lengths) -> logp [B, T]`` (default
    :func:`~treejax.sampling.decode.score_tokens`; tests pass a fake); ``process``: default this process's index."""

    def __init__(self, base, config: SAPOConfig, sampler_fns, exchange: Callable, process: int | None = None,
                 score_fn: Callable | None = None):
        self.base, self.config, self.sampler_fns, self.exchange = base, config, sampler_fns, exchange
        self.score_fn = score_fn
        self.process = jax.process_index() if process is None else process
        self.pipeline = base.pipeline
        self.estimator_inputs = ()

    def sample(self, params, key, step):
        cfg = self.config
        fresh = self.base.sample(params, jax.random.fold_in(key, self.process), step)  # each node its own draws
        host = _host_rows(fresh, step)
        t0 = time.perf_counter()
        shared = {q: decode_rows(b) for q, b in self.exchange(step, encode_rows(host)).items()}
        exchange_s = time.perf_counter() - t0
        pool = pool_of(shared, self.process)
        for r in pool:
            check_compatible(host[0], r)
        rewards = np.stack([r.rewards for r in pool]) if pool else np.zeros((0, host[0].rewards.shape[0]))
        idx = choose_external(rewards, cfg.external_rows, cfg.sampling, cfg.seed, step, self.process)
        chosen, shift = self.rescore(params, [pool[i] for i in idx])
        rows = chosen + [host[0]] * (cfg.external_rows - len(chosen))
        return append_rows(fresh, rows, len(chosen), external_metrics(
            host, chosen, rewards, len(pool), cfg.external_rows, shift, exchange_s))

    def rescore(self, params, rows: list[_Row]) -> tuple[list[_Row], float]:
        """``rows`` with their leaves' sampler log-probs replaced by this node's (teacher forcing), and the mean
        absolute change over their response tokens."""
        if not rows:
            return [], 0.0
        from treejax.sampling import probe as probe_lib
        from treejax.sampling.decode import score_tokens

        score = self.score_fn or score_tokens
        W, T = rows[0].forest.tokens.shape
        tokens = np.concatenate([np.asarray(r.forest.tokens) for r in rows])
        n = np.concatenate([np.asarray(r.forest.leaf_length) for r in rows]).astype(np.int32)
        prompts = np.repeat(np.stack([r.prompt for r in rows]), W, axis=0)
        lengths = np.repeat(np.stack([r.length for r in rows]), W, axis=0)
        weights, _ = probe_lib.detach(params)
        lp = np.asarray(score(weights, self.sampler_fns, prompts, lengths, tokens, n)).reshape(len(rows), W, T)
        on = np.arange(T)[None, None] < n.reshape(len(rows), W)[..., None]
        old = np.stack([np.asarray(r.forest.logprobs) for r in rows])
        shift = float(np.abs(old - lp)[on].mean()) if on.any() else 0.0
        new = np.where(on, lp, 0.0).astype(old.dtype)
        return [dataclasses.replace(r, forest=r.forest.replace(logprobs=new[i])) for i, r in enumerate(rows)], shift

    def checkpoint_state(self) -> dict:
        return getattr(self.base, "checkpoint_state", dict)()

    def restore_state(self, data_state: dict) -> None:
        if hasattr(self.base, "restore_state"):
            self.base.restore_state(data_state)


def external_metrics(local: list[_Row], chosen: list[_Row], pool_rewards_GxW, pool_rows: int, wanted: int,
                     shift: float, exchange_s: float) -> dict:
    """The step's ``sapo/...`` metrics (module docstring)."""
    pool = np.asarray(pool_rewards_GxW)
    ext = chosen
    return {"sapo/external_rows": len(ext), "sapo/filler_rows": wanted - len(ext), "sapo/pool_rows": pool_rows,
            "sapo/pool_informative_rows": int((~zero_advantage_G(pool)).sum()) if pool.shape[0] else 0,
            "sapo/external_reward_mean": float(np.mean([r.rewards for r in ext])) if ext else 0.0,
            "sapo/external_accuracy": float(np.mean([np.asarray(r.scores) >= 1.0 for r in ext]))
            if ext and ext[0].scores is not None else 0.0,
            "sapo/local_reward_mean": float(np.mean([r.rewards for r in local])),
            "sapo/external_logp_shift": shift, "sapo/exchange_s": exchange_s}


__all__ = ["SAMPLING_RULES", "KVExchange", "SAPOConfig", "SAPORollouts", "check_compatible", "choose_external",
           "decode_rows", "encode_rows", "external_metrics", "pool_of", "zero_advantage_G"]
