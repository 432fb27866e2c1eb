"""eval_gsm8k: the prompt, answer extraction and scoring on hand-made answers, the loader's errors;
and whole runs against the real mimo_fn server."""

import json
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from mimo_fn.eval_gsm8k import build_prompts, extract_answer, format_example, load_gsm8k, main, score
from serve_util import ROOT, child_env, start_server

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


# --- end to end, against the real server --------------------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(str(tmp_path_factory.mktemp("serve")))
    yield srv.url
    srv.stop()


def run_eval(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mimo_fn.eval_gsm8k", *args], cwd=ROOT, env=child_env(),
                          capture_output=True, text=True, timeout=300)


def test_two_runs_with_a_flush_between_have_no_api_errors(server, tmp_path):
    answers, rows = tmp_path / "answers.jsonl", tmp_path / "rows.jsonl"
    proc = run_eval("--base-url", server, "--data", str(DATA), "--num-shots", "2", "--num-questions", "4",
                    "--parallel", "4", "--max-new-tokens", "10", "--repeat", "2", "--flush-between",
                    "--answers-file", str(answers), "--output-file", str(rows))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for key in ("Accuracy: ", "Invalid: ", "API errors: 0", "Latency: ", "Output throughput: ", "Accept length: "):
        assert proc.stdout.count(key) == 2, proc.stdout
    assert "questions: 100%" in proc.stderr
    runs = [json.loads(line) for line in rows.read_text().splitlines()]
    assert [r["api_errors"] for r in runs] == [0, 0] and all(r["output_throughput"] > 0 for r in runs)
    got = [json.loads(line) for line in answers.read_text().splitlines()]
    assert len(got) == 8 and not any(g["error"] for g in got)
    labels = [ex.label for ex in load_gsm8k(str(DATA))[:4]]
    for g in got:   # each prediction and its verdict, recomputed from the output the server sent
        assert g["pred"] == extract_answer(g["output"]) and g["label"] == labels[g["index"]]
        assert g["correct"] == (g["pred"] == g["label"])
    first, second = got[:4], got[4:]
    assert [g["output"] for g in first] == [g["output"] for g in second]   # greedy: the same after the flush
    accuracy = sum(g["correct"] for g in first) / 4
    assert f"Accuracy: {accuracy:.3f}" in proc.stdout and runs[0]["accuracy"] == pytest.approx(accuracy)


def test_openai_backend_run_has_no_api_errors(server):
    proc = run_eval("--backend", "openai", "--base-url", server, "--data", str(DATA), "--num-shots", "1",
                    "--num-questions", "3", "--parallel", "3", "--max-new-tokens", "8", "--disable-tqdm")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "API errors: 0" in proc.stdout


def test_a_speculating_server_reports_its_accept_length(tmp_path):
    srv = start_server(str(tmp_path), "--speculative-num-draft-tokens", "3")
    try:
        proc = run_eval("--base-url", srv.url, "--data", str(DATA), "--num-shots", "1", "--num-questions", "2",
                        "--max-new-tokens", "16", "--output-file", str(tmp_path / "rows.jsonl"), "--disable-tqdm")
        info = httpx.get(srv.url + "/get_server_info", timeout=10).json()
    finally:
        srv.stop()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    row = json.loads((tmp_path / "rows.jsonl").read_text())
    # prompt-lookup drafts: at least the bonus token a verify step, at most all drafts and it
    assert 1.0 <= row["accept_length"] <= 4.0 and row["accept_length"] == info["avg_spec_accept_length"]
    assert f"Accept length: {row['accept_length']:.3f}" in proc.stdout


def test_a_server_that_is_not_there_gives_api_errors_and_exit_1(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]     # nothing listens there once the socket closes
    assert main(["--base-url", f"http://127.0.0.1:{port}", "--data", str(DATA), "--num-questions", "2",
                 "--num-shots", "1", "--disable-tqdm"]) == 1
    out, err = capsys.readouterr()
    assert "API errors: 2" in out and "Accuracy: 0.000" in out and "ConnectError" in err


def test_bad_arguments_exit_2_naming_them(tmp_path, capsys):
    assert main(["--data", str(tmp_path / "missing.jsonl")]) == 2
    assert "missing.jsonl" in capsys.readouterr().err
    assert main(["--data", str(DATA), "--num-shots", "50"]) == 2
    assert "--num-shots 50" in capsys.readouterr().err
