"""Verifier table of tricky cases: extraction, equivalence, rewards, format rewards."""

import numpy as np
import pytest

from treejax.data import verifiers as V

# (response, ground truth, expected score)
TABLE = [
    # fractions and LaTeX forms
    ("The answer is \\boxed{\\frac{1}{2}}.", "0.5", 1.0),
    ("so $\\boxed{\\dfrac{3}{4}}$", "3/4", 1.0),
    ("\\boxed{\\frac34}", "0.75", 1.0),
    ("Final answer: 1/3", "\\frac{1}{3}", 1.0),
    ("\\boxed{0.333}", "1/3", 0.0),
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt3}{2}", 1.0),
    ("\\boxed{x^2+2x+1}", "(x+1)^2", 1.0),
    ("\\boxed{2\\sqrt{3}}", "\\sqrt{12}", 1.0),
    ("\\boxed{\\pi}", "3.14159", 0.0),
    ("\\boxed{\\{1, 2\\}}", "\\{1,2\\}", 1.0),
    # thousands separators
    ("#### 1,234", "1234", 1.0),
    ("\\boxed{14,400}", "14400", 1.0),
    ("\\boxed{1{,}000}", "1000", 1.0),
    ("\\boxed{1,000}", "100", 0.0),
    # negative numbers
    ("The answer is -5.", "-5", 1.0),
    ("The answer is \u22125.", "-5", 1.0),
    ("\\boxed{(-3)}", "-3", 1.0),
    ("\\boxed{5}", "-5", 0.0),
    # units, currency, percent
    ("\\boxed{5 \\text{ cm}}", "5", 1.0),
    ("She pays $18. #### $18", "18", 1.0),
    ("The answer is 12 dollars.", "12", 1.0),
    ("the answer is 50%", "50", 1.0),
    ("\\boxed{90^\\circ}", "90", 1.0),
    # several boxed answers: the last one counts
    ("First \\boxed{3}, then corrected: \\boxed{4}", "4", 1.0),
    ("First \\boxed{3}, then corrected: \\boxed{4}", "3", 0.0),
    ("\\boxed{3} and then \\boxed{\\frac{1", "3", 0.0),  # truncated final boxed: no answer
    # no answer at all
    ("I am not sure how to solve this.", "4", 0.0),
    ("", "4", 0.0),
    ("\\boxed{}", "4", 0.0),
    # the right answer hidden in the reasoning but not final
    ("2 + 2 is 4, so we still need to subtract one", "4", 0.0),
    ("The answer is 42. Wait, recomputing: the answer is 41.", "42", 0.0),
    ("We get \\boxed{42} at first, but then #### 41", "42", 0.0),
    ("Since 6*7 = 42 ... <answer>41</answer>", "42", 0.0),
    # numeric tolerance
    ("\\boxed{2.5000001}", "2.5", 1.0),
    ("\\boxed{2.51}", "2.5", 0.0),
    ("\\boxed{x = 7}", "7", 1.0),
    ("\\boxed{1000001}", "1000000", 0.0),  # integers compare exactly, no relative tolerance
    ("\\boxed{1000000.0}", "1000000", 1.0),
]


@pytest.mark.parametrize("response,gold,expected", TABLE)
def test_verifier_table(response, gold, expected):
    assert V.math_score(response, gold) == expected


@pytest.mark.parametrize(
    "text,mode,expected",
    [
        ("a \\boxed{\\frac{a}{b^{2}}} b", "boxed", "\\frac{a}{b^{2}}"),  # nested braces
        ("\\boxed{1} \\boxed{2} \\fbox{3}", "boxed", "3"),
        ("\\boxed 7 is it", "boxed", "7"),
        ("blah\n#### 72\n", "gsm8k", "72"),
        ("The final answer is $\\frac{1}{2}$.", "phrase", "\\frac{1}{2}"),
        ("The answer is 3.5. Done", "phrase", "3.5"),
        ("<answer> x </answer> <answer>y</answer>", "tags", "y"),
        ("The answer is \\boxed{5}.", "auto", "5"),
        ("We compute 3 then 17.", "auto", None),
        ("We compute 3 then 17.", "last_number", "17"),
        ("We compute 3 then \\boxed{8}, then 17.", "last_number", "8"),  # a marker beats the fallback
        # tags_or_boxed: the positionally last of the answer tags and a complete boxed value, nothing looser
        ("So 3 + 4 = 7.\n<answer>7</answer>", "tags_or_boxed", "7"),
        ("Total: $12 + 30 = 42$.\n\\[\n\\boxed{42}\n\\]", "tags_or_boxed", "42"),  # GSM-style, no tags
        ("<answer>5</answer> on reflection \\boxed{6}", "tags_or_boxed", "6"),
        ("\\boxed{6} so <answer>5</answer>", "tags_or_boxed", "5"),
        ("<answer>\\boxed{9}</answer>", "tags_or_boxed", "9"),
        ("The answer is 3.", "tags_or_boxed", None),  # a phrase is not accepted here ("auto" takes it)
        ("We get 3 then 17.", "tags_or_boxed", None),
        ("\\boxed{2} then \\boxed{1", "tags_or_boxed", None),  # truncated final boxed: no earlier fallback
        ("<answer>4</answer> and \\boxed{1", "tags_or_boxed", "4"),  # the closed tag stands
    ],
)
def test_extraction(text, mode, expected):
    assert V.extract_answer(text, mode) == expected


def test_unknown_extraction_mode_lists_valid():
    with pytest.raises(ValueError, match="valid modes"):
        V.extract_answer("x", "nope")


@pytest.mark.parametrize(
    "text,value",
    [("-1,234.5", V.Fraction("-2469/2")), ("3/4", V.Fraction(3, 4)), ("\\dfrac{3}{4}", V.Fraction(3, 4)),
     ("$18", 18), ("12 cm", 12), ("\\frac{-2}{4}", V.Fraction(-1, 2)), ("2\\sqrt{3}", None), ("5x", None),
     ("(1, 2)", None), ("1/0", None)],
)
def test_parse_number(text, value):
    assert V.parse_number(text) == value


def test_reward_scales():
    assert V.reward(1.0, "pm1") == 1.0 and V.reward(0.0, "pm1") == -1.0 and V.reward(0.25, "pm1") == -0.5
    assert V.reward(1.0, "01") == 1.0 and V.reward(0.0, "01") == 0.0
    np.testing.assert_array_equal(V.reward(np.array([0.0, 1.0]), "pm1"), np.array([-1.0, 1.0]))
    with pytest.raises(ValueError, match="scale"):
        V.reward(1.0, "pm2")
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        V.reward(1.5)


def test_reward_is_jittable():
    import jax
    import jax.numpy as jnp

    out = jax.jit(lambda s: V.reward(s, "pm1"))(jnp.array([0.0, 0.5, 1.0]))
    np.testing.assert_allclose(np.asarray(out), [-1.0, 0.0, 1.0])


@pytest.mark.parametrize(
    "text,style,expected",
    [
        ("<think>2+2</think>\n<answer>4</answer>", "think_answer", 1.0),
        ("<think>2+2</think> extra <answer>4</answer>", "think_answer", 0.0),
        ("<answer>4</answer> trailing words", "answer_tags", 0.0),
        ("reasoning <answer>4</answer>", "answer_tags", 1.0),
        ("<answer>4</answer><answer>5</answer>", "answer_tags", 0.0),
        ("so \\boxed{4}.", "boxed", 1.0),
        ("\\boxed{3} \\boxed{4}", "boxed", 0.0),
        ("work\n#### 4", "gsm8k", 1.0),
    ],
)
def test_format_score(text, style, expected):
    assert V.format_score(text, style) == expected
