"""Chat-template prompt formatting with a locally built tokenizer (no hub downloads)."""

import pytest

from treejax.data.prompts import format_prompt, prepare_messages

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<|im_start|>": 1, "<|im_end|>": 2, "hello": 3}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<|im_start|>",
                                   eos_token="<|im_end|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def test_format_prompt_renders_chat_template(tokenizer):
    text = format_prompt(tokenizer, [{"role": "user", "content": "What is 2+2?"}],
                         system_prompt="Be brief.", instruction="Put the answer in \\boxed{}.")
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?\n\nPut the answer in \\boxed{}.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_format_prompt_of_task_example_matches_direct_template(tokenizer):
    from treejax.data.tasks import get_task

    task = get_task("chain_sum_2x1", size=3, eval_size=1, system_prompt="SYS", instruction="INSTR")
    ex = next(task.examples("train"))
    expected = tokenizer.apply_chat_template(
        [{"role": "system", "content": "SYS"},
         {"role": "user", "content": ex.metadata["question"] + "\n\nINSTR"}],
        add_generation_prompt=True, tokenize=False)
    assert format_prompt(tokenizer, ex.prompt_messages) == expected


def test_instruction_goes_to_last_user_message_and_input_not_mutated():
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    out = prepare_messages(msgs, instruction="I")
    assert [m["content"] for m in out] == ["a", "b", "c\n\nI"]
    assert msgs[2]["content"] == "c"


class _StubTokenizer:
    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        assert add_generation_prompt is True and tokenize is False
        return "|".join(f"{m['role']}:{m['content']}" for m in messages) + "|assistant:"


def test_stub_tokenizer_and_errors():
    assert format_prompt(_StubTokenizer(), [{"role": "user", "content": "q"}]) == "user:q|assistant:"
    with pytest.raises(ValueError, match="already start with a system"):
        prepare_messages([{"role": "system", "content": "s"}, {"role": "user", "content": "q"}], system_prompt="x")
    with pytest.raises(ValueError, match="unknown role"):
        prepare_messages([{"role": "robot", "content": "q"}])
    with pytest.raises(ValueError, match="empty"):
        prepare_messages([])
    with pytest.raises(ValueError, match="no user message"):
        prepare_messages([{"role": "system", "content": "s"}], instruction="I")
    with pytest.raises(TypeError, match="apply_chat_template"):
        format_prompt(object(), [{"role": "user", "content": "q"}])
