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
import time

import torch

from aed.encoder import subsampled_length
from aed.model import count_parameters
from common import LAYOUTS, add_device_args, add_width_args, device_from_args, log, print_json, print_table, random_aed


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
    model = random_aed(args, enc_layers, dec_layers).to(device).eval()
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
        "params_m": round(count_parameters(model) / 1e6, 2),
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
    add_width_args(parser, d_model=256, subsampling_channels=64)
    parser.add_argument("--batch", type=int, default=2, help="utterances per batch")
    parser.add_argument("--seconds", type=float, default=30.0, help="duration of each input")
    parser.add_argument("--tokens", type=int, default=100, help="generated tokens per utterance for RTFx (~30 s of speech)")
    parser.add_argument("--cache-tokens", type=int, default=50, help="n: compare cached vs recomputed at the n-th token")
    parser.add_argument("--repeats", type=int, default=2, help="take the best of this many runs")
    add_device_args(parser)
    args = parser.parse_args()
    device = device_from_args(args)
    print(f"device {device}, threads {torch.get_num_threads()}, width {args.d_model}, batch {args.batch} x {args.seconds:g} s "
          f"({subsampled_length(int(args.seconds * 100))} encoder frames), {args.tokens} tokens for RTFx")

    rows = []
    for name, (enc_layers, dec_layers) in LAYOUTS.items():
        rows.append(bench_layout(name, enc_layers, dec_layers, args, device))
        log(f"done {name}: rtfx {rows[-1]['rtfx']}")

    for r in rows:
        r["rtfx_vs_canary_1b"] = round(r["rtfx"] / rows[0]["rtfx"], 2)
    n = args.cache_tokens
    print_table([("layout", "<24"), ("params M", "9.2f"), ("encoder s", "10.3f"), ("cached ms/step", "15.2f"),
                 (f"cached ms @{n}", "15.2f"), (f"recomp ms @{n}", "15.2f"), ("cache x", "8.1f"), ("e2e s", "8.2f"),
                 ("RTFx", "8.1f"), ("vs 24+24", "9.2f")],
                [[r["layout"], r["params_m"], r["encoder_s"], r["dec_ms_per_step_cached_mean"],
                  r["dec_ms_at_token_n_cached"], r["dec_ms_at_token_n_recomputed"], r["kv_cache_speedup_at_token_n"],
                  r["end_to_end_s"], r["rtfx"], r["rtfx_vs_canary_1b"]] for r in rows])
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
    print_json(summary)


if __name__ == "__main__":
    main()
