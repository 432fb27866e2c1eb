"""examples/colocated_grpo.py runs: 3 GRPO steps on the tiny model in fp32 on the CPU, with the
engine in this process and as a server in its own process.

Every step's trainer-vs-engine log-prob difference is under 1e-4: from step 2 on the engine
samples with the weights the trainer pushed after step 1 while the trainer computes with its own,
so this also says that each sync landed whole. And the weights did move: the engine's log-probs
of fixed held-out sequences differ between steps 1 and 3.
"""

import importlib.util
import os

from serve_util import ROOT, one_torch_thread  # noqa: F401  (a fixture)

STEPS = ["--steps", "3", "--prompts", "2", "--samples", "4", "--seed", "1"]


def load_example():
    spec = importlib.util.spec_from_file_location("colocated_grpo", os.path.join(ROOT, "examples", "colocated_grpo.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_history(history: list[dict]) -> None:
    assert [row["step"] for row in history] == [1, 2, 3]
    for row in history:
        assert row["logprob_diff_max"] < 1e-4, row
        assert 0.0 <= row["reward"] <= 1.0
    assert abs(history[0]["heldout_answer_logprob"] - history[2]["heldout_answer_logprob"]) > 1e-3, history


def test_grpo_example_in_process(one_torch_thread):  # noqa: F811
    check_history(load_example().main(["--in-process", *STEPS]))


def test_grpo_example_over_the_server(one_torch_thread, monkeypatch):  # noqa: F811
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the server's, beside this process on two shared cores
    check_history(load_example().main(STEPS))
