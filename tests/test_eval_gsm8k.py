"""eval_gsm8k: the prompt, answer extraction and scoring on hand-made answers, the loader's errors;
and whole runs against the real mimo_fn server."""

import json
from pathlib import Path

import pytest

from mimo_fn.eval_gsm8k import build_prompts, extract_answer, format_example, load_gsm8k, score

DATA = Path(__file__).parent / "data" / "gsm8k_synthetic.jsonl"


@pytest.mark.parametrize("text, value", [
    ("Tom has 3 + 4 = 7 apples.\n#### 7", 7),
    (" She pays 1,234 dollars.", 1234),                 # commas dropped
    ("12 then 15 then finally 42", 42),                  # the last number
    ("about 3.75 hours", 75),                            # the standard scripts' digit runs: 75
    ("owes -5", 5),                                      # ... and no sign
    ("The answer is 18.\n\nQuestion: next 99", 99),      # what a stop string did not cut is read too
    ("no digits here", None),
    ("", None),
])
def test_extract_answer_takes_the_last_number(text, value):
    assert extract_answer(text) == value


def test_score_counts_correct_and_invalid():
    outputs = [" 5 + 2 = 7. #### 7", " It is 10", " I don't know", " 1,000 total", " 8"]
    labels = [7, 11, 3, 1000, 8]
    s = score([extract_answer(o) for o in outputs], labels)
    assert (s.num_correct, s.num_invalid) == (3, 1)
    assert s.accuracy == pytest.approx(3 / 5) and s.invalid == pytest.approx(1 / 5)
    assert score([None, None], [1, 2]).accuracy == 0.0
    with pytest.raises(ValueError):
        score([1], [1, 2])


def test_synthetic_set_loads_with_gsm8k_labels():
    examples = load_gsm8k(str(DATA))
    assert len(examples) == 40
    for ex in examples:
        assert "####" in ex.answer
        assert ex.label == int(ex.answer.rsplit("####", 1)[1].strip().replace(",", ""))
    assert any("," in ex.answer.rsplit("####", 1)[1] for ex in examples)   # exercises comma labels


def test_prompts_are_the_standard_few_shot_layout():
    examples = load_gsm8k(str(DATA))
    prompts, labels = build_prompts(examples, num_shots=2, num_questions=5)
    assert len(prompts) == 5 and labels == [ex.label for ex in examples[:5]]
    shots = (f"Question: {examples[0].question}\nAnswer: {examples[0].answer}\n\n"
             f"Question: {examples[1].question}\nAnswer: {examples[1].answer}\n\n")
    assert prompts[3] == shots + f"Question: {examples[3].question}\nAnswer:"
    assert format_example(examples[0], False) == f"Question: {examples[0].question}\nAnswer:"
    assert build_prompts(examples, 0, 1)[0] == [f"Question: {examples[0].question}\nAnswer:"]
    with pytest.raises(ValueError, match="num-shots"):
        build_prompts(examples, 41, 5)
    with pytest.raises(ValueError, match="num-questions"):
        build_prompts(examples, 1, 0)


def test_loader_names_the_bad_line(tmp_path):
    path = tmp_path / "g.jsonl"
    good = json.dumps({"question": "q", "answer": "a #### 3"})
    for bad, msg in (("{oops", "not valid JSON"), (json.dumps({"question": "q"}), "'question' and 'answer'"),
                     (json.dumps({"question": "q", "answer": "no number"}), "no number")):
        path.write_text(good + "\n\n" + bad + "\n")
        with pytest.raises(ValueError, match=msg) as e:
            load_gsm8k(str(path))
        assert "g.jsonl:3" in str(e.value)
