"""Streaming speed: how many real-time streams one machine decodes at once (aed/decode_stream.py).

    python bench/stream_bench.py                                   # both Canary Flash presets, CPU, 2 threads
    python bench/stream_bench.py --int8                            # int8 Linear weights, as infer.py --int8
    python bench/stream_bench.py --presets canary-180m-flash --streams 1 2 4 8 16 --device cuda

Each preset at full size (Canary's vocabulary and 128 mels) with random weights, streamed as
`infer.py --stream` streams (10 s left context, 1 s chunks, 0.5 s look-ahead, AlignAtt): speed does
not depend on the weights, and the work is fixed: EOS is never chosen, the AlignAtt threshold is 0
(its cross-attention is still read at every step), and every chunk commits --tokens-per-second
x chunk tokens, so the decoder re-reads about that many tokens per second of its left context.

B streams of --seconds of noise are fed a chunk at a time and decoded as one batch. The noise is
continuous by default, the worst case: a stream's sentence never ends at a pause, so its window fills
to left context + chunk + look-ahead, is cut at its quietest point and fills again. With --pauses the
noise comes in sentences of 3-8 s between pauses of 0.5 s, as speech does: each sentence ends at its
pause, and the window holds one sentence. Timed: every decoding step of the batch (chunks, and
sentence ends decoded to EOS); the real-time factor is their total over the seconds of audio, and a
batch of B streams is real time when it is <= 1. Baseline in the same run: offline decoding
(infer.py's transcribe, greedy, the same tokens per second) of the same audio, batch B, whose cost
per second of audio the streaming figure is set against (streaming re-encodes its buffer for every
chunk: up to 11x the encoder work of offline decoding at a 11.5 s buffer).

Prints a table, then a JSON object as the last line.
"""

import argparse
import tempfile
import time

import soundfile as sf
import torch
from common import (MINI_TOKENIZER, add_device_args, device_from_args, load_avg, log, print_json, print_table,
                    random_asr)

from aed.data_tokenizer import Tokenizer
from aed.decode_search import DecodingOptions
from aed.decode_stream import StreamConfig, Streamer
from aed.decode_transcribe import transcribe
from aed.model_checkpoint import quantize_int8


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="+", default=["canary-180m-flash", "canary-1b-flash"])
    p.add_argument("--streams", nargs="+", type=int, default=[1, 2, 4, 8], help="batch sizes: concurrent streams")
    p.add_argument("--seconds", type=float, default=30.0, help="audio per stream")
    p.add_argument("--pauses", action="store_true", help="sentences of 3-8 s between pauses, not continuous noise")
    p.add_argument("--tokens-per-second", type=float, default=4.0,
                   help="tokens committed per second of audio (Canary's tokenizers: about 4 on real speech)")
    p.add_argument("--chunk", type=float, default=StreamConfig.chunk)
    p.add_argument("--left", type=float, default=StreamConfig.left)
    p.add_argument("--right", type=float, default=StreamConfig.right)
    p.add_argument("--int8", action="store_true", help="int8 Linear weights (CPU only; as infer.py --int8)")
    p.add_argument("--max-rtf", type=float, default=2.0,
                   help="stop growing the batch once a batch's real-time factor passes this")
    add_device_args(p, threads=2)
    return p.parse_args(argv)


def stream_batch(streamer: Streamer, wavs: list[torch.Tensor]) -> float:
    """Seconds of processing of the batch of streams fed `wavs` (all of equal length), every step."""
    streams = [streamer.open("en") for _ in wavs]
    n = wavs[0].numel()
    for start in range(0, n, streamer.chunk):
        for s, w in zip(streams, wavs):
            s.push(w[start: start + streamer.chunk])
        streamer.run(streams)
    streamer.run(streams, final=True)
    return sum(streams[0].chunk_compute)


def noise(seconds: float, pauses: bool, gen: torch.Generator, rate: int = 16000) -> torch.Tensor:
    """Noise at 0.01 of full scale: continuous, or in bursts of 3-8 s between 0.5 s of silence."""
    wav = 0.01 * torch.randn(round(seconds * rate), generator=gen)
    if pauses:
        t = 0
        while t < wav.numel():
            t += round(float(torch.empty(1).uniform_(3, 8, generator=gen)) * rate)
            wav[t: t + rate // 2] = 0.0
            t += rate // 2
    return wav


def offline(loaded, wavs: list[torch.Tensor], options: DecodingOptions) -> float:
    """RTFx of transcribing the same audio offline as one batch."""
    with tempfile.TemporaryDirectory() as tmp:
        paths = []
        for i, w in enumerate(wavs):
            paths.append(f"{tmp}/{i}.wav")
            sf.write(paths[-1], w.numpy(), 16000, subtype="FLOAT")
        _, timings = transcribe(loaded, paths, options, batch_duration=1e9)
    return timings.rtfx


def main(argv=None):
    args = parse_args(argv)
    device = device_from_args(args)
    tokenizer = Tokenizer.load(MINI_TOKENIZER)
    config = StreamConfig(chunk=args.chunk, left=args.left, right=args.right, alignatt_threshold=0.0)
    options = DecodingOptions(ctc_weight=0.0, max_repeats=0, max_tokens_per_second=args.tokens_per_second)
    gen = torch.Generator().manual_seed(0)
    rows, out = [], {}
    with torch.inference_mode():
        for preset in args.presets:
            loaded = random_asr(preset, tokenizer, device)
            if args.int8:
                loaded.model = quantize_int8(loaded.model)
            streamer = Streamer(loaded, config, options)
            chunk_s = streamer.chunk / streamer.rate
            result = {"chunk_s": chunk_s, "buffer_s": (streamer.left + streamer.chunk + streamer.right) / streamer.rate,
                      "batches": {}}
            stream_batch(streamer, [noise(4, args.pauses, gen)])  # warm-up
            realtime = 0
            for b in args.streams:
                wavs = [noise(args.seconds, args.pauses, gen) for _ in range(b)]
                log(f"{preset}: {b} stream(s) of {args.seconds:g} s")
                t0 = time.perf_counter()
                rtf = stream_batch(streamer, wavs) / args.seconds
                ms = 1000 * rtf * chunk_s  # processing per chunk of audio, all steps counted
                offline_rtfx = offline(loaded, wavs, options)
                # per second of audio: streaming's processing over offline decoding's
                cost = (ms / 1000 / (b * chunk_s)) * offline_rtfx
                result["batches"][b] = {"ms_per_chunk": ms, "rtf": rtf, "offline_rtfx": offline_rtfx,
                                        "cost_vs_offline": cost, "wall_s": time.perf_counter() - t0}
                rows.append([preset, b, ms, rtf, "yes" if rtf <= 1 else "no", offline_rtfx, cost])
                if rtf <= 1:
                    realtime = b
                if rtf > args.max_rtf:
                    break
            result["realtime_streams"] = realtime  # the largest measured batch at real-time factor <= 1
            out[preset] = result
    print_table([("preset", "<20"), ("streams", ">7d"), ("ms/chunk", ">9.0f"), ("RTF", ">6.2f"), ("real time", ">9"),
                 ("offline RTFx", ">12.1f"), ("cost vs offline", ">15.1f")], rows)
    print_json({"device": str(device), "threads": args.threads, "int8": args.int8, "pauses": args.pauses,
                "load_avg": load_avg(), "tokens_per_second": args.tokens_per_second, "presets": out})


if __name__ == "__main__":
    main()
