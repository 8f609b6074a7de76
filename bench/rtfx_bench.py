"""RTFx of infer.py's pipeline (aed.inference.transcribe) for the Canary layouts, greedy and beam, batch 1 and 16.

    python bench/rtfx_bench.py     # CPU-scaled: ~3 min of CPU time, ~6 min wall on a busy 2-core machine
    python bench/rtfx_bench.py --d-model 1024 --subsampling-channels 256 --utterances 200 --device cuda --dtype bf16

The pipeline is the real one: generated 16 kHz WAV files on disk -> load -> log-mel -> encoder -> search.
Random weights (speed does not depend on them) at one shared, CPU-sized width; each layout keeps its
layer counts (24+24, 24+4, 32+4). EOS is disabled and every utterance generates exactly `--tokens`
tokens, so every layout does the same decoding work. Batches: utterances sorted by duration, cut into
groups of exactly `--batch-sizes` files.

- RTFx: audio seconds / wall seconds of transcribe() (load+features + encoder + decoder + planning).
- encoder-only RTFx: the same run without its decoder time, the ceiling a free decoder would reach.

Why width 64 on a CPU: the paper's ~3x (Table 3, GPU) exists because a GPU decoder step is latency-bound
(its small kernels cannot fill the device), so decode time grows with the number of decoder layers, not
their FLOPs. A narrow model reproduces that regime on a CPU at batch 1. At batch 16 a CPU decoder step is
compute-bound like the encoder, and per audio second the encoder does ~4x the decoder's FLOPs per layer
(12.5 frames/s vs ~3.6 tokens/s), so there the flash layout gains less (measured: 1.7x greedy, 1.9x beam,
vs 3.3x and 4.2x at batch 1; flash reached 91% of its encoder-only RTFx at batch 16 greedy).

Timings on a shared CPU are noisy (other jobs compete for the cores): read ratios, not absolute numbers,
and rerun if a row looks off. Prints a table, then a JSON object as the last line.
"""

import argparse
import math
import tempfile
import time
from pathlib import Path

import numpy as np
import soundfile as sf
import torch


from aed.audio import FeatureConfig
from aed.decoding import DecodingOptions
from aed.inference import LoadedModel, Timings, transcribe
from aed.tokenizer import Tokenizer
from common import (LAYOUTS, MINI_TOKENIZER, add_device_args, add_width_args, device_from_args, log, print_json,
                    print_table, random_aed)


def make_audio(directory: Path, n: int, min_s: float, max_s: float, seed: int = 0) -> list[str]:
    """n WAV files of uniform random duration: a gliding harmonic tone in syllable-rate bursts, plus noise."""
    rng = np.random.default_rng(seed)
    sr, paths = 16000, []
    for i in range(n):
        t = np.arange(int(rng.uniform(min_s, max_s) * sr)) / sr
        f0 = rng.uniform(90, 250) * (1 + 0.1 * np.sin(2 * np.pi * rng.uniform(0.2, 1.0) * t))
        phase = 2 * np.pi * np.cumsum(f0) / sr
        voice = sum(np.sin(k * phase) / k for k in range(1, 6))
        envelope = np.clip(np.sin(2 * np.pi * rng.uniform(3, 5) * t), 0, None)  # ~4 "syllables" per second
        wav = 0.1 * voice * envelope + 0.003 * rng.standard_normal(t.size)
        paths.append(str(directory / f"utt{i:04d}.wav"))
        sf.write(paths[-1], wav.astype(np.float32), sr, subtype="PCM_16")
    return paths


def random_model(enc_layers: int, dec_layers: int, args, tokenizer: Tokenizer, device) -> LoadedModel:
    model = random_aed(args, enc_layers, dec_layers).to(device).eval()
    with torch.no_grad():
        model.decoder.output_proj.bias[tokenizer.eos] = -1e9  # never stop early: fixed work per utterance
    return LoadedModel(model, tokenizer, FeatureConfig(), "random weights")


def run(asr: LoadedModel, groups: list[list[str]], beam_size: int, args) -> Timings:
    """transcribe() once per group (one batch each); the timings summed."""
    total = Timings()
    for group in groups:
        _, t = transcribe(asr, group, DecodingOptions(beam_size=beam_size, max_new_tokens=args.tokens),
                          batch_duration=math.inf, dtype=torch.bfloat16 if args.dtype == "bf16" else None)
        for f in ("audio", "wall", "load_features", "encoder", "decoder"):
            setattr(total, f, getattr(total, f) + getattr(t, f))
    return total


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_width_args(parser, d_model=64, subsampling_channels=16)  # why 64: see above
    parser.add_argument("--utterances", type=int, default=48, help="generated files (the issue suggests 200 on a GPU)")
    parser.add_argument("--min-seconds", type=float, default=2.0)
    parser.add_argument("--max-seconds", type=float, default=20.0)
    parser.add_argument("--tokens", type=int, default=40, help="generated tokens per utterance (~11 s of speech)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--beams", type=int, nargs="+", default=[1, 4], help="1 = greedy")
    add_device_args(parser)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    args = parser.parse_args(argv)
    device = device_from_args(args)
    tokenizer = Tokenizer.load(MINI_TOKENIZER)

    with tempfile.TemporaryDirectory() as tmp:
        paths = make_audio(Path(tmp), args.utterances, args.min_seconds, args.max_seconds)
        durations = {p: sf.info(p).duration for p in paths}
        by_length = sorted(paths, key=durations.get, reverse=True)
        audio_s = sum(durations.values())
        print(f"device {device}, threads {torch.get_num_threads()}, width {args.d_model}, {args.dtype}, "
              f"{len(paths)} files / {audio_s:.0f} s of audio, {args.tokens} tokens each")
        rows = []
        for name, (enc_layers, dec_layers) in LAYOUTS.items():
            asr = random_model(enc_layers, dec_layers, args, tokenizer, device)
            run(asr, [by_length[-2:]], 1, args)  # warm-up: first-call allocations and kernel selection
            for beam in args.beams:
                for bs in args.batch_sizes:
                    start = time.perf_counter()
                    t = run(asr, [by_length[i: i + bs] for i in range(0, len(paths), bs)], beam, args)
                    rows.append({"layout": name, "search": "greedy" if beam == 1 else f"beam{beam}", "batch": bs,
                                 "audio_s": round(t.audio, 1), "wall_s": round(t.wall, 3),
                                 "load_features_s": round(t.load_features, 3), "encoder_s": round(t.encoder, 3),
                                 "decoder_s": round(t.decoder, 3), "rtfx": round(t.rtfx, 2),
                                 "encoder_only_rtfx": round(t.audio / (t.wall - t.decoder), 2)})
                    rows[-1]["rtfx_of_encoder_only"] = round(rows[-1]["rtfx"] / rows[-1]["encoder_only_rtfx"], 3)
                    log(f"done {name} {rows[-1]['search']} batch {bs}: RTFx {rows[-1]['rtfx']} "
                        f"({time.perf_counter() - start:.0f} s)")

    def row(layout, search, bs):
        return next(r for r in rows if r["layout"].startswith(layout) and r["search"] == search and r["batch"] == bs)

    for r in rows:
        r["rtfx_vs_canary_1b"] = round(r["rtfx"] / row("canary-1b ", r["search"], r["batch"])["rtfx"], 2)
    print_table([("layout", "<24"), ("search", ">7"), ("batch", "5d"), ("wall s", "8.2f"), ("load+feat s", "11.2f"),
                 ("encoder s", "10.2f"), ("decoder s", "10.2f"), ("RTFx", "8.1f"), ("enc-only", "9.1f"),
                 ("of enc", "7.2f"), ("vs 24+24", "9.2f")],
                [[r["layout"], r["search"], r["batch"], r["wall_s"], r["load_features_s"], r["encoder_s"], r["decoder_s"],
                  r["rtfx"], r["encoder_only_rtfx"], r["rtfx_of_encoder_only"], r["rtfx_vs_canary_1b"]] for r in rows])
    flash = {f"{r['search']}/{r['batch']}": r["rtfx_vs_canary_1b"] for r in rows if "flash" in r["layout"]}
    summary = {"device": str(device), "threads": torch.get_num_threads(), "d_model": args.d_model, "dtype": args.dtype,
               "utterances": len(paths), "audio_s": round(audio_s, 1), "tokens": args.tokens, "rows": rows,
               "flash_rtfx_vs_canary_1b": flash,  # by "search/batch"
               "targets": {"flash_rtfx_vs_canary_1b": 2.5, "flash_rtfx_of_encoder_only_greedy_16": 0.5}}
    if 1 in args.beams and 16 in args.batch_sizes:
        summary["flash_rtfx_of_encoder_only_greedy_16"] = row("canary-1b-flash", "greedy", 16)["rtfx_of_encoder_only"]
        summary["met"] = {
            "flash_2.5x_greedy_1": flash.get("greedy/1", 0.0) >= 2.5,
            "flash_2.5x_greedy_16": flash["greedy/16"] >= 2.5,
            "flash_50pct_of_encoder_only_greedy_16": summary["flash_rtfx_of_encoder_only_greedy_16"] >= 0.5,
        }
    print_json(summary)


if __name__ == "__main__":
    main()
