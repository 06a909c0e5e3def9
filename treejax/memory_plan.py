"""The memory plan of a run (``treejax-plan``): what the sampler and the learner will hold on each device, computed
from the config and the model's shape alone (no weights loaded, nothing allocated), and whether it fits.

Notation (the glossary's): ``N`` parameters, ``Ly`` layers, ``E`` embed, ``F`` MLP width, ``Q``/``K`` query / KV
heads of size ``H``, ``V`` vocabulary; ``b_p``, ``b_c``, ``b_s``, ``b_kv`` the bytes of the master (param),
compute, sampler and KV-cache dtypes (:class:`treejax.precision.Precision`, resolved for the planned backend:
fp32 everywhere on CPU, bf16 compute / sampler / cache on GPU and TPU). The mesh is ``data x fsdp x tensor``
(:mod:`treejax.parallel.axis_rules`): a parameter dimension is split over the mesh axes of its logical axis
(``embed`` over ``fsdp``; heads, MLP and vocabulary over ``tensor``) when they divide it, else replicated
(:func:`sharded_elements`); batch rows and KV-cache rows over ``data x fsdp``.

Learner, per device (:func:`learner_memory`):

* resident state: parameters ``N b_p``; optimizer state (optax AdamW, :func:`treejax.rl.optimizer.make_optimizer`):
  the two moments ``N (b_m + b_p)`` (``b_m``: ``OptimizerConfig.moments_dtype``, default the param dtype), plus
  ``N b_p`` for PPO-EWMA's parameter average (``OptimizerConfig.proximal_ewma``); the frozen reference ``N b_p``
  when the KL term or a shaper reads it (:func:`treejax.rl.step.initial_reference`); all sharded like the params;
  a scorer model's weights (a judge's, a PRM's or a refiner's, ``ScorerConfig`` / ``RefinerConfig``): ``N_s
  b(compute_dtype)`` each, whole, on the
  first device (the ``scorers`` row), or with ``ScorerConfig.sharding = "mesh"`` sharded like the params (the
  ``scorer_shards`` row), from the first judged step on (:func:`scorer_bytes`);
* the update's backward phase: fp32 gradients ``4 N`` (``8 N`` with micro-batches: the scan's accumulator and one
  micro-batch's gradient, :func:`treejax.rl.update.make_grad_fn`); the log-prob head's chunked copy of the output
  weights and its gradient ``(b_c + 4) V E``; the activations one micro-batch of ``n`` tokens saves (rows x row
  length; the expanded row is ``Lp + T``, the prompt bucket plus the response bound; packed, one row per
  micro-batch and device of the bucketed tree bound, the start-up layout of
  :func:`treejax.rl.packing.startup_layout`, which the table says it may grow from), stacked over the layer scan
  (:func:`saved_bytes_per_token_layer`, read off ``jax.ad_checkpoint.print_saved_residuals`` of
  :func:`treejax.models.transformer.forward`)::

      remat 'none':  4 (4E + 4) + b_c (2E + 2QH + 2KH + 3F)    (rms-norm inputs/outputs in fp32; h, q, k, v,
                                                               attention output, gate, up, silu(gate) up)
      remat 'dots':  b_c (2E + QH + 2KH + 2F)                  (the projection matmuls' outputs)
      remat 'full':  b_c E                                     (each layer's input)

  times ``Ly n``; and the backward's working set (:func:`backward_working_bytes`): one layer's recomputed
  attention scores and probabilities and their cotangents ``4 x 4 rows Q L^2`` with the ``[rows, L, L]`` mask
  (dense XLA attention; the cuDNN / Pallas kernels materialise none: 0), the cotangents of the layer being
  differentiated (one 'none' residual set; two under 'full' remat, which recomputes it), and the head's vocabulary
  chunk ``5 x 4 n C`` (``C = min(chunk, V)``, :func:`treejax.models.transformer.token_logprobs`);
* the optimizer phase: ``3 x 4 N`` (the gradients and AdamW's update temporaries).

The activations are freed before the optimizer step, so the update needs the larger phase, not their sum
(:func:`update_phases`). The constants (4 score copies, 5 head-chunk copies, ``3 x 4 N``) are calibrated against
``memory_analysis()`` of the compiled update on SmolLM2-135M (fp32, CPU): within 5% for remat none / dots / full
and 1 or 2 micro-batches (docs/memory-plan.md); a 64-wide test model keeps fewer copies, so there the plan
over-counts (``tests/test_memory_plan.py``).

Sampler, per device (:func:`sampler_memory`): the weight copy in the sampler dtype (``N b_s``, none when it
equals the master dtype: the cast is the identity; on a mesh gathered over ``fsdp``), the decode program's fused
q|k|v and gate|up copy of the layer weights (``N_layers b_s``, :func:`treejax.models.transformer.fuse_projections`),
the KV cache ``2 Ly R K L H b_kv`` (:mod:`treejax.sampling.cache`; per-row: ``R = rows`` of ``L = round_256(Lp +
D S)`` slots; shared prefix: ``P`` prompts of ``round_256(Lp)`` plus ``R`` rows of ``round_256(D S + 1)``), and
a second KV-sized buffer for the forks' and row buckets' gathers (calibrated on the tree rollout's compiled
memory, 4.2 GB for ``configs/efficacy_slots_k8_async.gin``). The held-out evaluation decodes ``EvalConfig
.batch_size`` rows of ``round_256(Lp + max_new_tokens)`` slots with the learner's devices.

Peak per device: the train state stays resident while the sampler runs. Synchronous (or asynchronous on one
shared device: both threads' programs at once)::

      state + max(update, sampler, eval)        state + update + sampler (async, shared device)

and on a split asynchronous mesh the sampler's devices hold only the sampler. The verdict compares the peak with
the device memory (``--device-memory``: a size, or a card's memory times JAX's memory fraction, 0.75 unless
``XLA_PYTHON_CLIENT_MEM_FRACTION`` says otherwise; on CPU the host's available RAM, against the sum over the
devices, which share it) and, when it does not fit, re-plans the smallest change from an ordered list
(:func:`suggest_fix`): a smaller held-out decode batch when that alone does not fit, then more micro-batches (up
to one row each), ``remat='full'`` (alone, then with micro-batches), more devices (``fsdp``), fewer leaves,
fewer prompts per step.

``--compile`` (:func:`compiled_memory`) lowers and compiles the real update step (:func:`treejax.rl.update.
make_update_fn` on the run's layout, optimizer and loss) and one decode step (:func:`treejax.sampling.decode.
make_model_fns`) with abstract inputs (``jax.ShapeDtypeStruct``) and reports ``compiled.memory_analysis()``:
one device's program with the per-device batch share (parameters unsharded), so on CPU it checks the analytic
plan. The decode step is not the whole tree-rollout loop (its forks' gather copy and the row buckets are
planned, not compiled); a packed run's update is compiled at one tree per row (``W`` leaf slots). On the CPU the
programs compile for analysis only (:data:`_ANALYSIS_ONLY_CPU`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from typing import Any

from treejax.errors import ConfigError, UserError

__all__ = ["CARDS", "MemoryPlan", "PlanShape", "compiled_memory", "device_memory_bytes", "format_plan",
           "model_config_of", "plan_memory", "saved_bytes_per_token_layer", "suggest_fix", "verdict_line"]

#: Named cards for ``--device-memory`` (bytes of device memory).
CARDS = {"h100": 80 * 2**30, "h200": 141 * 10**9, "a100": 80 * 2**30, "a100-40gb": 40 * 2**30, "l4": 24 * 2**30,
         "v5e": 16 * 2**30, "v5p": 95 * 2**30, "v4": 32 * 2**30}
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_BLOCK = 256  # the sampler's cache_multiple (make_model_fns' block_size; "dense" attention is never auto-chosen)
_GIB = 2**30


# ----------------------------------------------------------------------------------------------- the plan's types
@dataclasses.dataclass(frozen=True)
class PlanShape:
    """The sizes the plan is computed from (everything else is the model's config).

    ``prompt_width``: the run's prompt bucket (held-out prompts); ``rollout_width``: the training rollouts'
    (wider where a rollout stage adds to the prompt: :func:`stage_prompt_width`). ``rows_mb``: rows of one update
    micro-batch on one device, ``row_length`` their tokens (expanded: ``Lp + T``;
    packed: the tree bound); ``sampler_rows`` / ``cache_slots``: the tree rollout's KV rows and slots per row
    (``prefix_prompts`` x ``prefix_slots`` more for a shared-prefix cache); ``eval_rows`` / ``eval_slots``: the
    held-out decode's."""

    mesh: tuple[int, int, int]
    sampler_mesh: tuple[int, int, int]
    prompt_width: int
    rollout_width: int
    rows_mb: int
    row_length: int
    packed: bool
    sampler_rows: int
    cache_slots: int
    prefix_prompts: int
    prefix_slots: int
    eval_rows: int
    eval_slots: int
    growth_rows: int = 0


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Bytes per device of one run's programs (module docstring has every formula). ``fix``: the smallest change
    that fits (a gin binding or a flag) when ``fits`` is False, or why none was found."""

    model: str
    backend: str
    devices: int
    split: bool
    shape: PlanShape
    dtypes: dict[str, str]
    remat: str
    micro_batches: int
    learner: dict[str, int]
    sampler: dict[str, int]
    peak_learner: int
    peak_sampler: int
    device_memory: int | None
    device_memory_source: str
    fits: bool | None
    fix: str | None = None

    @property
    def peak(self) -> int:
        return max(self.peak_learner, self.peak_sampler)

    @property
    def need(self) -> int:
        """What the verdict compares with ``device_memory``: the peak per device, or on CPU, whose devices share
        the host's RAM, the sum over the devices (learner devices at the learner's peak, sampler devices at the
        sampler's)."""
        if self.backend != "cpu":
            return self.peak
        learners = math.prod(self.shape.mesh)
        scorers = self.learner.get("scorers", 0)  # on the first device only, counted in each learner's peak
        return (self.peak_learner * learners - scorers * (learners - 1)
                + self.peak_sampler * (self.devices - learners))


# ----------------------------------------------------------------------------------------------- parameters
def _mesh_axis_sizes(mesh: tuple[int, int, int]) -> dict[str, int]:
    return dict(zip(("data", "fsdp", "tensor"), mesh))


def sharded_elements(shape: tuple[int, ...], logical: tuple[str, ...], mesh: tuple[int, int, int],
                     rules=None) -> int:
    """Elements of one device's shard of an array of ``shape`` with logical axes ``logical``: each dimension is
    divided by the product of its rule's mesh axes (those not used by an earlier dimension) when that product
    divides it, else replicated (:func:`treejax.parallel.mesh.logical_to_spec`'s rule)."""
    from treejax.parallel.axis_rules import DEFAULT_RULES, rules_dict

    table, sizes, used, n = rules_dict(rules or DEFAULT_RULES), _mesh_axis_sizes(mesh), set(), 1
    for dim, name in zip(shape, logical):
        axes = [a for a in table.get(name, ()) if a not in used] if name else []
        split = math.prod(sizes[a] for a in axes)
        if split > 1 and dim % split == 0:
            used.update(axes)
            dim //= split
        n *= dim
    return n


def param_elements(model, mesh: tuple[int, int, int], rules=None, layers_only: bool = False) -> int:
    """Parameters on one device (:func:`sharded_elements` of every leaf of
    :func:`treejax.models.transformer.param_shapes`); ``layers_only``: the stacked layer weights only."""
    from treejax.models.transformer import _LOGICAL, param_shapes

    shapes = param_shapes(model)
    leaves = [(k, s) for k, s in shapes["layers"].items()]
    if not layers_only:
        leaves += [(k, s) for k, s in shapes.items() if k != "layers"]
    return sum(sharded_elements(s, _LOGICAL[k], mesh, rules) for k, s in leaves)


def lora_elements(model, lcfg, mesh: tuple[int, int, int], rules=None) -> int:
    """Adapter parameters on one device: ``Ly r (prod(in) + prod(out))`` per target, ``A`` sharded like its
    weight's input axes and ``B`` like its output axes (:func:`treejax.models.lora.logical_axes`)."""
    from treejax.models.lora import TARGETS
    from treejax.models.transformer import _LOGICAL, param_shapes

    shapes, n = param_shapes(model)["layers"], 0
    for t in lcfg.targets:
        shape, axes, k = shapes[t], _LOGICAL[t], TARGETS[t]
        n += sharded_elements(shape[:1 + k] + (lcfg.rank,), axes[:1 + k] + (None,), mesh, rules)
        n += sharded_elements((shape[0], lcfg.rank) + shape[1 + k:], (axes[0], None) + axes[1 + k:], mesh, rules)
    return n


def lora_base_bytes(model, lcfg, mesh: tuple[int, int, int], rules=None) -> int:
    """The frozen base on one device (``LoRAConfig.base_dtype``): bf16 (or fp32) leaves; a quantized base's seven
    projections at 1 byte (int8) or half a byte (nf4, int4) per weight plus a bf16 scale per output channel
    (int8) or per ``block_size`` inputs (4-bit), the rest bf16."""
    from treejax.models.lora import TARGETS
    from treejax.models.transformer import _LOGICAL, param_shapes

    shapes = param_shapes(model)
    leaves = [(k, s) for k, s in shapes["layers"].items()] + [(k, s) for k, s in shapes.items() if k != "layers"]
    quantized, total = lcfg.base_dtype in ("int8", "nf4", "int4"), 0.0
    for k, shape in leaves:
        n = sharded_elements(shape, _LOGICAL[k], mesh, rules)
        if quantized and k in TARGETS:
            per_scale = math.prod(shape[1:1 + TARGETS[k]]) if lcfg.base_dtype == "int8" else lcfg.block_size
            total += n * (1.0 if lcfg.base_dtype == "int8" else 0.5) + 2 * n / per_scale
        else:
            total += n * (4 if lcfg.base_dtype == "float32" else 2)
    return int(total)


def state_bytes(model, cfg, dtypes: dict[str, str], mesh: tuple[int, int, int]) -> dict[str, int]:
    """``{"params", "optimizer", "reference"}`` bytes on one learner device (module docstring). With LoRA the
    params are the frozen base (:func:`lora_base_bytes`) and the fp32 adapters, the optimizer state covers the
    adapters only and the reference is the base itself (no copy)."""
    from treejax.rl.shaping import needed_stats

    n, bp = param_elements(model, mesh), _DTYPE_BYTES[dtypes["param"]]
    opt = cfg.optimizer
    if cfg.lora.enabled:
        n_a = lora_elements(model, cfg.lora, mesh)
        bm = _DTYPE_BYTES[opt.moments_dtype] if opt.moments_dtype else 4
        return {"params": lora_base_bytes(model, cfg.lora, mesh) + 4 * n_a,
                "optimizer": n_a * (bm + 4) + (4 * n_a if opt.proximal_ewma is not None else 0), "reference": 0}
    bm = _DTYPE_BYTES[opt.moments_dtype] if opt.moments_dtype else bp
    optimizer = n * (bm + bp) + (n * bp if opt.proximal_ewma is not None else 0)
    ref = cfg.loss.kl_coef > 0 or "ref_logp" in needed_stats(cfg.shapers)[0]
    return {"params": n * bp, "optimizer": optimizer, "reference": n * bp if ref else 0}


# ----------------------------------------------------------------------------------------------- activations
def saved_bytes_per_token_layer(model, remat: str, compute_dtype: str) -> int:
    """Bytes the update's backward keeps per token and layer under ``remat`` (module docstring's table, read off
    ``jax.ad_checkpoint.print_saved_residuals`` of the training forward; ``tests/test_memory_plan.py`` checks it
    against them). Qwen3's q/k norms add their fp32 inputs and compute-dtype outputs and two fp32 statistics per
    head, ``(4 + b_c)(QH + KH) + 8 (Q + K)``."""
    E, F = model.hidden_size, model.intermediate_size
    QH, KH = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
    c = _DTYPE_BYTES[compute_dtype]
    if remat == "full":
        return c * E
    if remat == "dots":
        return c * (2 * E + QH + 2 * KH + 2 * F)
    norms = (4 + c) * (QH + KH) + 8 * (model.num_heads + model.num_kv_heads) if model.qk_norm else 0
    return 4 * (4 * E + 4) + c * (2 * E + 2 * QH + 2 * KH + 3 * F) + norms


def backward_working_bytes(model, remat: str, compute_dtype: str, rows: int, length: int, head_chunk: int,
                           dense_attention: bool) -> dict[str, int]:
    """The backward's transient working set beyond the stacked residuals (module docstring): ``attention`` (one
    layer's recomputed fp32 scores, probabilities and their cotangents, ``4 x 4 rows Q L^2``, and the boolean
    ``[rows, L, L]`` mask; 0 for the fused kernels), ``layer`` (the cotangents of the layer being differentiated,
    one 'none' residual set, and under 'full' remat its recomputed residuals, a second one) and ``head`` (one
    vocabulary chunk's fp32 logits, exponentials and cotangents, ``5 x 4 n C``)."""
    n = rows * length
    scores = 4 * 4 * rows * model.num_heads * length * length if dense_attention else 0
    mask = rows * length * length if dense_attention else 0
    one_layer = n * saved_bytes_per_token_layer(model, "none", compute_dtype)
    layer = one_layer * (2 if remat == "full" else 1)
    head = 5 * 4 * n * min(head_chunk, model.vocab_size)
    return {"attention": scores + mask, "layer": layer, "head": head}


def remat_name(remat: bool | str) -> str:
    """``RunConfig.remat`` as a policy name (``False`` -> ``'none'``, ``True`` -> ``'full'``)."""
    return {False: "none", True: "full"}.get(remat, remat) if isinstance(remat, bool) else remat


def learner_memory(model, cfg, dtypes: dict[str, str], shape: PlanShape, dense_attention: bool) -> dict[str, int]:
    """Bytes of one learner device during the update (module docstring): the resident state (``params``,
    ``optimizer``, ``reference``), and the update's two phases, whose larger one is its peak: the backward
    (``gradients``, ``head_weights``, ``activations``, ``backward_working``, ``batch``) and the optimizer step
    (``optimizer_step``: the ``4 N`` gradients and AdamW's temporaries, ``3 x 4 N`` in all)."""
    out = state_bytes(model, cfg, dtypes, shape.mesh)
    lora_on = cfg.lora.enabled
    n_params = lora_elements(model, cfg.lora, shape.mesh) if lora_on else param_elements(model, shape.mesh)
    out["gradients"] = 4 * n_params * (2 if cfg.micro_batches > 1 else 1)
    head = sharded_elements((model.hidden_size, model.vocab_size), ("embed", "vocab"), shape.mesh)
    # the head's chunked compute-dtype copy, and its fp32 gradient unless the head is frozen (LoRA)
    out["head_weights"] = head * ((0 if lora_on else 4) + _DTYPE_BYTES[dtypes["compute"]])
    remat = remat_name(cfg.remat)
    tokens = shape.rows_mb * shape.row_length
    out["activations"] = model.num_layers * tokens * saved_bytes_per_token_layer(model, remat, dtypes["compute"])
    work = backward_working_bytes(model, remat, dtypes["compute"], shape.rows_mb, shape.row_length,
                                  cfg.step_config().logprob_chunk_size, dense_attention)
    out["backward_working"] = sum(work.values())
    # the batch itself: tokens / positions / masks (int32) and the per-pair fp32 arrays, whole mini-batch
    out["batch"] = cfg.micro_batches * tokens * 4 * 8
    out["optimizer_step"] = 3 * 4 * n_params  # the fp32 gradients and AdamW's update temporaries (2 x 4 N)
    return out


def scorer_configs(cfg) -> list:
    """Every :class:`~treejax.scorers.config.ScorerConfig` of the run (judge stages of ``RunConfig.rollouts``, a
    branching rule's PRM in ``RunConfig.rollout``, ...), found through the configs' dataclass fields; one per
    distinct (model, dtype): a second stage naming the same scorer loads its own copy only if the dtype differs."""
    from treejax.scorers.config import ScorerConfig
    from treejax.scorers.model import resolve_model
    from treejax.scorers.refiner import RefinerConfig

    found, seen = [], set()

    def walk(x, depth=0):
        if depth > 6:
            return
        if isinstance(x, (ScorerConfig, RefinerConfig)):  # a refiner (SCOPE) shares a PRM's weights when equal
            key = (resolve_model(x, cfg.model), x.compute_dtype)
            if key not in seen:
                seen.add(key)
                found.append(x)
        elif dataclasses.is_dataclass(x) and not isinstance(x, type):
            for f in dataclasses.fields(x):
                walk(getattr(x, f.name), depth + 1)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v, depth + 1)

    walk(list(getattr(cfg, "rollouts", []) or []) + [getattr(cfg, "rollout", None)])
    return found


def scorer_bytes(cfg, mesh: tuple[int, int, int] = (1, 1, 1)) -> tuple[int, int]:
    """``(whole, shard)``: bytes of the scorer models' weights (:func:`scorer_configs`), ``N_s x bytes(compute
    dtype)`` each as ``treejax.scorers.model.load_scorer`` places them: whole on the run's first device
    (``ScorerConfig.sharding = "device"``), or each device's share over the learner ``mesh`` (``"mesh"``: the
    policy's rules, :func:`param_elements`); resident from the first judged step on. Their forwards' activations
    (``batch_size`` rows) are not counted."""
    from treejax.scorers.model import resolve_model

    whole = shard = 0
    for sc in scorer_configs(cfg):
        model = model_config_of(resolve_model(sc, cfg.model), sc.compute_dtype)
        if getattr(sc, "sharding", "device") == "mesh":  # a RefinerConfig is always whole on one device
            shard += param_elements(model, mesh) * _DTYPE_BYTES[sc.compute_dtype]
        else:
            whole += param_elements(model, (1, 1, 1)) * _DTYPE_BYTES[sc.compute_dtype]
    return whole, shard


def update_phases(learner: dict[str, int]) -> tuple[int, int]:
    """``(backward phase, optimizer phase)`` bytes of the update beyond the resident state: the activations are
    freed before the optimizer step, so the update's working memory is the larger of the two, not their sum."""
    backward = sum(learner[k] for k in ("gradients", "head_weights", "activations", "backward_working", "batch"))
    return backward, learner["optimizer_step"]


# ----------------------------------------------------------------------------------------------- sampler
def kv_bytes(model, rows: int, slots: int, cache_dtype: str, mesh: tuple[int, int, int]) -> int:
    """``2 Ly R K L H b_kv`` on one device: rows over ``data x fsdp`` and KV heads over ``tensor`` where they
    divide (:data:`treejax.sampling.cache.CACHE_LOGICAL_AXES` under the default rules)."""
    from treejax.sampling.cache import CACHE_LOGICAL_AXES

    per_layer = sharded_elements((rows, model.num_kv_heads, slots, model.head_dim), CACHE_LOGICAL_AXES, mesh)
    return 2 * model.num_layers * per_layer * _DTYPE_BYTES[cache_dtype]


def sampler_memory(model, dtypes: dict[str, str], shape: PlanShape, fused: bool, lcfg=None) -> dict[str, int]:
    """Bytes of one sampler device during a tree rollout (module docstring): the weight copy, the fused layer
    weights, the KV cache and the gather buffer of the same size. LoRA (``lcfg``): merged weights are always a
    copy; unmerged ones copy only the adapters (cast; the base is shared) and keep their projections unfused,
    whose per-layer slices the decode program copies like the fused weights."""
    from treejax.parallel.axis_rules import SAMPLER_RULES

    mesh, bs = shape.sampler_mesh, _DTYPE_BYTES[dtypes["sampler"]]
    copy = dtypes["sampler"] != dtypes["param"] or shape.sampler_mesh[1] > 1
    n = param_elements(model, mesh, SAMPLER_RULES)
    if lcfg is not None and lcfg.enabled:  # the decode program's per-layer slices of the unfused weights are
        copy = True                         # copies as large as the fused ones (measured at 7B on an H200)
        if lcfg.sampler_weights == "unmerged":
            n = lora_elements(model, lcfg, mesh, SAMPLER_RULES)
    kv = kv_bytes(model, shape.sampler_rows, shape.cache_slots, dtypes["cache"], mesh)
    if shape.prefix_prompts:
        kv += kv_bytes(model, shape.prefix_prompts, shape.prefix_slots, dtypes["cache"], mesh)
    return {"weights_copy": n * bs if copy else 0,
            "fused_weights": param_elements(model, mesh, SAMPLER_RULES, layers_only=True) * bs if fused else 0,
            "kv_cache": kv, "kv_gather": kv,
            "logits": 2 * 4 * -(-shape.sampler_rows // (mesh[0] * mesh[1])) * model.vocab_size}


def eval_memory(model, dtypes: dict[str, str], shape: PlanShape, lcfg=None) -> int:
    """The held-out decode on the learner's devices (:func:`treejax.sampling.decode.generate`, linear: no forks):
    its KV cache (``EvalConfig.batch_size`` rows of the run's prompt bucket plus ``max_new_tokens``), the fused
    layer weights, the sampler's weight copy and the logits."""
    kv = kv_bytes(model, shape.eval_rows, shape.eval_slots, dtypes["cache"], shape.mesh)
    fused = param_elements(model, shape.mesh, layers_only=True) * _DTYPE_BYTES[dtypes["sampler"]]
    copy = param_elements(model, shape.mesh) * _DTYPE_BYTES[dtypes["sampler"]] \
        if dtypes["sampler"] != dtypes["param"] else 0
    if lcfg is not None and lcfg.enabled:  # merged: a new tree; unmerged: only the adapters are cast copies
        copy = (param_elements(model, shape.mesh) if lcfg.sampler_weights == "merged"
                else lora_elements(model, lcfg, shape.mesh)) * _DTYPE_BYTES[dtypes["sampler"]]
    return kv + fused + copy + 2 * 4 * shape.eval_rows * model.vocab_size


# ----------------------------------------------------------------------------------------------- shapes
def resolve_dtypes(cfg, backend: str) -> dict[str, str]:
    """The run's :class:`~treejax.precision.Precision` resolved for ``backend`` (``param``, ``compute``,
    ``sampler``, ``cache``)."""
    p = cfg.precision.resolve(backend)
    return {"param": p.param_dtype, "compute": p.compute_dtype, "sampler": p.sampler_dtype, "cache": p.cache_dtype}


def meshes(cfg, devices: int) -> tuple[tuple[int, int, int], tuple[int, int, int], bool]:
    """``(learner mesh, sampler mesh, split)`` over ``devices`` (:func:`treejax.rl.collect.split_devices`'s rules
    without devices: asynchronous rollouts with ``sampler_devices = n > 0`` sample on the first ``n``)."""
    a = cfg.async_rollouts
    n = a.sampler_devices if a.enabled else 0
    if a.enabled and n == 0 and devices > 1:
        raise ConfigError(f"AsyncConfig.sampler_devices = 0 shares one device between the sampler and the learner; "
                          f"with {devices} devices set AsyncConfig.sampler_devices = {devices // 2}")
    if n >= devices:
        raise ConfigError(f"AsyncConfig.sampler_devices = {n} leaves no device to learn on ({devices} devices); "
                          "fix: --devices larger, or fewer sampler devices")
    learner = tuple(cfg.mesh.shape(devices - n))
    own = getattr(cfg, "sampler_mesh", None)  # RunConfig.sampler_mesh: the sampler's own layout
    if not n:
        return learner, (tuple(own.shape(devices)) if own is not None else learner), False
    if own is not None:
        return learner, tuple(own.shape(n)), True
    return learner, (1, n // cfg.mesh.tensor if n % cfg.mesh.tensor == 0 else n, cfg.mesh.tensor
                     if n % cfg.mesh.tensor == 0 else 1), True


def update_rows(cfg, prompt_width: int, mesh: tuple[int, int, int]) -> tuple[int, int]:
    """``(rows of one micro-batch on one device, row length)`` of the update (module docstring). Expanded: the
    step's rollout rows / mini-batches / micro-batches / (data x fsdp), rows of ``Lp + T``. Packed: the sticky
    start-up layout (:func:`treejax.rl.packing.startup_layout`): ``R = micro-batches x (data x fsdp)`` rows of the
    bucketed tree bound, so one row per micro-batch and device whatever ``micro_batches`` is (a packed row holds
    whole trees); a mini-batch whose trees do not fit grows ``R`` (:func:`packed_growth_rows`)."""
    from treejax.rl.packing import startup_layout
    from treejax.rl.sources.base import chain_rows

    tc, batch_devices = cfg.rollout, mesh[0] * mesh[1]
    prompt_rows, rows = chain_rows(cfg.rollouts, cfg.prompts_per_step, tc.num_leaves)
    if not cfg.packed_update:
        per = rows // cfg.mini_batches // cfg.micro_batches
        return -(-per // batch_devices), prompt_width + tc.max_length
    trees = prompt_rows // cfg.mini_batches
    multiple = cfg.micro_batches * batch_devices
    _, length, _ = startup_layout(cfg.packing, prompt_width=prompt_width, num_leaves=tc.num_leaves,
                                  response_length=tc.max_length, num_nodes=tc.num_nodes,
                                  node_length=tc.segment_length, trees=trees, row_multiple=multiple)
    return 1, length


def packed_growth_rows(cfg, mesh: tuple[int, int, int]) -> int:
    """Rows per micro-batch and device at the top of the packed layout's ladder (one tree per row,
    :meth:`treejax.rl.packing.LayoutFloor.ladder`): what a mini-batch of trees each near the bound grows to."""
    from treejax.rl.sources.base import chain_rows

    trees = chain_rows(cfg.rollouts, cfg.prompts_per_step, cfg.rollout.num_leaves)[0] // cfg.mini_batches
    multiple = cfg.micro_batches * mesh[0] * mesh[1]
    return -(-trees // multiple)


def sampler_layout(cfg, model, prompt_width: int, backend: str, dtypes: dict[str, str], sampler_devices: int,
                   sampler_tensor: int | None = None):
    """``(rows, slots per row, prefix prompts, prefix slots, fused)`` of the tree rollout's KV cache
    (:func:`treejax.sampling.tree._rollout_core`: the ``prefix_cache`` choice, ``round_256`` slot counts). The rows
    are the step's rollout rows, sampled in one call (an upper bound for stages that sample in several), less
    NudgeRL's distillation rows, which are scored, not sampled."""
    from treejax.rl.sources.base import chain_rows
    from treejax.sampling import attention as attention_lib

    from treejax.rl.nudge import NudgeConfig

    tc = cfg.rollout
    prompt_rows, rows = chain_rows(cfg.rollouts, cfg.prompts_per_step, tc.num_leaves)
    if any(isinstance(s, NudgeConfig) and s.distill for s in cfg.chain()):
        rows //= 2  # NudgeRL's distillation rows are scored under the plain prompt, not sampled
    impl = attention_lib.resolve_impl(cfg.decode_attention, head_dim=model.head_dim, cache_dtype=dtypes["cache"],
                                      block_size=_BLOCK, backend=backend)
    cascade = impl if impl in attention_lib.KERNEL_IMPLS and sampler_devices == 1 else "xla"
    rnd = lambda n: -(-n // _BLOCK) * _BLOCK  # noqa: E731
    fused = sampler_devices == 1 or (cfg.mesh.tensor if sampler_tensor is None else sampler_tensor) == 1
    if tc.resolved_prefix_cache(prompt_width, True, impl, cascade) == "shared":
        return rows, rnd(tc.response_capacity + 1), prompt_rows, rnd(prompt_width), fused
    return rows, rnd(prompt_width + tc.response_capacity), 0, 0, fused


def plan_shape(cfg, model, prompt_width: int, rollout_width: int, devices: int, backend: str,
               dtypes: dict[str, str]):
    """The :class:`PlanShape` of ``cfg`` on ``devices`` devices, and whether the decode copy is fused."""
    mesh, sampler_mesh, split = meshes(cfg, devices)
    rows_mb, length = update_rows(cfg, rollout_width, mesh)
    s_rows, slots, p_rows, p_slots, fused = sampler_layout(cfg, model, rollout_width, backend, dtypes,
                                                            math.prod(sampler_mesh), sampler_mesh[2])
    ev = cfg.eval
    eval_slots = -(-(prompt_width + ev.max_new_tokens) // _BLOCK) * _BLOCK
    shape = PlanShape(mesh, sampler_mesh, prompt_width, rollout_width, rows_mb, length, cfg.packed_update, s_rows,
                      slots, p_rows, p_slots, ev.batch_size, eval_slots,
                      packed_growth_rows(cfg, mesh) if cfg.packed_update else 0)
    return shape, split, fused


def dense_update_attention(cfg, backend: str, dtypes: dict[str, str]) -> bool:
    """Whether the update's attention materialises ``[L, L]`` scores: the XLA paths (CPU, fp32 compute, or asked
    for); cuDNN (expanded, GPU 16-bit) and the Pallas tree kernels (packed: ``pallas`` and ``pallas_mgpu`` on a GPU,
    ``pallas_tpu`` on a TPU) do not (a kernel in the interpreter, off its backend, is counted as dense)."""
    if cfg.packed_update:
        from treejax.models.tree_attention import resolve_impl as resolve_tree_impl

        impl = resolve_tree_impl(cfg.packing.attention_impl, backend)
        return (impl, backend) not in (("pallas", "gpu"), ("pallas_mgpu", "gpu"), ("pallas_tpu", "tpu"))
    if backend != "gpu":
        return True
    return cfg.attention_impl == "xla" or dtypes["compute"] == "float32"


# ----------------------------------------------------------------------------------------------- the plan
def peaks(cfg, learner: dict[str, int], sampler: dict[str, int], eval_bytes: int, split: bool) -> tuple[int, int]:
    """``(learner device peak, sampler device peak)`` (module docstring): the resident state plus the largest
    program that runs beside it (the update's larger phase, :func:`update_phases`); both programs at once for
    asynchronous rollouts on a shared device."""
    state = (learner["params"] + learner["optimizer"] + learner["reference"] + learner.get("scorers", 0)
             + learner.get("scorer_shards", 0))
    update = max(update_phases(learner))
    rollout = sum(sampler.values())
    if split:
        return state + max(update, eval_bytes), rollout
    if cfg.async_rollouts.enabled:
        return state + update + rollout, 0
    return state + max(update, rollout, eval_bytes), 0


def plan_memory(cfg, model, *, devices: int = 1, prompt_width: int, rollout_width: int | None = None,
                backend: str = "cpu",
                device_memory: int | None = None, device_memory_source: str = "", model_name: str | None = None,
                fix: bool = True) -> MemoryPlan:
    """The :class:`MemoryPlan` of run config ``cfg`` for model config ``model`` on ``devices`` devices of
    ``backend``, prompts padded to ``prompt_width`` (the run's power-of-two bucket of its longest prompt), the
    training rollouts' to ``rollout_width`` (default the same; :func:`stage_prompt_width`). With
    ``device_memory`` (bytes) the verdict, and with ``fix`` the smallest change that fits (:func:`suggest_fix`)."""
    dtypes = resolve_dtypes(cfg, backend)
    rollout_width = prompt_width if rollout_width is None else rollout_width
    shape, split, fused = plan_shape(cfg, model, prompt_width, rollout_width, devices, backend, dtypes)
    learner = learner_memory(model, cfg, dtypes, shape, dense_update_attention(cfg, backend, dtypes))
    whole, shard = scorer_bytes(cfg, shape.mesh)
    if whole:
        learner["scorers"] = whole
    if shard:
        learner["scorer_shards"] = shard
    sampler = sampler_memory(model, dtypes, shape, fused, cfg.lora)
    eval_bytes = eval_memory(model, dtypes, shape, cfg.lora)
    peak_l, peak_s = peaks(cfg, learner, sampler, eval_bytes, split)
    plan = MemoryPlan(model_name or cfg.model, backend, devices, split, shape, dtypes, remat_name(cfg.remat),
                      cfg.micro_batches, learner, dict(sampler, eval_decode=eval_bytes), peak_l, peak_s,
                      device_memory, device_memory_source, None)
    if device_memory is not None:
        plan = dataclasses.replace(plan, fits=plan.need <= device_memory)
    if plan.fits is False and fix:
        plan = dataclasses.replace(plan, fix=suggest_fix(cfg, model, plan))
    return plan


def _candidates(cfg, devices: int):
    """The changes :func:`suggest_fix` tries, in order: ``(description, config, devices)``; invalid configs (the
    ``RunConfig`` checks refuse them) are skipped."""
    from treejax.rl.sources.base import chain_rows

    rows = chain_rows(cfg.rollouts, cfg.prompts_per_step, cfg.rollout.num_leaves)[1] // cfg.mini_batches
    micro = [m for m in range(cfg.micro_batches + 1, rows + 1) if rows % m == 0]
    for m in micro:
        yield f"RunConfig.micro_batches = {m}", dict(micro_batches=m), devices
    if remat_name(cfg.remat) != "full":
        yield "RunConfig.remat = 'full'", dict(remat="full"), devices
        for m in micro:
            yield f"RunConfig.remat = 'full' and RunConfig.micro_batches = {m}", dict(remat="full", micro_batches=m), \
                devices
    for d in (2, 4, 8, 16, 32, 64):
        if d > devices:
            yield f"--devices {d} (MeshConfig.fsdp = -1)", dict(mesh=_fsdp_mesh()), d
    w = cfg.rollout.num_leaves // 2
    while w >= 1:
        tree = _smaller_tree(cfg.rollout, w)
        if tree is not None:
            yield (f"TreeConfig.num_leaves = {w}" + (f" (init_divergence {tree.init_divergence})"
                                                     if tree.init_divergence != cfg.rollout.init_divergence else ""),
                   dict(rollout=tree), devices)
        w //= 2
    p = cfg.prompts_per_step // 2
    while p >= 1:
        yield f"RunConfig.prompts_per_step = {p}", dict(prompts_per_step=p), devices
        p //= 2


def _smaller_tree(tc, leaves: int):
    """``tc`` with ``leaves`` leaves (branch factor and initial divergence capped at it), or ``None`` when the
    tree config refuses it."""
    cap = lambda v: v if v is None else min(v, leaves)  # noqa: E731
    try:
        return dataclasses.replace(tc, num_leaves=leaves, branch_factor=min(tc.branch_factor, leaves),
                                   init_divergence=cap(tc.init_divergence))
    except (ValueError, UserError):
        return None


def _fsdp_mesh():
    from treejax.parallel.mesh import MeshConfig

    return MeshConfig(data=1, fsdp=-1, tensor=1)


def _replan(cfg, model, plan: MemoryPlan, changes: dict, devices: int) -> MemoryPlan | None:
    """``plan`` again with ``changes`` to the config on ``devices`` devices (no fix search); ``None`` when the
    ``RunConfig`` checks refuse the changed config."""
    import warnings

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            new = dataclasses.replace(cfg, **changes)
        return plan_memory(new, model, devices=devices, prompt_width=plan.shape.prompt_width,
                           rollout_width=plan.shape.rollout_width, backend=plan.backend,
                           device_memory=plan.device_memory, fix=False)
    except (ValueError, UserError):
        return None


def _eval_fix(cfg, model, plan: MemoryPlan) -> tuple[Any, str]:
    """``(config, binding)``: the largest ``EvalConfig.batch_size`` (halving) whose held-out decode fits beside the
    state, when the current one does not (``(cfg, "")`` when it does or nothing smaller fits)."""
    state = (plan.learner["params"] + plan.learner["optimizer"] + plan.learner["reference"]
             + plan.learner.get("scorers", 0) + plan.learner.get("scorer_shards", 0))
    size = cfg.eval.batch_size
    if state + plan.sampler["eval_decode"] <= plan.device_memory:
        return cfg, ""
    while size > 1:
        size //= 2
        new = dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, batch_size=size))
        p = _replan(new, model, plan, {}, plan.devices)
        if p is not None and state + p.sampler["eval_decode"] <= plan.device_memory:
            return new, f"EvalConfig.batch_size = {size}"
    return cfg, ""


def suggest_fix(cfg, model, plan: MemoryPlan) -> str:
    """The smallest change that fits ``plan.device_memory``, as ``"<bindings or flag> (peak X GiB)"``: the
    held-out decode's batch first when it alone does not fit (:func:`_eval_fix`), then the first change of
    :func:`_candidates` (micro-batches, remat, more devices, smaller trees) whose re-plan fits; else a sentence
    saying that none of them fits."""
    cfg, eval_text = _eval_fix(cfg, model, plan)
    tries = [("", {}, plan.devices)] if eval_text else []
    for text, changes, devices in tries + list(_candidates(cfg, plan.devices)):
        p = _replan(cfg, model, plan, changes, devices)
        if p is not None and p.fits:
            both = " and ".join(t for t in (eval_text, text) if t)
            return f"{both} (peak {_human(p.peak)})"
    return "none of micro-batches, remat='full', up to 64 devices or smaller trees fits: a smaller model"


# ----------------------------------------------------------------------------------------------- device memory
_SIZE = re.compile(r"^\s*([\d.]+)\s*(b|kb|mb|gb|tb|kib|mib|gib|tib)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
          "tib": 2**40}


def host_available_bytes() -> int | None:
    """The host's available RAM (``MemAvailable`` of ``/proc/meminfo``, else psutil), or ``None``."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import psutil
    except ImportError:
        return None
    return int(psutil.virtual_memory().available)


def jax_memory_fraction() -> float:
    """The share of an accelerator's memory JAX's allocator may use: ``XLA_PYTHON_CLIENT_MEM_FRACTION`` when set,
    else JAX's default 0.75 (what a run without the variable gets)."""
    try:
        return float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75"))
    except ValueError:
        return 0.75


def device_memory_bytes(spec: str | None, backend: str) -> tuple[int | None, str]:
    """``(bytes, where it came from)`` of ``--device-memory``: a size (``80GiB``, ``141GB``, ``24e9``) taken as
    the memory a run may use, a card name (:data:`CARDS`: its memory times :func:`jax_memory_fraction`), or
    ``None``: the host's available RAM on CPU, else unknown. A malformed value is a
    :class:`~treejax.errors.ConfigError`."""
    if spec is None:
        if backend == "cpu":
            avail = host_available_bytes()
            return avail, "host RAM available now" if avail else "unknown"
        return None, "unknown (pass --device-memory)"
    name = spec.strip().lower()
    if name in CARDS:
        fraction = jax_memory_fraction()
        return int(CARDS[name] * fraction), f"{name.upper()} x {fraction:g}, JAX's memory fraction"
    m = _SIZE.match(name)
    if not m:
        raise ConfigError(f"--device-memory {spec!r} is neither a size (e.g. 80GiB, 141GB) nor a card "
                          f"({', '.join(sorted(CARDS))})")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "b").lower()]), spec.strip()


def backend_of(spec: str | None, backend: str | None) -> str:
    """The backend planned for: ``backend`` when given; a card name of ``--device-memory`` means GPU (TPU for
    ``v4`` / ``v5*``); else the backend of this machine's JAX."""
    if backend:
        return backend
    if spec and spec.strip().lower() in CARDS:
        return "tpu" if spec.strip().lower().startswith("v") else "gpu"
    import jax

    return jax.default_backend()


# ----------------------------------------------------------------------------------------------- the model's shape
#: Shapes of the parted models (read from their GGUF header once assembled; before that, the preset of the same
#: architecture: Qwen2.5-Coder-1.5B has Qwen2.5-1.5B's shape).
_PARTED_PRESETS = {"qwen2.5-coder-1.5b-instruct": "qwen2.5-1.5b"}


def model_config_of(name: str, param_dtype: str = "float32", compute_dtype: str | None = None):
    """The :class:`~treejax.models.config.ModelConfig` of ``RunConfig.model`` without reading any weight: a
    preset name (:mod:`treejax.models.presets`), the embedded GGUF's or a ``.gguf`` file's header (memory-mapped),
    an HF folder's ``config.json``, a parted model's assembled header or its preset. A name that is none of these
    is a :class:`~treejax.errors.ModelFileError`."""
    from treejax.models import parts, presets, registry
    from treejax.models.gguf_checkpoint import config_from_gguf, read_gguf_header
    from treejax.models.hf_checkpoint import load_hf_config

    compute_dtype = compute_dtype or param_dtype
    random = registry.parse_random(name)
    if random is not None:  # random weights of a preset's shape
        return presets.get_config(random[0], param_dtype=param_dtype, compute_dtype=compute_dtype)
    if name in presets.preset_names():
        return presets.get_config(name, param_dtype=param_dtype, compute_dtype=compute_dtype)
    if name in parts.PARTED_MODELS:
        path = os.path.join(parts.model_dir(), parts.PARTED_MODELS[name].filename)
        if not os.path.isfile(path):
            return presets.get_config(_PARTED_PRESETS[name], param_dtype=param_dtype, compute_dtype=compute_dtype)
    else:
        path = registry._resolve(name)
    if os.path.isdir(path):
        return load_hf_config(path, param_dtype, compute_dtype)
    return config_from_gguf(read_gguf_header(path), path, param_dtype, compute_dtype)


def stage_prompt_width(cfg, width: int, tokenizer=None, task=None, records=()) -> int:
    """The widest prompt the rollout stages pad to, from the run's prompt bucket ``width``: XRPO's exemplars
    (``ExemplarConfig.prompt_width``, 0: twice the run's), NudgeRL's hinted prompts (the power-of-two bucket of
    the longest hinted prompt, measured with ``tokenizer`` as :class:`treejax.rl.nudge.NudgeRollouts` does on the
    32 longest ``records`` by text, so the check stays well under a second; without them the run's width)."""
    from treejax.data.prompts import encode_examples
    from treejax.rl.exemplars import ExemplarConfig
    from treejax.rl.nudge import NudgeConfig, hinted_example, problem_hints
    from treejax.sampling.decode import bucket_length

    out = width
    for stage in cfg.chain():
        if isinstance(stage, ExemplarConfig):
            out = max(out, stage.prompt_width or 2 * width)
        elif isinstance(stage, NudgeConfig) and tokenizer is not None and records:
            longest = sorted(records, key=lambda r: len(str(r)), reverse=True)[:32]  # tokenizing all takes ~1 s
            examples = [hinted_example(task.make_example(r), h, stage) for r in longest for h in
                        problem_hints(r, stage)]
            toks = encode_examples(tokenizer, examples, cfg.system_prompt, cfg.instruction)
            out = max(out, bucket_length(max(len(t) for t in toks)))
    return out


def measured_prompt_width(cfg) -> tuple[int, int]:
    """``(the run's prompt bucket, the rollouts')``, measured as ``treejax-train`` does before the weights load
    (the task's data and the model's tokenizer: :func:`treejax.rl.setup.filter_prompts`; :func:`stage_prompt_width`)."""
    import logging

    from treejax.models.registry import load_tokenizer
    from treejax.rl.setup import filter_prompts, load_task_data

    task, train_records, eval_examples = load_task_data(cfg)
    tokenizer = load_tokenizer(cfg.model)
    logger = logging.getLogger("treejax.rl.loop")
    level = logger.level
    logger.setLevel(logging.ERROR)  # the over-long prompt count is treejax-train's to report
    try:
        train_records, _, width = filter_prompts(tokenizer, task, train_records, eval_examples, cfg)
    finally:
        logger.setLevel(level)
    return width, stage_prompt_width(cfg, width, tokenizer, task, train_records)


# ----------------------------------------------------------------------------------------------- compiled truth
def _analysis(compiled) -> dict[str, int]:
    """``memory_analysis()`` of a compiled program as ``{argument, output, alias, temp, total}`` bytes
    (``total = argument + output - alias + temp``: donated outputs reuse their arguments); ``{}`` where the
    backend reports none."""
    m = compiled.memory_analysis()
    if m is None:
        return {}
    out = {"argument": int(m.argument_size_in_bytes), "output": int(m.output_size_in_bytes),
           "alias": int(m.alias_size_in_bytes), "temp": int(m.temp_size_in_bytes)}
    out["total"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
    return out


#: CPU compiles for ``memory_analysis()`` only: the buffer assignment (what it reports) comes before LLVM's code
#: generation, so its optimisation level changes the compile time (about half), not the bytes (checked on the
#: tiny update: 4,168,488 temp bytes either way).
_ANALYSIS_ONLY_CPU = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _compile(lowered):
    """``lowered.compile()``, with :data:`_ANALYSIS_ONLY_CPU` on the CPU (the program is never run)."""
    import jax

    return lowered.compile(compiler_options=_ANALYSIS_ONLY_CPU) if jax.default_backend() == "cpu" else \
        lowered.compile()


def _abstract_state(cfg, model):
    """``(optimizer, abstract TrainState)``: ``jax.eval_shape`` of the initial parameters and
    ``TrainState.create`` (nothing allocated)."""
    import jax

    from treejax.models import transformer
    from treejax.rl.optimizer import make_optimizer
    from treejax.rl.train_state import TrainState

    optimizer = make_optimizer(cfg.optimizer)
    params = jax.eval_shape(lambda k: transformer.init_params(model, k), jax.random.key(0))
    if cfg.lora.enabled:  # the LoRA run's tree: adapters on the frozen (quantized) base
        from treejax.models import lora

        params = jax.eval_shape(lambda p: lora.prepare(p, cfg.lora), params)
    return optimizer, jax.eval_shape(lambda p: TrainState.create(p, optimizer, {}), params)


def _abstract_batch(cfg, model, shape: PlanShape):
    """An abstract :class:`~treejax.rl.batch.Batch` of one device's mini-batch share (the micro-batches'
    rows): expanded ``[B, L]`` rows, or packed rows ``[R, L]`` with one tree (``W`` leaf slots) per row."""
    import jax
    import jax.numpy as jnp

    from treejax.rl.batch import Batch, SequenceInputs, TreeInputs

    i32, f32 = jnp.int32, jnp.float32
    sds = jax.ShapeDtypeStruct
    B, L = shape.rows_mb * cfg.micro_batches, shape.row_length
    if shape.packed:
        W, T = cfg.rollout.num_leaves, cfg.rollout.max_length
        inputs = TreeInputs(*(sds((B, L), i32) for _ in range(5)), sds((B, W, T), i32), sds((B, W), i32))
        pair = (B, W, T)
    else:
        inputs, pair = SequenceInputs(sds((B, L), i32), sds((B, L), i32), sds((B, L), i32)), (B, L)
    ref = sds(pair, f32) if cfg.loss.kl_coef > 0 else None
    return Batch(inputs, sds(pair, f32), sds(pair, f32), sds(pair, f32), sampler_logp=sds(pair, f32), ref_logp=ref,
                 eps_scale=sds(pair[:-1], f32), num_sequences=B * (cfg.rollout.num_leaves if shape.packed else 1),
                 sequence_length=shape.rollout_width + cfg.rollout.max_length)


def compiled_update(cfg, model, shape: PlanShape) -> dict[str, int]:
    """``memory_analysis()`` of the run's real update step (layout, loss, optimizer, micro-batches, remat; jitted
    with the state donated) lowered with abstract inputs for one device's share (:func:`_abstract_batch`)."""
    import jax

    from treejax.rl.layouts import make_layout
    from treejax.rl.optimizer import learning_rate_schedule
    from treejax.rl.update import make_update_fn

    optimizer, state = _abstract_state(cfg, model)
    step_cfg = cfg.step_config(0, 1)
    layout = make_layout(model, step_cfg.packing, attention_impl=cfg.attention_impl,
                         row_multiple=step_cfg.row_multiple, chunk_size=step_cfg.logprob_chunk_size)
    update = make_update_fn(layout, cfg.loss, optimizer, num_micro_batches=cfg.micro_batches, nonfinite="skip",
                            learning_rate_fn=learning_rate_schedule(cfg.optimizer), remat=cfg.remat)
    lowered = jax.jit(update, donate_argnames="state").lower(state, _abstract_batch(cfg, model, shape))
    return _analysis(_compile(lowered))


def compiled_decode_step(model, shape: PlanShape, dtypes: dict[str, str]) -> dict[str, int]:
    """``memory_analysis()`` of one decode step of the sampler over the rollout's per-row KV cache (the weights in
    the sampler dtype, prepared as the rollout prepares them: :func:`treejax.sampling.decode.make_model_fns`)."""
    import functools

    import jax
    import jax.numpy as jnp

    from treejax.models import transformer
    from treejax.sampling.decode import make_model_fns

    fns = make_model_fns(model, cache_dtype=dtypes["cache"])
    sampler_model = model.replace(param_dtype=dtypes["sampler"])
    params = jax.eval_shape(lambda k: transformer.init_params(sampler_model, k), jax.random.key(0))
    slots = shape.cache_slots + shape.prefix_slots  # a shared-prefix run's rows, as one per-row cache
    cache = jax.eval_shape(functools.partial(fns.init_cache, shape.sampler_rows, slots))
    rows = jax.ShapeDtypeStruct((shape.sampler_rows,), jnp.int32)
    step = jax.jit(lambda p, t, pos, c: fns.step(fns.prepare(p), t, pos, c), donate_argnums=3)
    return _analysis(_compile(step.lower(params, rows, rows, cache)))


def compiled_memory(cfg, model, plan: MemoryPlan) -> dict[str, dict[str, int]]:
    """``{"update": ..., "decode_step": ...}`` (:func:`compiled_update`, :func:`compiled_decode_step`) for this
    machine's backend, at the plan's dtypes."""
    m = model.replace(param_dtype=plan.dtypes["param"], compute_dtype=plan.dtypes["compute"])
    return {"update": compiled_update(cfg, m, plan.shape),
            "decode_step": compiled_decode_step(m, plan.shape, plan.dtypes)}


# ----------------------------------------------------------------------------------------------- reporting
def _gib(n: int) -> str:
    return f"{n / _GIB:8.2f} GiB"


def _human(n: int) -> str:
    return f"{n / _GIB:.1f} GiB" if n >= _GIB // 10 else f"{n / 2**20:.1f} MiB"


def verdict_line(plan: MemoryPlan) -> str:
    """One line: the peak per device (on CPU, the devices' sum: they share the host's RAM) against the device
    memory, and the fix when it does not fit."""
    where = f"{plan.devices} {plan.backend} device{'s' if plan.devices > 1 else ''}"
    peak = f"peak {_human(plan.peak)} per device on {where}"
    if plan.backend == "cpu" and plan.devices > 1:
        peak += f", {_human(plan.need)} together in the host's RAM"
    if plan.fits is None:
        return f"memory plan: {peak} (device memory unknown: pass --device-memory)"
    cap = f"{_human(plan.device_memory)} ({plan.device_memory_source})"
    if plan.fits:
        return f"memory plan: fits: {peak} of {cap}"
    return f"memory plan: does not fit: {peak} > {cap}; smallest change that fits: {plan.fix}"


def format_plan(plan: MemoryPlan, compiled: dict | None = None) -> str:
    """The plan as a table (one line per quantity, bytes in GiB), the verdict last."""
    s = plan.shape
    lines = [f"treejax memory plan: {plan.model}, {plan.backend}, {plan.devices} device(s), learner mesh "
             f"data x fsdp x tensor = {' x '.join(map(str, s.mesh))}"
             + (f", sampler mesh {' x '.join(map(str, s.sampler_mesh))}" if plan.split else ""),
             f"  dtypes: master {plan.dtypes['param']}, compute {plan.dtypes['compute']}, sampler "
             f"{plan.dtypes['sampler']}, KV cache {plan.dtypes['cache']}; remat '{plan.remat}', micro_batches "
             f"{plan.micro_batches}",
             f"  update micro-batch per device: {s.rows_mb} {'packed' if s.packed else 'expanded'} rows x "
             f"{s.row_length} tokens (prompt bucket {s.prompt_width}"
             + (f", rollouts' {s.rollout_width})" if s.rollout_width != s.prompt_width else ")")
             + (f"; the layout grows to {s.growth_rows} rows if its trees do not share rows"
                if s.packed and s.growth_rows > s.rows_mb else ""),
             f"  sampler KV: {s.sampler_rows} rows x {s.cache_slots} slots"
             + (f" + {s.prefix_prompts} shared prompts x {s.prefix_slots} slots" if s.prefix_prompts else "")
             + f"; eval decode {s.eval_rows} rows x {s.eval_slots} slots", "  learner (per device):"]
    lines += [f"    {k:<18}{_gib(v)}" for k, v in plan.learner.items()]
    backward, optimizer = update_phases(plan.learner)
    lines += [f"    {'update':<18}{_gib(max(backward, optimizer))}  (the larger of the backward phase "
              f"{backward / _GIB:.2f} and the optimizer step {optimizer / _GIB:.2f} GiB)",
              f"    {'peak':<18}{_gib(plan.peak_learner)}  (state + the largest program beside it)",
              "  sampler (per device; eval_decode runs on the learner's devices):"]
    lines += [f"    {k:<18}{_gib(v)}" for k, v in plan.sampler.items()]
    if plan.split:
        lines.append(f"    {'peak':<18}{_gib(plan.peak_sampler)}")
    for name, m in (compiled or {}).items():
        lines.append(f"  compiled {name} (memory_analysis): " + (", ".join(
            f"{k} {v / _GIB:.2f} GiB" for k, v in m.items()) if m else "not reported by this backend"))
    return "\n".join(lines + [verdict_line(plan)])


# ----------------------------------------------------------------------------------------------- in a run
def accelerator_memory() -> tuple[int | None, str]:
    """This process's first device's memory: ``bytes_limit`` of its ``memory_stats()`` on an accelerator, the
    host's available RAM on CPU."""
    import jax

    device = jax.devices()[0]
    if device.platform == "cpu":
        return device_memory_bytes(None, "cpu")
    stats = device.memory_stats() or {}
    limit = stats.get("bytes_limit")
    return (int(limit), f"{device.device_kind} bytes_limit") if limit else (None, "unknown")


def log_run_plan(cfg, prompt_width: int, log, tokenizer=None, task=None, records=()) -> MemoryPlan | None:
    """``treejax-train``'s first memory line, before the weights load: the analytic plan on the run's devices
    (:func:`verdict_line`: INFO when it fits, a WARNING naming the fix when it does not; the run goes on either
    way, the estimate can be wrong). ``tokenizer``, ``task``, ``records``: the run's, for the rollout stages'
    prompt widths (:func:`stage_prompt_width`). A planning failure is one INFO line; it never stops the run."""
    try:
        import jax

        prec = cfg.precision.resolve()
        model = model_config_of(cfg.model, prec.param_dtype, prec.compute_dtype)
        memory, source = accelerator_memory()
        width = stage_prompt_width(cfg, prompt_width, tokenizer, task, records)
        plan = plan_memory(cfg, model, devices=jax.device_count(), prompt_width=prompt_width, rollout_width=width,
                           backend=jax.default_backend(), device_memory=memory, device_memory_source=source)
    except Exception as e:  # noqa: BLE001  (an estimate must never stop a run)
        log.info("memory plan: not available (%s: %s)", type(e).__name__, " ".join(str(e).split())[:200])
        return None
    (log.warning if plan.fits is False else log.info)("%s (treejax-plan prints the table)", verdict_line(plan))
    return plan


# ----------------------------------------------------------------------------------------------- the CLI
_EPILOG = """\
examples:
  treejax-plan                                               # the quickstart on this machine (host RAM on CPU)
  treejax-plan configs/efficacy_nudge.gin --compile          # and the compiled update / decode step's memory
  treejax-plan configs/qwen15_grpo16.gin --devices 2 --device-memory h200
  treejax-plan configs/treepo_smollm2.gin --gin_param="RunConfig.micro_batches=4" --device-memory 24GiB

Every number is per device. docs/memory-plan.md explains the formulas and how they compare with measured runs.
"""


def _build_parser():
    import argparse

    from treejax.gin_surface import add_gin_arguments

    parser = argparse.ArgumentParser(prog="treejax-plan", epilog=_EPILOG,
                                     description="The memory a run's config needs per device (sampler and learner), "
                                                 "before the run: fits or not, and the smallest change that fits.",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_gin_arguments(parser)
    parser.add_argument("--devices", type=int, default=1, help="devices of the run (default 1)")
    parser.add_argument("--device-memory", default=None, metavar="SIZE|CARD",
                        help=f"memory per device: a size (80GiB, 141GB) or a card ({', '.join(sorted(CARDS))}); "
                             "default on CPU: the host's available RAM")
    parser.add_argument("--backend", choices=("cpu", "gpu", "tpu"), default=None,
                        help="plan for this backend's dtypes (default: GPU for a card name, else this machine's)")
    parser.add_argument("--prompt-width", type=int, default=None,
                        help="the prompts' padded width (default: measured from the task with the tokenizer)")
    parser.add_argument("--compile", action="store_true",
                        help="also compile the update step and one decode step with abstract inputs and print "
                             "their memory_analysis() (this machine's backend)")
    return parser


def main(argv: list[str] | None = None) -> MemoryPlan:
    """``treejax-plan``: parses the gin config like ``treejax-train``, plans and prints the table."""
    import os as _os

    from treejax.gin_surface import gin_files_of, parse
    from treejax.listing import default_config_dir

    parser = _build_parser()
    args = parser.parse_args(argv)
    if args.devices < 1:
        raise ConfigError(f"--devices must be >= 1, got {args.devices}")
    gin_files = gin_files_of(parser, args)
    if gin_files is None:
        d = default_config_dir()
        gin_files = [_os.path.join(d, "quickstart.gin")] if d else []
    cfg = parse(gin_files, args.gin_param, check_mesh=False)
    backend = backend_of(args.device_memory, args.backend)
    memory, source = device_memory_bytes(args.device_memory, backend)
    dtypes = resolve_dtypes(cfg, backend)
    model = model_config_of(cfg.model, dtypes["param"], dtypes["compute"])
    width, rollout_width = (args.prompt_width, None) if args.prompt_width else measured_prompt_width(cfg)
    plan = plan_memory(cfg, model, devices=args.devices, prompt_width=width, rollout_width=rollout_width,
                       backend=backend,
                       device_memory=memory, device_memory_source=source)
    compiled = compiled_memory(cfg, model, plan) if args.compile else None
    print(format_plan(plan, compiled))
    return plan


def console_main(argv: list[str] | None = None) -> None:
    """The ``treejax-plan`` entry point: a :class:`~treejax.errors.UserError` is one line, exit status 2."""
    import sys

    from treejax.gin_surface import _one_line

    try:
        main(argv)
    except UserError as e:
        print(f"treejax-plan: error: {_one_line(e)}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    console_main()
