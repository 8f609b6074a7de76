"""Decode speed of the Canary layouts: encoder time, decoder ms/step with and without the KV cache, RTFx.

    python bench/decode_bench.py                       # CPU-scaled: d 256, real layer counts, 30 s inputs
    python bench/decode_bench.py --d-model 1024 --subsampling-channels 256 --batch 16 --device cuda

Random weights (speed does not depend on them). Each architecture keeps its layer counts (24+24,
32+4, 24+4) at one shared width, so the comparison is about where the layers sit. Greedy decoding
runs a fixed number of steps (no EOS), so every layout does the same work per token.

- encoder: model.encode on a batch of `--seconds`-long inputs.
- decoder ms/step, cached: mean over `--cache-tokens` KV-cached greedy steps, and the single step that
  produces token number `--cache-tokens` (cache rewound to that position and the step repeated).
- decoder ms/step, recomputed: producing that same token without a cache, i.e. the full decoder over
  prompt + all previous tokens, self- and cross-attention keys/values recomputed.
- RTFx: audio seconds / (encoder + prompt + `--tokens` cached greedy steps), end to end.

Timings on a shared CPU are noisy (other jobs compete for the cores): read ratios, not absolute
numbers, and rerun if a row looks off. Prints a table, then a JSON object as the last line.
"""

import argparse
import json
import sys
import time

import torch

from aed.encoder import subsampled_length
from aed.model import AED, AEDConfig

LAYOUTS = {  # name: (encoder layers, decoder layers), as in configs/canary-*.yaml
    "canary-1b (24+24)": (24, 24),
    "canary-1b-flash (32+4)": (32, 4),
    "24+4": (24, 4),
}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device, repeats=1):
    """Best wall time of `repeats` runs (the minimum is the least disturbed by other jobs)."""
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        out = fn()
        sync(device)
        best = min(best, time.perf_counter() - start)
    return best, out


def greedy_cached(model, memory, memory_lens, prompt, steps):
    """Prefill the prompt, then `steps` argmax steps with the KV cache (EOS ignored: fixed work)."""
    cache = model.new_cache(memory, memory_lens, prompt.size(1) + steps)
    logits = model.decode_step(prompt, cache)
    for _ in range(steps):
        logits = model.decode_step(logits.argmax(-1, keepdim=True), cache)
    return logits


def recompute_step(model, memory, memory_lens, tokens):
    """One new token without a cache: the whole decoder over the prefix, logits of the last position."""
    return model.decoder.output_proj(model.decoder(tokens, memory, memory_lens)[:, -1]).float()


def bench_layout(name, enc_layers, dec_layers, args, device):
    cfg = AEDConfig(
        n_mels=128, vocab_size=5248, enc_d_model=args.d_model, enc_layers=enc_layers, enc_heads=args.heads,
        subsampling_channels=args.subsampling_channels, dec_d_model=args.d_model, dec_layers=dec_layers,
        dec_heads=args.heads, dec_max_len=1024,
    )
    torch.manual_seed(0)
    model = AED(cfg).to(device).eval()
    frames = int(args.seconds * 100)  # 10 ms feature hop
    feats = torch.randn(args.batch, frames, 128, device=device)
    feat_lens = torch.full((args.batch,), frames, device=device)
    prompt = torch.randint(10, 5000, (args.batch, 5), device=device)  # the 5-token Canary prompt
    with torch.inference_mode():
        enc_s, (memory, memory_lens) = timed(lambda: model.encode(feats, feat_lens), device, args.repeats)

        n = args.cache_tokens
        prefill_s, _ = timed(lambda: greedy_cached(model, memory, memory_lens, prompt, 0), device, args.repeats)
        cached_s, _ = timed(lambda: greedy_cached(model, memory, memory_lens, prompt, n), device, args.repeats)
        cached_mean_ms = (cached_s - prefill_s) / n * 1e3

        # The step that produces token n: its input is token n-1 at position P+n-2 (positions count from 0).
        tokens = torch.cat([prompt, torch.randint(10, 5000, (args.batch, n - 1), device=device)], dim=1)
        cache = model.new_cache(memory, memory_lens, tokens.size(1))
        model.decode_step(tokens[:, :-1], cache)

        def cached_step():
            cache.length = tokens.size(1) - 1  # rewind: every repeat rewrites the same cache slot
            return model.decode_step(tokens[:, -1:], cache)

        cached_ms = timed(cached_step, device, args.repeats + 2)[0] * 1e3
        recompute_ms = timed(lambda: recompute_step(model, memory, memory_lens, tokens), device, args.repeats + 2)[0] * 1e3

        e2e_s, _ = timed(
            lambda: greedy_cached(model, *model.encode(feats, feat_lens), prompt, args.tokens), device, args.repeats
        )
    return {
        "layout": name,
        "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 2),
        "encoder_s": round(enc_s, 4),
        "dec_ms_per_step_cached_mean": round(cached_mean_ms, 3),
        "dec_ms_at_token_n_cached": round(cached_ms, 3),
        "dec_ms_at_token_n_recomputed": round(recompute_ms, 3),
        "kv_cache_speedup_at_token_n": round(recompute_ms / cached_ms, 2),
        "end_to_end_s": round(e2e_s, 4),
        "rtfx": round(args.batch * args.seconds / e2e_s, 2),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--d-model", type=int, default=256, help="shared encoder/decoder width (Canary: 1024)")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--subsampling-channels", type=int, default=64, help="Canary: 256; scaled with the width")
    parser.add_argument("--batch", type=int, default=2, help="utterances per batch")
    parser.add_argument("--seconds", type=float, default=30.0, help="duration of each input")
    parser.add_argument("--tokens", type=int, default=100, help="generated tokens per utterance for RTFx (~30 s of speech)")
    parser.add_argument("--cache-tokens", type=int, default=50, help="n: compare cached vs recomputed at the n-th token")
    parser.add_argument("--repeats", type=int, default=2, help="take the best of this many runs")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads; 1 avoids thrashing a shared machine")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(f"device {device}, threads {torch.get_num_threads()}, width {args.d_model}, batch {args.batch} x {args.seconds:g} s "
          f"({subsampled_length(int(args.seconds * 100))} encoder frames), {args.tokens} tokens for RTFx")

    rows = []
    for name, (enc_layers, dec_layers) in LAYOUTS.items():
        rows.append(bench_layout(name, enc_layers, dec_layers, args, device))
        r = rows[-1]
        print(f"  done {name}: rtfx {r['rtfx']}", file=sys.stderr)

    base = rows[0]["rtfx"]
    n = args.cache_tokens
    header = (f"{'layout':24s} {'params M':>9s} {'encoder s':>10s} {'cached ms/step':>15s} {f'cached ms @{n}':>15s} "
              f"{f'recomp ms @{n}':>15s} {'cache x':>8s} {'e2e s':>8s} {'RTFx':>8s} {'vs 24+24':>9s}")
    print(header)
    print("-" * len(header))
    for r in rows:
        r["rtfx_vs_canary_1b"] = round(r["rtfx"] / base, 2)
        print(f"{r['layout']:24s} {r['params_m']:9.2f} {r['encoder_s']:10.3f} {r['dec_ms_per_step_cached_mean']:15.2f} "
              f"{r['dec_ms_at_token_n_cached']:15.2f} {r['dec_ms_at_token_n_recomputed']:15.2f} "
              f"{r['kv_cache_speedup_at_token_n']:8.1f} {r['end_to_end_s']:8.2f} "
              f"{r['rtfx']:8.1f} {r['rtfx_vs_canary_1b']:9.2f}")
    flash = next(r for r in rows if "flash" in r["layout"])
    summary = {
        "device": str(device),
        "threads": torch.get_num_threads(),
        "d_model": args.d_model,
        "batch": args.batch,
        "seconds": args.seconds,
        "tokens": args.tokens,
        "cache_tokens": args.cache_tokens,
        "rows": rows,
        "min_kv_cache_speedup_at_token_n": min(r["kv_cache_speedup_at_token_n"] for r in rows),
        "flash_rtfx_vs_canary_1b": flash["rtfx_vs_canary_1b"],
        "targets": {"kv_cache_speedup_at_token_n": 5.0, "flash_rtfx_vs_canary_1b": 2.5},
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
