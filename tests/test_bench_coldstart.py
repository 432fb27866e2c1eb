"""`python -m mimo_fn.bench coldstart` on the CPU (the tiny model): each part runs in its own
process and comes back as a row; the first start run is the cold-disk one."""

import json
import os

from mimo_fn.bench import cli, coldstart


def test_coldstart_runs_its_parts_in_fresh_processes(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # the children too
    path = tmp_path / "rows.jsonl"
    cli.main(["coldstart", "--device", "cpu", "--prompts", "2", "--isl", "24", "--chunk", "128",
              "--max-total-tokens", "512", "--runs", "1", "--repeats", "1", "--json", str(path)])
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["params"]["part"], r["params"].get("case")) for r in rows] == [("start", "cold disk"), ("load", None)]
    start, load = rows[0]["results"], rows[1]["results"]
    assert min(start["warmup_s"], start["first_s"], start["steady_s"]) > 0
    assert start["first_over_steady"] == start["first_s"] / start["steady_s"]
    assert load["gb"] > 0 and load["files"] == 1
    assert load["raw_gb_s"] == load["gb"] / load["raw_s"] and load["load_gb_s"] == load["gb"] / load["load_s"]
    out = capsys.readouterr().out
    assert "first/steady" in out and "load GB/s" in out


def test_evict_drops_pages_or_says_it_cannot(tmp_path):
    f = tmp_path / "x.bin"
    f.write_bytes(b"\0" * 4096)
    assert coldstart.evict([str(f)]) is hasattr(os, "posix_fadvise")
    assert f.read_bytes() == b"\0" * 4096
