"""TEMPORARY stand-in (replaced by the evaluation module with pass@k); greedy accuracy only."""
from __future__ import annotations

import dataclasses

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    num_problems: int = 32
    max_new_tokens: int = 128
    batch_size: int = 32
    k: int = 0
    temperature: float = 1.0
    seed: int = 0


def evaluate(params, model_config, tokenizer, task, examples, prompt_width, config, system_prompt=None,
             instruction=None):
    from treejax.rl.loop import encode_examples, pad_token_lists
    from treejax.sampling.decode import generate
    from treejax.sampling.strategies import Greedy

    correct, lengths = [], []
    bs = config.batch_size
    for i in range(0, len(examples), bs):
        chunk = examples[i: i + bs]
        toks = encode_examples(tokenizer, chunk, system_prompt, instruction)
        toks = toks + [toks[0]] * (bs - len(toks))
        prompts, lens = pad_token_lists(toks, prompt_width, tokenizer.pad_id or 0)
        out = generate(params, model_config, prompts, lens, jax.random.key(0), config.max_new_tokens, Greedy(),
                       stop_ids=tokenizer.eos_ids)
        out_tokens, out_lens = np.asarray(out.tokens), np.asarray(out.lengths)
        for j, ex in enumerate(chunk):
            text = tokenizer.decode(out_tokens[j, : out_lens[j]].tolist(), skip_special_tokens=True)
            correct.append(task.score(text, ex) >= 1.0)
            lengths.append(out_lens[j])
    return {"accuracy": float(np.mean(correct)), "mean_length": float(np.mean(lengths)), "n": len(correct)}
