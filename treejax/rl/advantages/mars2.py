r"""MARS²'s path-level group advantage with tree-consistent reward shaping (estimator ``"mars2"``).

Li et al. 2026, *MARS²: Scaling Multi-Agent Tree Search via Reinforcement Learning for Code Generation*,
arXiv 2604.14564; official code ``TsinghuaC3I/MARTI`` (``marti/agent_workflows/ab_mcts_processor.py``,
``tree_reward_shaping_unified``; ``examples/mars2/run_train_multi_mcts.sh``: ``--advantage_estimator group_norm``).
In the paper several agents (separate models) expand one search tree; every tree node is one agent's whole answer,
conditioned on the path above it, and is one training sample of the agent that wrote it.

Here a node is one segment of treejax's rollout tree (node 0 is the prompt), so a node ``n`` at depth ``d >= 1``
stands for the *path* root -> ``n``, the node's segment being its own action. For one prompt, with leaf rewards
``R_w`` and leaf weights ``omega_w`` (``Forest.leaf_weight``; 1 for a sample that counts leaves equally):

1. **Node reward** (the official code scores each node's own answer; a segment has no answer of its own, so its
   reward is its Monte-Carlo value, *reconstructed*)::

       V(n) = sum_{w through n} omega_w R_w / sum_{w through n} omega_w

2. **Tree-consistent shaping** (official ``tree_reward_shaping_unified``, read): with ``p`` = n's parent and
   ``S(n)`` = n's siblings (the other children of ``p``), the baseline

       b(n) = (1 - lam) V(p) + lam * mean_{s in S(n)} V(s)     parent a generated node (d >= 2) and S(n) non-empty
       b(n) = V(p)                                             no sibling
       b(n) = mean_{s in S(n)} V(s)                            d = 1 (the parent is the prompt, as the official
                                                               code's root children, which have no parent reward)
       r~(n) = V(n) + gamma (V(n) - b(n))                      (r~(n) = V(n) when n has neither)

   The sibling mean is leave-one-out and unweighted (each alternative child counts once), as the official code.
   The official loop updates rewards in place, so a parent read after its own shaping contributes its *shaped*
   reward, depending on the order nodes are listed in; here every baseline reads the unshaped ``V`` (order-free).

3. **Path-level group advantage** (the official ``group_norm``: each agent's samples of a prompt are one group): the
   group ``G`` is the prompt's generated nodes (``group="tree"``) or those written by one agent
   (``group="agent"``), each node weighted by ``u(n) = M(n) = sum_{w through n} omega_w / sum_w omega_w`` (its
   share of the prompt's sample, ``node_weight="mass"``, the unbiased-tree rule) or ``u(n) = 1`` (every node one
   sample, the official code, ``node_weight="uniform"``)::

       mu_G = sum_{n in G} u(n) r~(n) / sum_G u,   sigma_G^2 = sum_G u (r~ - mu_G)^2 / sum_G u   (population)
       A(n) = (r~(n) - mu_G) / (sigma_G + eps)      (``scale=False``: r~(n) - mu_G)

   Every token of node ``n``'s segment takes ``A(n)``, on every leaf through it (``segments[p, w, k]`` is ``A`` of
   the node at depth ``k + 1`` on leaf ``w``'s path), so a shared segment gets one advantage in both layouts.

**Agents** (:func:`node_agents`): ``agents = K`` labels every generated node with the agent that wrote it, by a
fixed rule decided before any token is drawn: ``assignment="depth"`` -- agent ``(d - 1) mod K`` writes every
depth-``d`` segment (agents take turns along each path, as a refine chain); ``assignment="branch"`` -- agent
``i mod K`` writes the whole subtree of the prompt's ``i``-th first segment (each agent holds its own branches of
the one tree). :func:`agent_token_masks` gives each agent's ``[P, W, T]`` token mask (the tokens it wrote).

What is built and what is not: the labels change the advantage only through ``group="agent"`` (per-agent
groups). **The rollout and the update run one policy**: every token's behaviour log-prob and gradient come from
the run's one set of weights (one LoRA adapter under ``RunConfig.lora``, or the full model); K adapters over one
base, a sampler that decodes each agent's segments with its own adapter, and an update that sends each agent's
masked loss to its own adapter are not built. The paper's agent-responsive Thompson sampling over (agent, node)
pairs (its AB-MCTS expansion) is not built either; the tree is treejax's segment tree.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from treejax.errors import ConfigError
from treejax.forest import Forest
from treejax.rl.advantages.common import broadcast_segments, check_rewards
from treejax.rl.advantages.nodes import gather_path_values
from treejax.rl.advantages.registry import Advantages, register_estimator

#: ``MARS2Options.assignment`` values: which agent writes a node.
ASSIGNMENTS = ("depth", "branch")
#: ``MARS2Options.group`` values: the group a node's advantage is normalised in.
GROUPS = ("tree", "agent")
#: ``MARS2Options.node_weight`` values: a node's weight in its group's mean and std.
NODE_WEIGHTS = ("mass", "uniform")


@dataclasses.dataclass(frozen=True)
class MARS2Options:
    """``gamma`` / ``lam``: the shaping's strength and its sibling share (the official allocation's defaults,
    ``alpha = beta = 0.5``); ``agents``, ``assignment``: the node labels (module docstring); ``group``: normalise
    over the tree's nodes or over each agent's; ``node_weight``: ``"mass"`` or ``"uniform"``; ``scale`` / ``eps``:
    divide by ``std + eps``."""

    gamma: float = 0.5
    lam: float = 0.5
    agents: int = 1
    assignment: str = "depth"
    group: str = "tree"
    node_weight: str = "mass"
    scale: bool = True
    eps: float = 1e-6

    def __post_init__(self):
        for name, value, choices in (("assignment", self.assignment, ASSIGNMENTS), ("group", self.group, GROUPS),
                                     ("node_weight", self.node_weight, NODE_WEIGHTS)):
            if value not in choices:
                raise ConfigError(f"MARS2Options.{name} must be one of {choices}, got {value!r}; fix: "
                                  f"MARS2Options.{name} = {choices[0]!r}")
        if not (isinstance(self.agents, int) and self.agents >= 1):
            raise ConfigError(f"MARS2Options.agents must be an int >= 1, got {self.agents!r}; fix: "
                              "MARS2Options.agents = 2")
        if not 0.0 <= self.lam <= 1.0:
            raise ConfigError(f"MARS2Options.lam mixes the parent and sibling baselines and must lie in [0, 1], got "
                              f"{self.lam!r}; fix: MARS2Options.lam = 0.5")
        if not self.gamma >= 0.0:
            raise ConfigError(f"MARS2Options.gamma must be >= 0 (0: no shaping), got {self.gamma!r}; fix: "
                              "MARS2Options.gamma = 0.5")
        if not self.eps > 0.0:
            raise ConfigError(f"MARS2Options.eps must be > 0, got {self.eps!r}; fix: MARS2Options.eps = 1e-6")
        if self.group == "agent" and self.agents == 1:
            raise ConfigError("MARS2Options.group = 'agent' with agents = 1 is the one group of group = 'tree'; "
                              "fix: MARS2Options.agents = 2 (or group = 'tree')")

    def check_run(self, cfg) -> None:
        """Every agent writes some node of every tree: ``branch`` needs ``K`` first segments, ``depth`` ``K``
        levels (a run-level check, called by ``RunConfig``)."""
        tc = cfg.rollout
        roots = tc.init_divergence or tc.branch_factor
        if self.assignment == "branch" and roots < self.agents:
            raise ConfigError(f"MARS2Options.assignment = 'branch' gives agent i the i-th first segment, but the tree "
                              f"starts {roots} of them for {self.agents} agents; fix: TreeConfig.init_divergence = "
                              f"{self.agents} (or more)")
        if self.assignment == "depth" and tc.max_depth < self.agents:
            raise ConfigError(f"MARS2Options.assignment = 'depth' gives agent k the depth-(k+1) segments, but the tree "
                              f"has {tc.max_depth} levels for {self.agents} agents; fix: TreeConfig.max_depth = "
                              f"{self.agents} (or more)")


def _node_tables(leaf_path_WxD1: jax.Array, x_W: jax.Array, omega_W: jax.Array, num_nodes: int):
    """Per node id: ``sum omega`` and ``sum omega x`` over the leaves through it, and its depth-1 ancestor."""
    idx = jnp.where(leaf_path_WxD1 >= 0, leaf_path_WxD1, num_nodes)
    om = jnp.broadcast_to(omega_W[:, None], idx.shape)
    mass = jnp.zeros((num_nodes,), jnp.float32).at[idx].add(om, mode="drop")
    total = jnp.zeros((num_nodes,), jnp.float32).at[idx].add(om * x_W[:, None], mode="drop")
    first = jnp.broadcast_to(leaf_path_WxD1[:, 1:2], idx.shape)
    anc1 = jnp.full((num_nodes,), -1, jnp.int32).at[idx].set(first.astype(jnp.int32), mode="drop")
    return mass, total, anc1


def node_agents(node_parent_N: jax.Array, node_depth_N: jax.Array, anc1_N: jax.Array, agents: int,
                assignment: str) -> jax.Array:
    """int32[N]: the agent that writes each node (``-1`` for the prompt and unused ids). ``depth``: ``(d - 1) mod
    K``; ``branch``: ``i mod K`` for the subtree of the prompt's ``i``-th first segment (by node id)."""
    gen = node_depth_N >= 1
    if assignment == "depth":
        agent = (node_depth_N - 1) % agents
    else:
        first = (node_depth_N == 1) & (node_parent_N >= 0)
        ids = jnp.arange(node_depth_N.shape[0])
        rank = jnp.sum(first[None, :] & (ids[None, :] < ids[:, None]), axis=-1)  # [n]: first segments before n
        agent = rank[jnp.clip(anc1_N, 0, None)] % agents
    return jnp.where(gen & (anc1_N >= 0), agent, -1).astype(jnp.int32)


def shaped_rewards(v_N: jax.Array, used_N: jax.Array, node_parent_N: jax.Array, node_depth_N: jax.Array,
                   gamma: float, lam: float) -> jax.Array:
    """[N] ``r~(n) = V(n) + gamma (V(n) - b(n))`` (module docstring, step 2) over the generated nodes; 0 elsewhere."""
    n = v_N.shape[0]
    gen = used_N & (node_depth_N >= 1)
    par = jnp.where(gen, node_parent_N, n)
    kids = jnp.zeros((n,), jnp.float32).at[par].add(1.0, mode="drop")
    kid_sum = jnp.zeros((n,), jnp.float32).at[par].add(jnp.where(gen, v_N, 0.0), mode="drop")
    p = jnp.clip(node_parent_N, 0, n - 1)
    sibs = kids[p] - 1.0
    sib_mean = (kid_sum[p] - v_N) / jnp.maximum(sibs, 1.0)
    has_sib, has_par = sibs >= 1.0, node_depth_N >= 2
    v_par = v_N[p]
    baseline = jnp.where(has_par & has_sib, (1.0 - lam) * v_par + lam * sib_mean,
                         jnp.where(has_par, v_par, sib_mean))
    shaped = v_N + gamma * jnp.where(has_par | has_sib, v_N - baseline, 0.0)
    return jnp.where(gen, shaped, 0.0)


def group_normalize_nodes(x_N: jax.Array, u_N: jax.Array, group_N: jax.Array, groups: int, scale: bool,
                          eps: float) -> jax.Array:
    """[N] ``(x - mu_g) / (sigma_g + eps)`` with weighted mean and population std over each group ``g``
    (``group_N = -1``: in no group, 0)."""
    onehot = (group_N[None, :] == jnp.arange(groups)[:, None]).astype(jnp.float32) * u_N[None, :]  # [G, N]
    wsum = jnp.maximum(jnp.sum(onehot, axis=-1), 1e-30)
    mu = jnp.sum(onehot * x_N[None, :], axis=-1) / wsum
    var = jnp.sum(onehot * (x_N[None, :] - mu[:, None]) ** 2, axis=-1) / wsum
    g = jnp.clip(group_N, 0, groups - 1)
    out = x_N - mu[g]
    if scale:
        out = out / (jnp.sqrt(var[g]) + eps)
    return jnp.where(group_N >= 0, out, 0.0)


def mars2_core(leaf_path_WxD1, rewards_W, omega_W, node_parent_N, node_depth_N, options: MARS2Options):
    """One prompt: ``(A(n) [N], agent(n) [N])`` (module docstring). Values are deviations from the first leaf's
    reward (the advantage is shift-free), so a prompt whose rewards are all equal gets exactly 0."""
    num_nodes = node_parent_N.shape[0]
    x_W = rewards_W - rewards_W[0]
    mass_N, total_N, anc1_N = _node_tables(leaf_path_WxD1, x_W, omega_W, num_nodes)
    used_N = mass_N > 0
    v_N = jnp.where(used_N, total_N / jnp.where(used_N, mass_N, 1.0), 0.0)
    shaped_N = shaped_rewards(v_N, used_N, node_parent_N, node_depth_N, options.gamma, options.lam)
    agent_N = jnp.where(used_N, node_agents(node_parent_N, node_depth_N, anc1_N, options.agents,
                                            options.assignment), -1)
    if options.node_weight == "mass":
        u_N = mass_N / jnp.maximum(jnp.sum(omega_W), 1e-30)
    else:
        u_N = used_N.astype(jnp.float32)
    if options.group == "agent":
        group_N, groups = agent_N, options.agents
    else:
        group_N, groups = jnp.where(agent_N >= 0, 0, -1), 1
    return group_normalize_nodes(shaped_N, u_N, group_N, groups, options.scale, options.eps), agent_N


def agent_token_masks(forest: Forest, options: MARS2Options) -> jax.Array:
    """float32[K, P, W, T]: ``loss_mask`` times "agent k wrote this token" (the node holding it is agent k's)."""
    def per_prompt(path, r, om, parent, depth):
        return mars2_core(path, r, om, parent, depth, options)[1]

    zeros = jnp.zeros(forest.leaf_path.shape[:2], jnp.float32)
    agent_PxN = jax.vmap(per_prompt)(forest.leaf_path, zeros, forest.leaf_weights(), forest.node_parent,
                                     forest.node_depth)
    node = forest.token_nodes()
    tok_agent = jnp.take_along_axis(agent_PxN[:, None, :], jnp.clip(node, 0, None), axis=-1)
    tok_agent = jnp.where(node >= 0, tok_agent, -1)
    ks = jnp.arange(options.agents)[:, None, None, None]
    return jnp.where(tok_agent[None] == ks, forest.loss_mask[None], 0.0).astype(jnp.float32)


@register_estimator("mars2", MARS2Options)
def mars2(forest: Forest, rewards_PxW: jax.Array, options: MARS2Options = MARS2Options()) -> Advantages:
    r"""MARS²'s path-level group advantage (module docstring: node values, tree-consistent shaping
    ``r~(n) = V(n) + gamma (V(n) - b(n))``, ``A(n) = (r~(n) - mu_G) / (sigma_G + eps)`` over the prompt's nodes or
    one agent's). ``segments[p, w, k]`` = A of the depth-``k+1`` node on leaf ``w``'s path; tokens take their
    segment's value. No batch whitening (the group normalisation is the official ``group_norm``).

    >>> import numpy as np
    >>> from treejax.forest import forest_from_paths
    >>> paths = np.array([[[0, 1, 3], [0, 1, 4], [0, 2, 5]]])      # node 1 splits in two, node 2 does not
    >>> f = forest_from_paths(paths, np.array([[2, 2, 2]]), 1)
    >>> a = mars2(f, np.array([[1.0, 0.0, 0.0]]), MARS2Options(node_weight="uniform"))
    >>> print(np.round(np.asarray(a.segments), 4))
    [[[ 0.6774  1.6183]
      [ 0.6774 -1.0162]
      [-0.828  -0.4516]]]
    """
    r = check_rewards(forest, rewards_PxW)

    def per_prompt(path, x, om, parent, depth):
        adv_N = mars2_core(path, x, om, parent, depth, options)[0]
        return gather_path_values(adv_N, path)[:, 1:]

    seg = jax.vmap(per_prompt)(forest.leaf_path, r, forest.leaf_weights(), forest.node_parent, forest.node_depth)
    tokens = broadcast_segments(seg, forest.segment_index, forest.loss_mask)
    return Advantages(tokens=tokens, loss_mask=forest.loss_mask, segments=seg)
