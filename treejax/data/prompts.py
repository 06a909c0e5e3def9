"""Prompt formatting through the tokenizer's chat template.

``format_prompt(tokenizer, messages, system_prompt=None, instruction=None)`` renders
``tokenizer.apply_chat_template(messages', add_generation_prompt=True, tokenize=False)`` where ``messages'`` is
``messages`` with

  - ``system_prompt`` (if given) inserted as a leading ``{"role": "system"}`` message — an error if the messages
    already start with a system message (two system prompts would be ambiguous);
  - ``instruction`` (if given) appended to the content of the LAST user message after a blank line
    (``"<question>\\n\\n<instruction>"``), the common place for an answer-format instruction such as
    "put your final answer within \\boxed{}".

``encode_examples`` / ``encode_prompts`` turn task examples into token lists through the template, and
``pad_token_lists`` right-pads them into the sampler's ``[N, width]`` prompt array (the training loop, the
evaluation and the notebooks all encode prompts this one way).

Any tokenizer with HF-compatible ``apply_chat_template`` works (transformers tokenizers, the treejax wrapper).
Tasks already put their gin-configured system prompt and instruction into ``Example.prompt_messages``; the extra
arguments are for ad-hoc use (notebooks, evaluation of raw questions).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np

__all__ = ["format_prompt", "prepare_messages", "encode_examples", "encode_prompts", "pad_token_lists"]

_ROLES = ("system", "user", "assistant", "tool")


def prepare_messages(
    messages: Sequence[dict], system_prompt: Optional[str] = None, instruction: Optional[str] = None
) -> list[dict]:
    """Validated copy of ``messages`` with the system prompt and instruction added (see module docstring)."""
    out: list[dict] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"message {i} must be a dict with 'role' and 'content', got {m!r}")
        if m["role"] not in _ROLES:
            raise ValueError(f"message {i} has unknown role {m['role']!r}; valid roles: {list(_ROLES)}")
        out.append(dict(m))
    if not out:
        raise ValueError("messages is empty")
    if instruction:
        users = [i for i, m in enumerate(out) if m["role"] == "user"]
        if not users:
            raise ValueError("an instruction was given but the messages contain no user message")
        last = users[-1]
        out[last]["content"] = f"{out[last]['content']}\n\n{instruction}"
    if system_prompt:
        if out[0]["role"] == "system":
            raise ValueError("system_prompt was given but the messages already start with a system message")
        out.insert(0, {"role": "system", "content": system_prompt})
    return out


def format_prompt(
    tokenizer: Any,
    messages: Sequence[dict],
    system_prompt: Optional[str] = None,
    instruction: Optional[str] = None,
) -> str:
    """The prompt string ready for generation (ends with the assistant turn's opening)."""
    if not hasattr(tokenizer, "apply_chat_template"):
        raise TypeError(f"{type(tokenizer).__name__} has no apply_chat_template method")
    msgs = prepare_messages(messages, system_prompt, instruction)
    text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    if not isinstance(text, str):
        raise TypeError(f"apply_chat_template(tokenize=False) returned {type(text).__name__}, expected str")
    return text


def encode_examples(tokenizer, examples, system_prompt=None, instruction=None) -> list[list[int]]:
    """Examples -> token lists through the chat template (``None`` keeps the task's system prompt/instruction)."""
    texts = [format_prompt(tokenizer, ex.prompt_messages, system_prompt=system_prompt, instruction=instruction)
             for ex in examples]
    return [tokenizer.encode(t) for t in texts]


def encode_prompts(tokenizer, task, records, system_prompt=None, instruction=None):
    """Records -> (examples, token lists) through the task and the chat template."""
    examples = [task.make_example(r) for r in records]
    return examples, encode_examples(tokenizer, examples, system_prompt, instruction)


def pad_token_lists(token_lists, width: int | None = None, pad_id: int = 0):
    """Right-pads token lists into ``([N, width] int32, lengths [N])``."""
    lens = np.array([len(t) for t in token_lists], np.int32)
    width = int(lens.max()) if width is None else width
    if lens.max() > width:
        raise ValueError(f"a prompt of {lens.max()} tokens exceeds the prompt width {width}")
    out = np.full((len(token_lists), width), pad_id, np.int32)
    for i, t in enumerate(token_lists):
        out[i, : len(t)] = t
    return out, lens
