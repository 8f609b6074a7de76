"""Transcribe or translate audio files with a trained model; report WER/BLEU and RTFx.

    python infer.py --ckpt runs/tiny a.wav b.flac clips/ 'more/*.ogg'           # path<TAB>text on stdout
    python infer.py --ckpt runs/tiny/ckpt-00000600 --manifest test.jsonl --out hyp.jsonl
    python infer.py --ckpt runs/tiny --source-lang es --target-lang en x.wav    # speech translation
    python infer.py --ckpt runs/flash --beam-size 4 --device cuda --dtype bf16 --batch-duration 1200 ...
    python infer.py --ckpt runs/tiny --ctc-weight 0 ...     # attention decoder alone (default: joint with CTC)
    python infer.py --ckpt runs/flash --int8 ...             # CPU: int8 Linear weights (bench/infer_speed_bench.py)
    python infer.py --ckpt runs/flash --ema ...              # the EMA of the weights (a run with ema_decay)
    python infer.py --ckpt runs/flash --device cuda --compile ...   # compiled decoder step, a CUDA graph
    python infer.py --ckpt runs/tiny --timestamps word --out hyp.jsonl --subtitles subs/ talk.wav  # .srt + .vtt
    python infer.py --ckpt runs/tiny --stream --manifest test.jsonl --out hyp.jsonl   # streamed, latency measured
    arecord -f S16_LE -r 16000 -c 1 | python infer.py --ckpt runs/tiny --stream -     # live captions
    aed-infer --ckpt runs/tiny a.wav                                           # installed (pip install .)

Inputs: files in any format, rate and channel count soundfile reads, or the ffmpeg command where it
is installed (m4a/AAC, mp4, webm, ...), resampled to the model's rate, channels averaged; directories (searched recursively for audio files), glob patterns, and/or a
NeMo-style manifest whose per-line task fields override the command line; `text` (or `answer`),
when present, is the reference for WER (ASR, per language, normalised and with punctuation/case)
and BLEU (AST, per language pair). Long inputs are cut at pauses (see --chunk-seconds, --chunk-overlap).

Streaming (--stream): each input is decoded while its audio arrives, a chunk at a time
(aed/decode_stream.py), a sentence at a time (a pause ends one): the hypothesis grows on the terminal,
one line per file, what the decoder is about to commit in grey; --out adds each token's and word's
emission time and the latency (AL, LAAL, in ms of audio). `--stream -` reads raw 16-bit mono PCM at
the model's rate (16 kHz) from standard input and captions it as it comes, a line per sentence
(the input and output of streams: aed/cli_stream.py).

Timestamps (--timestamps word|segment) are the hypothesis force-aligned to the CTC head's frame
posteriors (aed/decode_timing.py), in seconds from the start of each file, to a resolution of one
encoder frame (80 ms at Canary's 8x subsampling, 40 ms at 4x). A model without a CTC head
(model.ctc_loss_weight=0, e.g. a converted Canary checkpoint) cannot give them: infer.py stops with an
error before decoding.

stdout: one `path<TAB>text` line per transcribed file, in input order. stderr: progress, failures
(path and reason), metrics and the RTFx report. Exit code 1 if any input failed, else 0.
"""

import argparse
import dataclasses
import importlib.util
import json
import logging
import os
import pickle
import sys
import time
import typing

import torch

from aed.cli_stream import caption_stdin, print_latency, stream_files
from aed.data_speech import DETECTORS, SILERO_RATE, detector_name
from aed.decode_metrics import NORMALIZERS
from aed.decode_policy import POLICIES
from aed.decode_search import DecodingOptions
from aed.decode_stream import StreamConfig, Streamer
from aed.decode_timing import srt, to_segments, webvtt
from aed.decode_transcribe import (check_settings, expand_inputs, known_languages, make_request, read_requests, score,
                                   transcribe)
from aed.model_checkpoint import check_loading, load_model


def parse_args(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="*", help="audio files, directories, glob patterns")
    p.add_argument("--ckpt", required=True, help="checkpoint file, or a run directory (its newest checkpoint)")
    p.add_argument("--manifest", action="append", default=[], help="NeMo-style JSONL (repeatable)")
    p.add_argument("--out", help="write JSONL: the manifest fields + pred_text, duration, task fields, decode_time")
    p.add_argument("--normalizer", choices=NORMALIZERS, default="simple",
                   help="text normaliser for WER against references: simple (case and punctuation) or whisper "
                        "(Whisper's English normaliser for English, its basic one otherwise: the Open ASR "
                        "Leaderboard's convention); the raw WER is reported beside it")
    task = p.add_argument_group("task (per-line manifest values win)")
    task.add_argument("--task", choices=["asr", "ast"], help="default: asr if source == target language, else ast")
    task.add_argument("--source-lang", default="en", help="language spoken in the audio")
    task.add_argument("--target-lang", help="language of the output text; default: the source language")
    task.add_argument("--pnc", action=argparse.BooleanOptionalAction, default=True,
                      help="output punctuation and capitalisation")
    add_decoding_flags(p.add_argument_group("decoding"))
    run = p.add_argument_group("execution")
    run.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    run.add_argument("--dtype", choices=["bf16", "fp32"], help="default: bf16 on cuda, fp32 on cpu")
    run.add_argument("--compile", action="store_true",
                     help="compile the decoder step (fixed-shape KV cache; on CUDA also a CUDA graph), once per "
                          "shape bucket (rows, positions, frames rounded up), reused by every batch of that bucket; "
                          "the tokens are those of eager decoding. Pays on GPUs at small batches, where eager steps "
                          "are bound by kernel launches; each first batch of a bucket waits for its compilation")
    run.add_argument("--average", type=int, default=1, metavar="N",
                     help="with a run directory as --ckpt: decode with the mean weights of its newest N valid "
                          "checkpoints (train.keep_last must keep them)")
    run.add_argument("--ema", action="store_true",
                     help="decode with the checkpoint's exponential moving average of the weights (a run trained "
                          "with ema_decay); not with --average")
    run.add_argument("--int8", action="store_true",
                     help="int8 weights for every Linear layer (torch's dynamic quantization), CPU only: a "
                          "batch-1 decoder step on a CPU is bound by reading its weights. Not with --compile")
    run.add_argument("--batch-duration", type=float, default=300.0,
                     help="padded seconds of audio per batch (batch size x longest); inputs are sorted by "
                          "duration so padding stays small")
    run.add_argument("--chunk-seconds", type=float,
                     help="inputs longer than this are cut at their pauses into segments of at most this, each "
                          "decoded on its own, the silence between them skipped; default: the longest utterance "
                          "the model was trained on (recorded in its checkpoint; for a model trained with varied "
                          "edges, longer by the wider silence its segments keep), else 40")
    run.add_argument("--chunk-overlap", type=float, default=0.0,
                     help="where speech runs on longer than a segment may, so that it is cut without a pause, "
                          "start the next segment this many seconds earlier and merge the two hypotheses "
                          "(by word times with a CTC head, else by the "
                          "words both heard); 0 (default): cut without overlap, which measured as well or "
                          "better for models trained on whole utterances (README, Long audio)")
    run.add_argument("--vad", choices=DETECTORS, default="auto",
                     help="the speech detector that finds the pauses of long inputs and streams: silero "
                          "(Silero VAD, `pip install silero-vad`: it also tells a music bed from speech), energy "
                          "(built in: a frame 10 dB above the room's own floor around it), or auto (default): "
                          "silero where it is installed and the model takes 16 kHz audio, else energy")
    run.add_argument("--merge-segments", action="store_true",
                     help="decode a long input's stretches of speech together, up to the segment length, where "
                          "the pause between them is no longer than the silence the model heard around its "
                          "training utterances (WhisperX-style merging); default: every pause of 0.25 s ends a "
                          "segment. Measured neutral on the laptop recipe's model (docs/inference.md, Long audio)")
    times = p.add_argument_group("timestamps (need a model with a CTC head)")
    times.add_argument("--timestamps", choices=["word", "segment"],
                       help="add `segments` (text, start, end; with `word`, each segment's `words` too) to the "
                            "--out lines; the cue level of --subtitles")
    times.add_argument("--subtitles", metavar="DIR", help="with --timestamps: write <audio name>.srt and .vtt here")
    live = p.add_argument_group("streaming (greedy over the attention decoder: aed/decode_stream.py)")
    live.add_argument("--stream", nargs="?", const="files", metavar="-",
                      help="decode the inputs as streams, a chunk at a time as their audio would arrive; "
                           "`--stream -`: raw 16-bit mono PCM at the model's rate from standard input")
    live.add_argument("--stream-chunk", type=float, default=StreamConfig.chunk, metavar="S", help="seconds decoded per step (default: %(default)s)")
    live.add_argument("--left-context", type=float, default=StreamConfig.left, metavar="S",
                      help="most seconds of the current sentence before each chunk that the encoder hears again "
                           "with it; a longer sentence is ended at its quietest point (default: 10, or less "
                           "where the model was trained on shorter utterances)")
    live.add_argument("--endpoint", type=float, default=StreamConfig.endpoint, metavar="S",
                      help="a pause this long after speech ends a sentence: its text is completed and the "
                           "decoder starts afresh; 0: only a full window does (default: %(default)s)")
    live.add_argument("--right-context", type=float, default=StreamConfig.right, metavar="S",
                      help="look-ahead: seconds after each chunk the encoder hears before the chunk is decoded; "
                           "chunk + right context is the latency the buffer adds (default: %(default)s)")
    live.add_argument("--policy", choices=POLICIES, default=StreamConfig.policy,
                      help="alignatt: commit tokens while the decoder's cross-attention looks at older audio; "
                           "waitk: a fixed number of tokens per chunk after a lag")
    live.add_argument("--alignatt-threshold", type=float, default=StreamConfig.alignatt_threshold,
                      metavar="S", help="alignatt: seconds before the chunk's end that a token's attention peak "
                                        "must lie; lower is less lag (default: adapts per stream to how far its "
                                        "tokens' peaks step, 0.16-0.64 s; 0.64, NeMo's, until 8 are measured)")
    live.add_argument("--waitk-lag", type=int, default=StreamConfig.waitk_lag, metavar="N", help="wait-k: chunks heard before the first token (default: %(default)s)")
    live.add_argument("--waitk-tokens", type=int, default=StreamConfig.waitk_tokens, metavar="N", help="wait-k: tokens per chunk after the lag (default: %(default)s)")
    live.add_argument("--streams", type=int, default=16, metavar="N",
                      help="files decoded at once, as one batch of streams (default: %(default)s)")
    live.add_argument("--realtime", action="store_true", help="feed files no faster than they play")
    run.add_argument("--quiet", action="store_true", help="no progress bar")
    run.add_argument("--skip-invalid", action="store_true",
                     help="skip manifest lines that are malformed or name a language the model lacks (logged, counted)")
    args = p.parse_args(argv)
    if args.stream not in (None, "files", "-"):  # `--stream x.wav`: the file is an input
        args.inputs.insert(0, args.stream)
        args.stream = "files"
    if args.stream == "-" and (args.inputs or args.manifest):
        p.error("--stream - reads standard input: give no files or manifests with it")
    if not args.inputs and not args.manifest and args.stream != "-":
        p.error("give audio files/directories/patterns and/or --manifest")
    if args.stream and args.streams < 1:
        p.error(f"--streams {args.streams}: decode at least one stream at a time")
    if args.stream and (args.beam_size != 1 or args.timestamps or args.compile):
        p.error("--stream decodes greedily, eager: not with --beam-size > 1, --timestamps or --compile")
    if args.subtitles and not args.timestamps:
        p.error("--subtitles needs --timestamps word or segment")
    try:  # the ranges of the values are the library's to check
        check_loading(args.device, args.compile, args.int8, args.average, args.ema)
        decoding_options(args)  # DecodingOptions checks its own ranges
        check_settings(args.batch_duration, args.chunk_seconds, args.chunk_overlap)
        if args.stream:
            stream_config(args)
    except ValueError as e:
        p.error(str(e))
    if args.vad == "silero" and importlib.util.find_spec("silero_vad") is None:
        p.error("--vad silero needs Silero VAD: pip install silero-vad")
    return args


def stream_config(args) -> StreamConfig:
    return StreamConfig(chunk=args.stream_chunk, left=args.left_context, right=args.right_context, policy=args.policy,
                        endpoint=args.endpoint, waitk_lag=args.waitk_lag, waitk_tokens=args.waitk_tokens,
                        alignatt_threshold=args.alignatt_threshold, vad=args.vad)


# DecodingOptions' fields that users set, each a flag (`beam_size`: --beam-size); the others come from the model.
DECODING_FLAGS = [f for f in dataclasses.fields(DecodingOptions) if "set_from" not in f.metadata]


def add_decoding_flags(group) -> None:
    """The decoding flags, each with its field's type, default and help: the options are written once,
    in aed/decode_search.py, for infer.py, the Python API and validation alike."""
    hints = typing.get_type_hints(DecodingOptions)
    for f in DECODING_FLAGS:
        kind = next(t for t in typing.get_args(hints[f.name]) or [hints[f.name]] if t is not type(None))  # X | None: X
        shown = "" if f.default is None else " (default: %(default)s)"
        group.add_argument("--" + f.name.replace("_", "-"), type=kind, default=f.default,
                           metavar=f.metadata.get("metavar"), help=f.metadata["help"].replace("%", "%%") + shown)


def decoding_options(args) -> DecodingOptions:
    """The search the decoding flags ask for."""
    return DecodingOptions(**{f.name: getattr(args, f.name) for f in DECODING_FLAGS})


class ProgressBar:
    """Seconds of audio done, on stderr: redrawn in place on a terminal, every 10% in a log file."""

    def __init__(self, enabled: bool):
        self.enabled, self.tty, self.start, self.shown = enabled, sys.stderr.isatty(), time.perf_counter(), -1

    def __call__(self, done_s: float, total_s: float):
        if not self.enabled or total_s <= 0:
            return
        frac = min(done_s / total_s, 1.0)
        if not self.tty and int(frac * 10) == self.shown:
            return
        self.shown = int(frac * 10)
        bar = "#" * int(frac * 30) + "-" * (30 - int(frac * 30))
        rate = done_s / max(time.perf_counter() - self.start, 1e-9)
        line = f"[{bar}] {100 * frac:5.1f}% {done_s:.0f}/{total_s:.0f} s audio, {rate:.1f} audio s/s"
        print("\r" + line if self.tty else line, end="\n" if not self.tty or frac >= 1 else "", file=sys.stderr,
              flush=True)


def write_subtitles(results, directory: str, level: str) -> None:
    """<audio file name>.srt and .vtt per transcribed file, one cue per word or per segment; a name
    that two inputs share gets the input's position appended, so no file overwrites another."""
    os.makedirs(directory, exist_ok=True)
    stems = [os.path.splitext(os.path.basename(r.request.audio_filepath))[0] for r in results]
    for n, (r, stem) in enumerate(zip(results, stems)):
        if r.error is None:
            cues = r.words if level == "word" else to_segments(r.words)
            name = os.path.join(directory, stem if stems.count(stem) == 1 else f"{stem}-{n}")
            for ext, fmt in ((".srt", srt), (".vtt", webvtt)):
                with open(name + ext, "w", encoding="utf-8") as f:
                    f.write(fmt(cues))


def print_scores(results, normalizer: str) -> None:
    """WER per language and BLEU per pair of the results with references, on stderr."""
    for key, m in score(results, normalizer).items():
        if "wer" in m:
            print(f"{key}: WER {m['wer']:.2f}% ({normalizer}-normalised; raw text, punctuation and case "
                  f"{m['wer_pnc']:.2f}%) on {m['n']} file(s)", file=sys.stderr)
        else:
            print(f"{key}: BLEU {m['bleu']:.2f} on {m['n']} file(s)", file=sys.stderr)


def print_unsaid(results, options: DecodingOptions, detector: str, unit: str = "segment") -> None:
    """The audio that gave no text, on stderr, so that none is dropped unsaid: the chunks (`unit`s) the
    no-speech check emptied, with their seconds and files, and the seconds never decoded (no speech by
    the `detector`)."""
    done = [r for r in results if r.error is None]
    if options.no_speech_threshold is not None:
        hit = [r for r in done if r.skipped_segments]
        rule = f"P > {options.no_speech_threshold:g}" + (
            "" if options.logprob_threshold is None else f", mean log-prob <= {options.logprob_threshold:g}")
        print(f"no speech ({rule}): {sum(r.skipped_segments for r in hit)} {unit}(s), "
              f"{sum(r.skipped_seconds for r in hit):.1f} s emptied in {len(hit)} of {len(done)} file(s)",
              file=sys.stderr)
    undecoded = sum(r.undecoded_seconds or 0.0 for r in done)
    if undecoded >= 0.05:
        print(f"{undecoded:.1f} s judged non-speech by {detector} (pauses, silence) were not decoded", file=sys.stderr)


# --- streaming (the input and output: aed/cli_stream.py) ----------------------------------------

def run_stream(args, loaded, requests) -> int:
    """--stream: decode files, or standard input, as streams. Returns the exit code."""
    config = stream_config(args)
    live = sys.stdout.isatty() and not args.quiet
    streamer = Streamer(loaded, config, decoding_options(args), partials=live)
    print(f"model {loaded.path} on {loaded.device}, streamed: {config.policy}, chunk {streamer.chunk / streamer.rate:g} s,"
          f" left {streamer.left / streamer.rate:g} s, right {streamer.right / streamer.rate:g} s (the buffer adds "
          f"{(streamer.chunk + streamer.right) / streamer.rate:g} s of latency), {detecting(args.vad, streamer.rate)}",
          file=sys.stderr)
    if args.stream == "-":
        return caption_stdin(streamer, make_request("<stdin>", source_lang=args.source_lang,
                                                    target_lang=args.target_lang, task=args.task, pnc=args.pnc))
    results, latencies = stream_files(streamer, requests, args.streams, args.realtime, args.out, live)
    print_scores(results, args.normalizer)
    print_unsaid(results, streamer.options, detector_name(args.vad, streamer.rate), "sentence")
    print_latency(latencies)
    return 1 if any(r.error is not None for r in results) else 0


def detecting(vad: str, sample_rate: int) -> str:
    """Which speech detector finds the pauses, and where "auto" fell back to energy, how to get Silero."""
    name = detector_name(vad, sample_rate)
    hint = " (Silero VAD, which keeps music out, is not installed: pip install silero-vad)" if (
        vad == "auto" and name == "energy" and sample_rate == SILERO_RATE) else ""
    return f"speech detector {name}{hint}"


# --- the run ----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    """The command, `python infer.py ARGS` with argv = ARGS (installed: `aed-infer`)."""
    # --- inputs and model
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        defaults = dict(source_lang=args.source_lang, target_lang=args.target_lang, task=args.task, pnc=args.pnc)
        requests = [req for path in args.manifest for req in read_requests(path, **defaults,
                                                                           skip_invalid=args.skip_invalid)]
        requests += [make_request(path, **defaults) for path in expand_inputs(args.inputs)]
    except (OSError, ValueError) as e:
        sys.exit(f"error: {e}")
    if not requests and args.stream != "-":
        sys.exit("error: no inputs (empty manifest or directory)")

    device = torch.device(args.device)
    t_load = time.perf_counter()
    try:
        loaded = load_model(args.ckpt, device, compile=args.compile, int8=args.int8, average=args.average,
                            ema=args.ema)
    except (OSError, ValueError, RuntimeError, pickle.UnpicklingError) as e:  # missing, not ours, or corrupt
        sys.exit(f"error: cannot load --ckpt {args.ckpt}: {e}")
    t_load = time.perf_counter() - t_load
    if args.skip_invalid:
        requests = known_languages(requests, loaded.tokenizer)
        if not requests:
            sys.exit("error: no valid inputs left")
    if args.stream:
        sys.exit(run_stream(args, loaded, requests))
    dtype = {"bf16": torch.bfloat16, "fp32": None}[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    options = decoding_options(args)
    joint = f" + CTC {options.ctc_weight:g}" if loaded.model.ctc is not None and options.ctc_weight > 0 else ""
    search = "greedy" if options.beam_size == 1 else f"beam {options.beam_size}"
    # (int8 Linear weights are packed, not parameters: counting parameters() would leave them out)
    size = ("int8 Linear weights" if args.int8
            else f"{sum(p.numel() for p in loaded.model.parameters()) / 1e6:.1f}M parameters")
    print(f"model {loaded.path} ({size}) on {device}, {'bf16' if dtype else 'fp32'}"
          f"{', compiled decoder step' if args.compile else ''}, {search}{joint}; {len(requests)} input(s); "
          f"{detecting(args.vad, loaded.features.sample_rate)}", file=sys.stderr)

    # --- transcription

    try:
        results, timings = transcribe(
            loaded, requests, options, batch_duration=args.batch_duration, chunk_seconds=args.chunk_seconds,
            chunk_overlap=args.chunk_overlap, dtype=dtype, timestamps=args.timestamps is not None, vad=args.vad,
            merge_segments=args.merge_segments,
            progress=ProgressBar(not args.quiet and len(requests) > 1))
    except ValueError as e:  # e.g. a language the tokenizer does not know, named with its manifest line
        sys.exit(f"error: {e}")

    # --- output

    failed = [r for r in results if r.error is not None]
    for r in results:
        if r.error is None:
            print(f"{r.request.audio_filepath}\t{r.pred_text}")
    for r in failed:
        where = "" if r.request.where == r.request.audio_filepath else f" ({r.request.where})"
        print(f"FAILED {r.request.audio_filepath}{where}: {r.error}", file=sys.stderr)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            for r in results:
                f.write(json.dumps(r.to_json(args.timestamps), ensure_ascii=False) + "\n")
    if args.subtitles:
        write_subtitles(results, args.subtitles, args.timestamps)

    print_scores(results, args.normalizer)
    print_unsaid(results, options, detector_name(args.vad, loaded.features.sample_rate))
    t = timings
    print(f"RTFx {t.rtfx:.1f}: {t.audio:.1f} s of audio in {t.wall:.2f} s (load+features {t.load_features:.2f} s, "
          f"encoder {t.encoder:.2f} s, decoder {t.decoder:.2f} s"
          f"{f', alignment {t.align:.2f} s' if t.align else ''}; model loading {t_load:.1f} s not counted); "
          f"{len(results) - len(failed)} transcribed, {len(failed)} failed", file=sys.stderr)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
