"""The README's "Using it" snippets run as written (issue 44): every python block of that
section, but the one whose first line is the real-checkpoint marker, executed in order in one
namespace on the tiny model on the CPU. A block that raises fails the test, and the blocks
check what they claim where they can (decode after prefill equals forward)."""

import contextlib
import io
import os
import re

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECTION = "## Using it"
MARKER = "# needs a checkpoint"


def using_it_blocks() -> list[tuple[int, str]]:
    """(first line number, code) of each ```python block in the README's "Using it" section."""
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    section = text[start:end if end >= 0 else len(text)]
    line0 = text[:start].count("\n") + 1
    return [(line0 + section[:m.start()].count("\n") + 1, m.group(1))
            for m in re.finditer(r"```python\n(.*?)```", section, re.S)]


def test_blocks_found():
    blocks = using_it_blocks()
    marked = [code for _, code in blocks if code.startswith(MARKER)]
    assert len(blocks) >= 4 and len(marked) == 1, f"{len(blocks)} blocks, {len(marked)} marked {MARKER!r}"
    assert "mf.load_checkpoint(" in marked[0]  # the real-checkpoint one loads one
    assert all("load_checkpoint" not in code for _, code in blocks if not code.startswith(MARKER))


def test_using_it_runs_as_written():
    namespace: dict = {"__name__": "__readme__"}
    ran = 0
    torch.manual_seed(0)
    for line, code in using_it_blocks():
        if code.startswith(MARKER):
            continue
        try:  # the snippets print what they show; keep the test's output to failures
            with contextlib.redirect_stdout(io.StringIO()):
                exec(compile(code, f"README.md (block at line {line})", "exec"), namespace)
        except Exception as e:
            raise AssertionError(f"the README block at line {line} fails: {e!r}") from e
        ran += 1
    assert ran >= 3
    # what the snippets say they did
    assert len(namespace["outs"]) == 1 and namespace["chat"].prefix_stats["hits"] == 1
    assert namespace["out"].finish_reason in ("length", "stop")
    assert not namespace["engine"].has_unfinished()
    assert namespace["engine"].server_info()["num_used_pages"] == 0
