"""Golden runs of the rollout-chain redesign: every CLI feature case and every shipped config, 2 steps each.

Recorded on the code BEFORE the redesign's first edit (``python -m tests.golden.golden record``) and compared after
every phase (``check``); a config added since is recorded on the code that added it (``record`` records only the
cases not in the file), so from then on a change that moves its bits shows up here too. What is compared: the
history without wall-clock keys, and per step sha256 of the rollouts the learner received (every forest array, the
rewards, the verifier scores, the estimator inputs) and of the parameters after the update. Equal means bit-for-bit
equal on the machine that recorded them (XLA:CPU, same jax, same CPU type; the file's ``_machine`` entry).

On another kind of CPU the results round differently (XLA:CPU vectorises reductions by the CPU's vector width).
Measured between the first recording machine and an AMD EPYC with AVX-512, same jax 0.10.2, same code: tokens,
rewards and estimator inputs equal in most cases, but the sampler's log-probs differed in 74 of 91 cases by ~1e-7,
the parameters after the update in 32, history values by up to 1.4e-3 relative (``update/kl`` after two Adam
steps), and in one case (``efficacy_dots_replay``) the chosen prompts. No tolerance separates that from a change,
so bit-equality is checked only on the recording machine (the file's ``_machine``: CPU model, vector unit, jax,
jaxlib); elsewhere ``check`` says so and stops (exit 3), and the slow test skips. ``forest_other`` (every forest
array but the log-probs) and ``forest_logprobs_summary`` (count, sum, sum of ``|logp|``, min, max of the finite
log-probs) say, when a case differs, whether only the log-probs moved and by how much.

The file in the repository was re-recorded on an AMD EPYC (AVX-512), jax 0.10.2, at commit b6d2717; the same
machine's records of the code before the redesign (be8bc5e, 90 cases) equal those on every key they share.

Cases run in one process and share a persistent compilation cache (a cached executable is the same program, so it
changes no bit), so a ``check`` after the first one mostly loads programs.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
CONFIGS = os.path.join(ROOT, "configs")
GOLDEN = os.path.join(HERE, "golden_runs.json")

#: Wall-clock, memory and compile keys: not part of a run's result.
VOLATILE = ("time/", "compile/", "memory/", "throughput/", "loop/")
#: Configs that are not RL runs of treejax-train (treejax-sft's).
SFT_CONFIGS = ("sft_chain_sum.gin", "sft_otr.gin", "sft_retrieval_expert.gin", "sft_shell_expert.gin",
               "sft_travel_expert.gin")

#: Shrinking a config can break its own arithmetic: these keep it valid (a DOTS reference below the prompts, one
#: device for async, room for the game's first observation, mini-batches that divide the rows).
FIX = {"efficacy_dots_replay.gin": ["RunConfig.prompts_per_step = 4"],
       "efficacy_slots_k8_async.gin": ["AsyncConfig.sampler_devices = 0"],
       "multiturn_guess_number.gin": ["TreeConfig.max_depth = 8", "TreeConfig.segment_length = 16"],
       "treepo_qwen2.5_math.gin": ["RunConfig.mini_batches = 1", "RunConfig.micro_batches = 1"],
       # the judge: the tiny policy's own initial weights, not the embedded 135M model (recorded after the judges)
       "efficacy_fapo.gin": ["ScorerConfig.model = 'policy'", "ScorerConfig.batch_size = 8"],
       "efficacy_ssl.gin": ["ScorerConfig.model = 'policy'", "ScorerConfig.batch_size = 8"],
       "efficacy_slate.gin": ["ScorerConfig.model = 'policy'", "ScorerConfig.batch_size = 8"],
       "efficacy_mapo.gin": ["ScorerConfig.model = 'policy'", "ScorerConfig.batch_size = 8"],
       "efficacy_prm_steps.gin": ["ScorerConfig.model = 'policy'", "ScorerConfig.batch_size = 8"]}

SMALL = ["RunConfig.num_steps = 2", "RunConfig.prompts_per_step = 2", "EvalConfig.num_problems = 2",
         "EvalConfig.max_new_tokens = 2", "RunConfig.export_hf = False", "RunConfig.tree_picture_every = 0",
         "RunConfig.eval_every = 0"]


def _hash(*arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        if a is None:
            h.update(b"None")
            continue
        a = np.asarray(a)
        h.update(str(a.dtype).encode() + str(a.shape).encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()[:16]


def _leaves(tree):
    import jax
    return jax.tree_util.tree_leaves(jax.device_get(tree))


def _summary(logprobs) -> list[float]:
    """``[n, sum, sum |x|, min, max]`` over the finite entries (float64 sums of the float32 values)."""
    x = np.asarray(logprobs, np.float64)
    x = x[np.isfinite(x)]
    if x.size == 0:
        return [0.0, 0.0, 0.0, 0.0, 0.0]
    return [float(x.size), float(x.sum()), float(np.abs(x).sum()), float(x.min()), float(x.max())]


def _rollout_hashes(ro) -> dict:
    f = ro.forest
    out = {"forest_tokens": _hash(f.tokens, f.leaf_length, f.leaf_status, f.leaf_path),
           "forest_logprobs": _hash(f.logprobs),
           "forest_rest": _hash(*_leaves(f)),
           "forest_other": _hash(*_leaves(f.replace(logprobs=None))),
           "forest_logprobs_summary": _summary(f.logprobs),
           "rewards": _hash(ro.rewards_PxW), "scores": _hash(ro.scores_PxW),
           "prompts": _hash(ro.prompts_PxLp, ro.lengths_P)}
    for k in sorted(ro.estimator_inputs):
        out[f"input/{k}"] = _hash(*_leaves(ro.estimator_inputs[k]))
    for k in ("label_leaf_P", "groups_PxC", "tool_calls_PxW", "fixed_advantage_PxW", "reward_scores_PxW"):
        v = getattr(ro, k, None)
        if v is not None:
            out[k] = _hash(v)
    return out


@contextlib.contextmanager
def _recording(log: list):
    """Wrap the learner's entry (``treejax.rl.step.learn``, also bound in ``treejax.rl.loop``)."""
    import treejax.rl.loop as loop_mod
    import treejax.rl.step as step_mod
    orig = step_mod.learn

    def learn(learner, state, ro, key, *a, **kw):
        entry = _rollout_hashes(ro)
        out = orig(learner, state, ro, key, *a, **kw)
        entry["params_after"] = _hash(*_leaves(out[0].params))
        log.append(entry)
        return out

    step_mod.learn, loop_mod.learn = learn, learn
    try:
        yield
    finally:
        step_mod.learn, loop_mod.learn = orig, orig


def _clean(history: list[dict]) -> list[dict]:
    rows = []
    for row in history:
        rows.append({k: (None if isinstance(v, float) and v != v else v) for k, v in sorted(row.items())
                     if not k.startswith(VOLATILE) and not k.endswith(("_s", "_seconds"))})
    return rows


def cases(tiny: str) -> dict[str, list[str]]:
    """name -> the gin bindings (file first) of every golden case."""
    sys.path.insert(0, ROOT)
    from tests.rl import test_loop_features as tlf
    out = {}
    base = [f"RunConfig.model = '{tiny}'", "TreeConfig.num_leaves = 4", "TreeConfig.max_depth = 2",
            "TreeConfig.segment_length = 4", "OptimizerConfig.learning_rate = 1e-3", "LossConfig.entropy_coef = 0.01"]
    for case in tlf.CLI_CASES:
        out[f"cli/{case}"] = ["quickstart.gin", *SMALL, *base, *tlf._extra(case), "RunConfig.num_steps = 2"]
    for name in sorted(os.listdir(CONFIGS)):
        if name.endswith(".gin") and name not in SFT_CONFIGS:
            out[f"config/{name}"] = [name, *SMALL, f"RunConfig.model = '{tiny}'", "TreeConfig.segment_length = 4",
                                     "TreeConfig.max_depth = 2", *FIX.get(name, [])]
    return out


def run_case(bindings: list[str], log_dir: str) -> dict:
    from treejax import train
    log: list = []
    params = [*bindings[1:], f"RunConfig.log_dir = '{log_dir}'"]
    argv = ["--gin_file", os.path.join(CONFIGS, bindings[0]), "--quiet"] + sum((["--gin_param", p] for p in params), [])
    with _recording(log):
        summary = train.main(argv)
    if not isinstance(summary, dict):
        return {"error": f"exit {summary}"}
    return {"history": _clean(summary["history"]), "steps": log}


def tiny_checkpoint(folder: str) -> str:
    import jax
    from treejax.models import presets, transformer
    from treejax.models.export import export_hf
    from treejax.models.registry import embedded_model_path
    from treejax.models.tokenizer import TextTokenizer
    if not os.path.exists(os.path.join(folder, "config.json")):
        tok = TextTokenizer.from_gguf(embedded_model_path("smollm2-135m-instruct"))
        cfg = presets.tiny_config("smollm2-135m", vocab_size=49152, eos_token_ids=tuple(tok.eos_ids), pad_token_id=2)
        export_hf(transformer.init_params(cfg, jax.random.key(0)), cfg, folder, tok)
    return folder


def machine() -> dict:
    """What bit-equality depends on: the CPU model, its widest vector unit, jax and jaxlib."""
    import jax
    import jaxlib
    import platform
    cpu, flags = platform.processor(), ""
    if os.path.exists("/proc/cpuinfo"):
        info = open("/proc/cpuinfo").read().splitlines()
        cpu = next((ln.split(":", 1)[1].strip() for ln in info if ln.startswith("model name")), cpu)
        flags = next((ln.split(":", 1)[1] for ln in info if ln.startswith("flags")), "")
    vector = next((v for v in ("avx512f", "avx2", "avx", "sse4_2") if f" {v} " in f" {flags} "), platform.machine())
    return {"cpu": cpu, "vector": vector, "jax": jax.__version__, "jaxlib": jaxlib.__version__}


def _args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("mode", choices=("record", "check"))
    ap.add_argument("--only", default="", help="substring of the case names to run")
    ap.add_argument("--all", action="store_true", help="record: every case again (and this machine as _machine)")
    ap.add_argument("--any-machine", action="store_true",
                    help="check: compare even on a machine other than the recording one (expect rounding differences)")
    ap.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "treejax_golden"))
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = _args(argv)
    os.makedirs(args.work, exist_ok=True)
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(args.work, "xla_cache"))
    import jax
    jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    tiny = tiny_checkpoint(os.path.join(args.work, "tiny_hf"))
    golden = json.load(open(GOLDEN)) if os.path.exists(GOLDEN) else {}
    here = machine()
    if args.mode == "record" and not args.all and golden.get("_machine", here) != here:
        print(f"the records are from {golden['_machine']}, this machine is {here}: re-record all (--all) or none")
        return 2
    if args.mode == "record" and args.all:
        golden = {"_machine": here}
    if args.mode == "check" and golden.get("_machine") != here and not args.any_machine:
        print(f"not comparable: the records were made on {golden.get('_machine')}, this machine is {here}; bit-equality "
              "holds only on the recording kind of machine (module docstring): re-record on the code before your "
              "change with 'record --all', then check")
        return 3
    bad = [name for name, bindings in cases(tiny).items()
           if (not args.only or args.only in name) and not _run_one(args, golden, name, bindings)]
    if args.mode == "check":
        print("all equal" if not bad else f"{len(bad)} different: {bad}")
    return 1 if bad else 0


def _release_programs() -> None:
    """Drops the case's compiled programs (``jax.clear_caches``): each XLA:CPU executable holds its own mmap'd code
    sections, and ~100 cases of a few hundred programs each in one process passed Linux's default 65,530 memory
    maps (``vm.max_map_count``): the check died at case 96-100 with "LLVM compilation error: Cannot allocate memory"
    (twice, 2026-12-02). The next case reloads what it needs from the persistent compilation cache (the same
    programs, so no bit changes)."""
    import gc

    import jax
    jax.clear_caches()
    gc.collect()


def _run_one(args, golden: dict, name: str, bindings: list[str]) -> bool:
    """Record or check one case; False if it differs."""
    if args.mode == "record" and name in golden and not args.only:
        return True  # recorded already (re-record one with --only)
    t0 = time.time()
    with tempfile.TemporaryDirectory(dir=args.work) as d:
        try:
            got = run_case(bindings, os.path.join(d, "run"))
        except SystemExit as e:
            got = {"error": f"SystemExit {e.code}"}
        except Exception as e:  # noqa: BLE001  (a case the code refuses is recorded as its error line)
            got = {"error": f"{type(e).__name__}: {e}"}
    _release_programs()
    got = json.loads(json.dumps(got))
    ok = True
    if args.mode == "record":
        golden[name] = got
        json.dump(golden, open(GOLDEN, "w"), indent=0, sort_keys=True)
        status = "recorded" + (f" ({got['error']})" if "error" in got else "")
    else:
        ok = golden.get(name) == got
        status = "equal" if ok else "DIFFERENT"
        if not ok:
            _diff(golden.get(name), got)
    print(f"{name:45s} {status:10s} {time.time() - t0:6.1f} s", flush=True)
    return ok


def _diff(old, new) -> None:
    if old is None:
        print("   not recorded")
        return
    if "error" in old or "error" in new:
        print("   ", old.get("error"), "->", new.get("error"))
        return
    for i, (a, b) in enumerate(zip(old["steps"], new["steps"])):
        for k in sorted(set(a) | set(b)):
            if a.get(k) != b.get(k):
                print(f"   step {i} {k}: {a.get(k)} -> {b.get(k)}")
    for i, (a, b) in enumerate(zip(old["history"], new["history"])):
        for k in sorted(set(a) | set(b)):
            if a.get(k) != b.get(k):
                print(f"   history {i} {k}: {a.get(k)} -> {b.get(k)}")
    if len(old["steps"]) != len(new["steps"]):
        print(f"   steps {len(old['steps'])} -> {len(new['steps'])}")


if __name__ == "__main__":
    sys.exit(main())
