"""One process of ``tests/rl/test_sapo.py``'s 2-process exchange (started by ``treejax.launch --module
sapo_worker -- OUT``): a fake planner whose rows carry this process's index and the step in their tokens, rewards
and prompts, wrapped in :class:`treejax.rl.sapo.SAPORollouts` with the real key-value exchange; writes what it
sent and what it trained on to ``OUT/sapo{i}.json``."""

from __future__ import annotations

import json
import os
import sys

import jax
import numpy as np


def main(out_dir: str) -> None:
    from sapo_fakes import FakeSource, fake_score

    from treejax.rl.sapo import KVExchange, SAPOConfig, SAPORollouts

    pid = jax.process_index()
    src = SAPORollouts(FakeSource(pid), SAPOConfig(external_rows=2, sampling="uniform"), None, KVExchange(60),
                       score_fn=fake_score)
    out = {"process": pid, "steps": []}
    for step in range(3):
        ro = src.sample(None, jax.random.key(0), step)
        sent = src.base.last
        out["steps"].append({
            "sent_tokens": np.asarray(sent.forest.tokens).tolist(), "sent_rewards": np.asarray(sent.rewards_PxW).tolist(),
            "sent_prompts": np.asarray(sent.prompts_PxLp).tolist(),
            "tokens": np.asarray(ro.forest.tokens).tolist(), "rewards": np.asarray(ro.rewards_PxW).tolist(),
            "prompts": np.asarray(ro.prompts_PxLp).tolist(), "logprobs": np.asarray(ro.forest.logprobs).tolist(),
            "loss_mask": np.asarray(ro.forest.loss_mask).tolist(), "examples": ro.examples,
            "metrics": ro.extra_metrics})
    with open(os.path.join(out_dir, f"sapo{pid}.json"), "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    from treejax.parallel.multihost import maybe_initialize_distributed

    if not maybe_initialize_distributed():
        sys.exit("sapo_worker: no JAX_COORDINATOR_ADDRESS in the environment")
    main(sys.argv[1])
