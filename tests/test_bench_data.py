"""`python -m tools.bench_data` in its smallest mode (--quick, corpora of 1 and 2 MB, one worker): its JSON
line carries every field, prepare and the encode_batch limit read the same documents into the same tokens,
and the temporary directory is gone afterwards. Timings are not checked (benchmarks are programs, not
timed tests)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_quick_mode_writes_every_field_and_cleans_up(tmp_path):
    out = tmp_path / "bench_data.json"
    done = subprocess.run([sys.executable, "-m", "tools.bench_data", "--sizes-mb", "1,2", "--quick", "--workers", "1",
                           "--repeats", "1", "--tmp-dir", str(tmp_path), "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    line = json.loads(done.stdout.strip().splitlines()[-1])
    assert line == json.loads(out.read_text())
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name]  # corpora, tokenizers, shards: removed

    assert (line["tool"], line["sizes_mb"], line["workers"], line["quick"]) == ("bench_data", [1.0, 2.0], 1, True)
    assert {"cpu", "nproc", "torch", "load_avg"} <= set(line["machine"])
    small, large = line["corpora"]
    assert (small["size"], large["size"]) == ("1 MB", "2 MB")
    assert 1e6 <= small["bytes"] < large["bytes"] and 2e6 <= large["bytes"]
    assert 0 < small["documents"] < large["documents"]
    vocab = line["tokenizers"]
    assert set(vocab) == {"wordpiece-30k", "bpe-4k"}  # --quick: no 32,000-id BPE, a 1,000-id WordPiece
    assert 0 < vocab["wordpiece-30k"] <= 1000 and 0 < vocab["bpe-4k"] <= 4096

    assert line["memory"] == []  # --quick runs no mpt train
    assert [(s["size"], s["index"]) for s in line["setup"]] == [
        ("1 MB", "built"), ("1 MB", "cached"), ("2 MB", "built"), ("2 MB", "cached")]
    assert all(len(s["seconds"]) == 1 and {"min_s", "median_s"} <= set(s) for s in line["setup"])

    rows = {(r["tokenizer"], r["size"]): r for r in line["prepare"]}
    assert list(rows) == [("wordpiece-30k", "1 MB"), ("bpe-4k", "1 MB"), ("bpe-4k", "2 MB")]
    for (name, size), row in rows.items():
        prep = row["prepare"]
        corpus = small if size == "1 MB" else large
        assert prep["documents"] == corpus["documents"]
        assert {"seconds", "own_seconds", "mb_s_per_worker", "own_mb_s_per_worker", "mb_per_cpu_s", "cpu_s",
                "main_cpu_s", "peak_rss_mib", "worker_peak_rss_mib", "processes", "shards"} <= set(prep)
        assert prep["peak_rss_mib"] > 0
        assert {"ratio", "ratio_own", "ratio_cpu"} <= set(row) and row["limit_size"] == "1 MB"
        if size == "2 MB":
            assert "limit" not in row and prep["tokens"] == large["tokens_bpe-4k"]
            continue
        limit = row["limit"]
        assert {"seconds", "mb_s_per_worker", "mb_per_cpu_s", "cpu_s", "peak_rss_mib"} <= set(limit)
        assert limit["documents"] == corpus["documents"]
        if name == "bpe-4k":  # prepare ends each document with <|endoftext|>, the limit encodes the text only
            assert prep["tokens"] == limit["tokens"] + corpus["documents"]
            assert prep["sequences"] == limit["sequences"] == corpus["documents"]
            assert "limit_sentences" not in row
        else:  # --split-sentences: sentences cut at whitespace WordPiece splits at anyway, no end token
            assert prep["tokens"] == limit["tokens"]
            assert prep["sequences"] > 2 * corpus["documents"]
            sentences = row["limit_sentences"]  # the limit that encodes prepare's sentences: the same ones
            assert (sentences["documents"], sentences["sequences"], sentences["tokens"]) == (
                prep["documents"], prep["sequences"], prep["tokens"])
            assert {"ratio_sentences", "ratio_own_sentences", "ratio_cpu_sentences"} <= set(row)
    assert rows[("bpe-4k", "1 MB")]["prepare"]["tokens"] == small["tokens_bpe-4k"]

    goals = line["goals"]
    assert goals["train_memory_flat"] is None
    assert set(goals) == {"train_memory_flat", "setup_under_2s", "prepare_ratio_0_8", "prepare_memory_flat"}
    assert all(isinstance(goals[k], bool) for k in ("setup_under_2s", "prepare_ratio_0_8", "prepare_memory_flat"))
