"""infer.py --stream's input and output: files decoded as streams, their hypotheses growing on the
terminal (what the decoder is about to commit in grey), each token's time and the latency in --out;
and raw PCM from standard input captioned as it arrives, a line per sentence. The decoding itself is
aed/decode_stream.py; aed/cli_infer.py parses the flags and builds the Streamer."""

import json
import math
import os
import shutil
import sys

import numpy as np

from aed.data_manifest import PROMPT_TASKS
from aed.decode_metrics import stream_latency
from aed.decode_stream import Streamer, stream_requests
from aed.decode_transcribe import Request


def with_partial(stream, first: int, room: int) -> str:
    """The stream's text from committed token `first` on, and in grey what it is about to commit
    (`Stream.partial`), the newest `room` characters of it."""
    text, more = stream.sentence_text(first), stream.sentence_text(first, partial=True)
    tail = more[len(text):] if more.startswith(text) else ""
    if len(text) + len(tail) > room:
        cut, committed = len(text) + len(tail) - room + 1, len(text)  # characters dropped from the front
        text, tail = "…" + text[cut:], tail[max(0, cut - committed):]
    return text + (f"\x1b[2m{tail}\x1b[0m" if tail else "")


class LiveLines:
    """The growing hypotheses of a batch of streams on a terminal, one line per file, redrawn in place."""

    def __init__(self):
        self.batch, self.drawn = None, 0

    def __call__(self, pairs) -> None:
        width = shutil.get_terminal_size().columns - 1
        if pairs[0][1] is not self.batch:  # a new batch of files: draw below the last one
            self.batch, self.drawn = pairs[0][1], 0
        out = f"\x1b[{self.drawn}F" if self.drawn else ""
        for res, s in pairs:
            name = os.path.basename(res.request.audio_filepath)
            out += f"\x1b[2K{name}: {with_partial(s, 0, max(10, width - len(name) - 2))}\n"
        sys.stdout.write(out)
        sys.stdout.flush()
        self.drawn = len(pairs)


# --- files ------------------------------------------------------------------------------------

def stream_files(streamer: Streamer, requests: list[Request], batch: int, realtime: bool, out: str | None,
                 live: bool) -> tuple[list, list[dict]]:
    """Decode the files as streams, `batch` at a time: on a terminal (`live`) their lines redrawn as
    they grow, else `path<TAB>text` once each is done; failures on stderr; with `out`, a JSONL line
    per file with each token's and word's time and the latency. Returns the Results and the
    latencies (`stream_latency`) of the streams that ran."""
    decoded = stream_requests(streamer, requests, batch, realtime, LiveLines() if live else None)
    results = [res for res, _, _ in decoded]
    if not live:
        for r in results:
            if r.error is None:
                print(f"{r.request.audio_filepath}\t{r.pred_text}")
    for r in results:
        if r.error is not None:
            print(f"FAILED {r.request.audio_filepath}: {r.error}", file=sys.stderr)
    if out:
        with open(out, "w", encoding="utf-8") as f:
            for res, s, latency in decoded:
                line = res.to_json()
                if s is not None:
                    line["tokens"] = [{"token": streamer.tokenizer.id_to_token(t.id), "time": round(t.time, 3),
                                       "compute": round(t.compute, 4)} for t in s.tokens]
                    line["words"] = [{"text": w, "time": round(t, 3), "compute": round(c, 4)} for w, t, c in s.words()]
                    line["latency"] = {k: None if math.isnan(v) else round(v, 1) for k, v in latency.items()}
                f.write(json.dumps(line, ensure_ascii=False) + "\n")
    return results, [latency for _, _, latency in decoded if latency is not None]


def print_latency(latencies: list[dict]) -> None:
    """The streams' mean latency and real-time factor, on stderr (nothing when none ran)."""
    if not latencies:
        return

    def mean(key):
        values = [m[key] for m in latencies if not math.isnan(m[key])]
        return sum(values) / len(values) if values else math.nan
    print(f"latency, ms of audio (mean of {len(latencies)} file(s)): AL {mean('al'):.0f}, LAAL {mean('laal'):.0f}; "
          f"with computation: AL {mean('al_ca'):.0f}, LAAL {mean('laal_ca'):.0f}; first word {mean('first_word'):.0f}; "
          f"words committed {mean('spoken_lag'):.0f} after they were spoken (CTC alignment); "
          f"real-time factor {mean('rtf_mean'):.3f} (processing s per audio s), its longest step "
          f"{mean('rtf_max'):.3f} x the chunk", file=sys.stderr)


# --- standard input ---------------------------------------------------------------------------

CONTAINERS = {b"RIFF": "a WAV file", b"fLaC": "a FLAC file", b"OggS": "an Ogg file", b"ID3": "an MP3 file",
              b"\x1aE\xdf\xa3": "a WebM/Matroska file"}


def container(head: bytes) -> str | None:
    """What the first bytes of a stream say it is, when it is a known audio container, not raw PCM."""
    if head[4:8] == b"ftyp":
        return "an MP4/M4A file"
    return next((name for magic, name in CONTAINERS.items() if head.startswith(magic)), None)


def caption_stdin(streamer: Streamer, req: Request) -> int:
    """Raw 16-bit mono PCM from standard input, captioned as it arrives (the task of `req`): on a
    terminal one line redrawn in place, else the text printed as it grows. Returns the exit code."""
    stream = streamer.open(req.source_lang, req.target_lang, req.pnc, PROMPT_TASKS[req.taskname])
    tty, printed = sys.stdout.isatty(), 0  # tokens printed as ended sentences
    piece = streamer.rate // 10 * 2  # bytes: 0.1 s

    def show(final: bool = False):
        """Each ended sentence on a line of its own; on a terminal the current one below, redrawn in place
        with its uncommitted continuation in grey."""
        nonlocal printed
        ended = len(stream.tokens) if final else stream.sentence_tokens
        out = "\r\x1b[2K" if tty else ""
        if ended > printed:
            text = stream.sentence_text(printed, ended).strip()
            out += text + "\n" if text else ""
            printed = ended
        if tty and not final:
            out += with_partial(stream, printed, shutil.get_terminal_size().columns - 1).lstrip()
        sys.stdout.write(out)
        sys.stdout.flush()

    stdin = sys.stdin.buffer
    buffered = stdin.read(8)
    kind = container(buffered)
    if kind:
        sys.exit(f"error: standard input is {kind}, not raw PCM: pipe raw 16-bit mono samples at {streamer.rate} Hz "
                 f"(arecord -t raw -f S16_LE -r {streamer.rate} -c 1, or ffmpeg -i FILE -f s16le -ac 1 -ar "
                 f"{streamer.rate} -), or give the file as an input")
    while True:
        usable = len(buffered) // 2 * 2
        if usable:
            samples = np.frombuffer(buffered[:usable], dtype="<i2").astype(np.float32) / 32768
            buffered = buffered[usable:]
            stream.feed(samples)
            show()
        data = stdin.read1(piece)
        if not data:
            break
        buffered += data
    if buffered:
        print("standard input ended inside a sample (an odd number of bytes): its last byte is dropped", file=sys.stderr)
    stream.finish()
    show(final=True)
    seconds = stream.received / streamer.rate
    if not seconds:
        print("no audio on standard input", file=sys.stderr)
        return 0
    m = stream_latency(stream, seconds)
    first = f"first word after {m['first_word']:.0f} ms of audio" if stream.tokens else "no words"
    emptied = (f" ({stream.skipped_sentences} emptied by the no-speech check, {stream.skipped_seconds:.1f} s)"
               if stream.skipped_sentences else "")
    print(f"{seconds:.1f} s of audio, {len(stream.tokens)} tokens in {stream.sentences} sentence(s){emptied}; {first}; "
          f"real-time factor {m['rtf_mean']:.3f} (processing s per audio s), its longest step {m['rtf_max']:.3f} "
          "x the chunk", file=sys.stderr)
    return 0
