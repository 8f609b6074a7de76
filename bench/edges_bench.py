"""Does a model hear the words or the edges? The same utterances decoded as they are and with their
edges changed as recordings and runtimes change them, WER per variant.

    python bench/edges_bench.py --ckpt runs/demo --manifest data/mini/digits/dev.jsonl

Variants of every file of the manifest (written as 16-bit WAV under --work-dir, then decoded with
`aed.transcribe` and infer.py's default decoding):

- as is
- 50 ms / 0.5 s of digital silence added before and after
- a brown-noise floor at --floor-dbfs under the file, nothing added
- 0.5 s added before and after, with that floor under everything
- NeMo's transcribe(): a file shorter than 1 s padded with zeros on both sides to 1 s (its
  `pad_min_duration: 1.0`, `pad_direction: both`)
- 20 ms late / early: the first 20 ms cut, or 20 ms of silence added before only

The target a robust model meets: every variant's WER <= the unchanged WER x 1.1 + 2 points (`ok`).
A table, then one JSON line: {"variants": {name: {"wer": .., "ok": ..}}, "bound": .., "all_ok": ..}.
"""

import argparse
import os
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import soundfile as sf
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from aed.data_audio import load_audio  # noqa: E402
from aed.decode_metrics import wer  # noqa: E402
from aed.decode_transcribe import read_requests, transcribe  # noqa: E402
from aed.model_checkpoint import load_model  # noqa: E402
from common import log, print_json, print_table  # noqa: E402

RATE = 16000
NEMO_MIN_SECONDS = 1.0  # NeMo's transcribe(): pad_min_duration


def brown(rng: np.random.Generator, n: int, dbfs: float) -> np.ndarray:
    """n samples of brown noise (power ~ 1/f^2, no DC) at an RMS of `dbfs` dB full scale."""
    spec = np.fft.rfft(rng.standard_normal(n))
    spec[1:] /= np.arange(1, spec.size)  # amplitude ~ 1/f
    spec[0] = 0
    x = np.fft.irfft(spec, n)
    return x * 10 ** (dbfs / 20) / max(np.sqrt(np.mean(x**2)), 1e-12)


def pad(wav: np.ndarray, before: float, after: float) -> np.ndarray:
    return np.concatenate([np.zeros(round(before * RATE)), wav, np.zeros(round(after * RATE))])


def variants(floor_dbfs: float) -> dict:
    """name -> (wav (S,) float64, rng) -> wav: each a change a recording or a runtime makes."""
    def floored(wav, rng):
        return wav + brown(rng, wav.size, floor_dbfs)

    def nemo(wav, rng):
        short = max(0.0, NEMO_MIN_SECONDS - wav.size / RATE)
        return pad(wav, short / 2, short / 2)

    return {
        "as is": lambda wav, rng: wav,
        "+50 ms": lambda wav, rng: pad(wav, 0.05, 0.05),
        "+0.5 s": lambda wav, rng: pad(wav, 0.5, 0.5),
        f"floor {floor_dbfs:g} dBFS": floored,
        f"+0.5 s, floor {floor_dbfs:g} dBFS": lambda wav, rng: floored(pad(wav, 0.5, 0.5), rng),
        "NeMo 1 s padding": nemo,
        "20 ms late": lambda wav, rng: wav[round(0.02 * RATE):],
        "20 ms early": lambda wav, rng: pad(wav, 0.02, 0.0),
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", required=True, help="checkpoint file or run directory")
    p.add_argument("--manifest", required=True, help="NeMo-style JSONL with references (text)")
    p.add_argument("--work-dir", default="runs/edges_bench", help="where the variants' WAV files go")
    p.add_argument("--floor-dbfs", type=float, default=-50.0, help="the noise floor's RMS level")
    p.add_argument("--max-files", type=int, help="the first N lines of the manifest only")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--untrimmed", action="store_true",
                   help="feed every variant as it is, also to a model trained with train.trim_silence (whose "
                        "inputs infer.py otherwise cuts as training cut its utterances)")
    args = p.parse_args(argv)
    torch.set_num_threads(max(1, os.cpu_count() or 1))

    loaded = load_model(args.ckpt)
    if args.untrimmed:
        loaded = replace(loaded, trim_silence=None)
    requests = read_requests(args.manifest)[: args.max_files]
    originals = [load_audio(r.audio_filepath, r.offset, r.duration, RATE).double().numpy() for r in requests]
    refs = [r.text for r in requests]
    rows, out = [], {}
    for k, (name, change) in enumerate(variants(args.floor_dbfs).items()):
        folder = Path(args.work_dir) / f"v{k}"
        folder.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng([args.seed, k])
        changed = []
        for i, (req, wav) in enumerate(zip(requests, originals)):
            path = folder / f"{i:05d}.wav"
            sf.write(path, np.clip(change(wav, rng), -1, 1).astype(np.float32), RATE, subtype="PCM_16")
            changed.append(replace(req, audio_filepath=str(path), offset=0.0, duration=None))
        results, _ = transcribe(loaded, changed)
        hyps = [r.pred_text for r in results]
        score = wer(refs, hyps)
        if k == 0:
            base_hyps, bound = hyps, score * 1.1 + 2
        same = sum(h == b for h, b in zip(hyps, base_hyps))
        out[name] = {"wer": round(score, 2), "same_text_as_is": same, "ok": bool(score <= bound)}
        rows.append([name, score, same, len(hyps), "yes" if score <= bound else "NO"])
        log(f"{name}: WER {score:.1f}%")
    print_table([("variant", "<28"), ("WER %", ">7.1f"), ("same text", ">9d"), ("of", ">4d"),
                 (f"<= {bound:.1f}", ">8")], rows)
    print_json({"ckpt": str(args.ckpt), "manifest": args.manifest, "files": len(requests), "bound": round(bound, 2),
                "variants": out, "all_ok": all(v["ok"] for v in out.values())})


if __name__ == "__main__":
    main()
