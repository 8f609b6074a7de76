import json
import os
import subprocess
import sys
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
from length_bench import wer_by_length  # noqa: E402


def result(ref: str, hyp: str, error=None):
    return SimpleNamespace(request=SimpleNamespace(text=ref), pred_text=hyp, error=error)


def test_wer_by_length_scores_each_bin_on_its_own_utterances():
    results = [result("a b c", "a b c"), result("a b c d", "a x c d"),  # 3-4 words: 1 error of 7
               result("one two three four five six", "one two three"),  # 5-6 words: 3 deletions of 6
               result("a b", "z z", error="unreadable")]  # a failed file is not scored
    wers, counts = wer_by_length(results, [3, 5, 7, 10])
    assert counts == [2, 1, 0]
    assert wers == [round(100 / 7, 2), 50.0, None]


def test_the_length_bench_decodes_and_ends_with_its_json(tmp_path):
    rows = [json.loads(line) for line in open(os.path.join(ROOT, "data", "mini", "dev.jsonl"))][:6]
    manifest = tmp_path / "dev.jsonl"
    manifest.write_text("".join(json.dumps({**r, "audio_filepath": os.path.join(ROOT, "data", "mini", r["audio_filepath"])})
                                + "\n" for r in rows))
    p = subprocess.run([sys.executable, "bench/length_bench.py", "--ckpt", "tests/fixtures/word_model.pt",
                        "--manifest", str(manifest), "--bins", "1", "6", "41", "--settings", "greedy, CTC 0.3",
                        "beam 4, CTC 0.3, length penalty 1"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    summary = json.loads(p.stdout.strip().splitlines()[-1])
    asr = sum(r["taskname"] == "asr" for r in rows)
    assert sum(summary["counts"]) == asr > 0
    assert [r["setting"] for r in summary["rows"]] == ["greedy, CTC 0.3", "beam 4, CTC 0.3, length penalty 1"]
    assert all(r["wer"] is not None and r["wer"] >= 0 for r in summary["rows"])
