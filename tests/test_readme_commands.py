"""The commands of README's "Transcribe and translate" and "Run an aed model elsewhere" sections, read
from README.md and run as written, on a model trained the way `make demo` trains (configs/tiny.yaml,
a few steps here), in a folder that holds what they name (runs/demo, a.wav, test.jsonl, ...).

A microphone is the one thing replaced: `arecord ... | python infer.py ... --stream -` gets a
file's raw 16 kHz PCM on standard input instead. What each export holds is checked by the export's
own tests; here each runs to the end, and the sherpa-onnx layout is decoded by sherpa-onnx.
"""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from aed.data_audio import load_audio

ROOT = Path(__file__).resolve().parents[1]
MINI = ROOT / "data" / "mini"
SECTIONS = ("Transcribe and translate", "Run an aed model elsewhere")
pytestmark = pytest.mark.slow(seconds=240)


def readme_blocks(section: str, language: str) -> list[str]:
    """The fenced `language` blocks of README.md's section `## {section}`."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    body = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(rf"```{language}\n(.*?)```", body, flags=re.S)


def readme_commands(section: str) -> list[str]:
    """Each command line of the section's bash blocks, its trailing comment removed."""
    lines = [line for block in readme_blocks(section, "bash") for line in block.splitlines()]
    return [re.sub(r"\s+#.*$", "", line).strip() for line in lines if line.strip()]


def test_the_sections_show_what_this_test_runs():
    commands = [c for s in SECTIONS for c in readme_commands(s)]
    assert len(commands) == 9, commands
    assert all(c.startswith("python ") or c.startswith("arecord ") for c in commands), commands
    assert len(readme_blocks("Transcribe and translate", "python")) == 1


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """A folder with runs/demo (configs/tiny.yaml, 12 steps), run/ckpt-00010000 (its checkpoint) and the
    inputs the commands name."""
    work = tmp_path_factory.mktemp("readme")
    p = subprocess.run([sys.executable, "train.py", "configs/tiny.yaml", f"run_dir={work / 'runs' / 'demo'}",
                        "max_steps=12", "ckpt_every=12", "log_every=6", "val.every=0"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    (ckpt,) = sorted((work / "runs" / "demo").glob("ckpt-*"))
    (work / "run").mkdir()
    shutil.copytree(ckpt, work / "run" / "ckpt-00010000")
    for name in ("tools", "infer.py"):
        (work / name).symlink_to(ROOT / name)
    examples = MINI / "examples"
    shutil.copy(examples / "en_asr_16k.wav", work / "a.wav")
    shutil.copy(examples / "en_asr_16k.wav", work / "talk.wav")
    for folder, source in (("recordings", "dev_de_000001.flac"), ("more", "dev_fr_000002.flac")):
        (work / folder).mkdir()
        shutil.copy(MINI / "audio" / source, work / folder / source)
    with open(MINI / "digits" / "dev.jsonl", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f][:6]
    with open(work / "test.jsonl", "w", encoding="utf-8") as f:
        for row in rows:
            row["audio_filepath"] = str(MINI / "digits" / row["audio_filepath"])
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return work


def run(command: str, cwd: Path, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    argv = shlex.split(command)
    assert argv[0] == "python", command
    p = subprocess.run([sys.executable, *argv[1:]], cwd=cwd, input=stdin, capture_output=True, timeout=900)
    assert p.returncode == 0, f"{command}\n{p.stderr.decode(errors='replace')[-3000:]}"
    return p


@pytest.mark.parametrize("section", SECTIONS)
def test_every_command_runs_as_written(demo, section):
    for command in readme_commands(section):
        if command.startswith("arecord "):  # the microphone: a file's raw PCM instead
            pcm = (load_audio(demo / "a.wav") * 32767).short().numpy().tobytes()
            p = run(command.split("|", 1)[1].strip(), demo, stdin=pcm)
            assert b"s of audio" in p.stderr and b"real-time factor" in p.stderr, command  # a 12-step model may hear no words
        else:
            run(command, demo)
    if section == "Transcribe and translate":
        hyps = [json.loads(line) for line in (demo / "hyp.jsonl").read_text().splitlines()]
        assert len(hyps) >= 1 and all("pred_text" in h for h in hyps)
        assert any(demo.joinpath("subs").iterdir())
    else:
        assert (demo / "demo.nemo").stat().st_size > 0
        assert (demo / "hf" / "demo" / "config.json").exists()
        assert (demo / "onnx" / "demo" / "sherpa" / "tokens.txt").exists()


def test_the_python_example_runs(demo):
    (code,) = readme_blocks("Transcribe and translate", "python")
    p = subprocess.run([sys.executable, "-c", code], cwd=demo, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stderr[-3000:]


def test_sherpa_onnx_decodes_the_readme_export_as_aed(demo):
    """The README's sherpa-onnx export of the demo model, decoded by sherpa-onnx: a canary2 model, which
    the runtime's prompt requires, with aed's tokens on most files (its features are its own)."""
    sherpa_onnx = pytest.importorskip("sherpa_onnx", reason="pip install sherpa-onnx (tests/requirements-onnx.txt)")
    from test_export_onnx import same_stop, sherpa_limit

    from aed.decode_transcribe import transcribe
    from aed.model_checkpoint import load_model

    d = demo / "onnx" / "demo" / "sherpa"
    if not d.exists():
        run(readme_commands("Run an aed model elsewhere")[2], demo)
    asr = load_model(str(demo / "runs" / "demo"))
    assert asr.tokenizer.prompt_format == "canary2"
    symbols = {int(i): s.replace("\u2581", " ")
               for s, i in (line.split(" ") for line in (d / "tokens.txt").read_text(encoding="utf-8").splitlines())}
    recognizer = sherpa_onnx.OfflineRecognizer.from_nemo_canary(
        encoder=str(d / "encoder.onnx"), decoder=str(d / "decoder.onnx"), tokens=str(d / "tokens.txt"),
        feature_dim=asr.features.n_mels, num_threads=1)
    rows = [json.loads(line) for line in (demo / "test.jsonl").read_text().splitlines()]
    equal = 0
    for row in rows:
        wav = load_audio(row["audio_filepath"])
        stream = recognizer.create_stream()
        stream.accept_waveform(16000, wav.numpy())
        recognizer.decode_stream(stream)
        limit = sherpa_limit(asr, (wav.numel() + 80) // 160)  # kaldi-native-fbank's frames (snip_edges=false)
        results, _ = transcribe(asr, [row["audio_filepath"]], same_stop(limit), source_lang="en", target_lang="en")
        equal += list(stream.result.tokens) == [symbols[i] for i in results[0].tokens]
    assert equal >= len(rows) - 2, f"sherpa-onnx tokens equal aed's on {equal} of {len(rows)} files"
