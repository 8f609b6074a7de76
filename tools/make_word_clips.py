"""Speak single words with espeak-ng and trim them to the speech: audio whose word boundaries are known.

    python tools/make_word_clips.py -o tests/fixtures/words    # the committed clips (needs espeak-ng)

The timestamp tests (tests/test_timestamps.py) concatenate these clips with silences of known
length, so every word's true start and end is known to the sample. espeak-ng pads its output
with silence; each clip is cut to the span where the 10 ms frame energy is within 40 dB of the
loudest frame, so a clip's first and last samples are its word's boundaries.

Output: <word>.flac (16 kHz mono 16-bit) per word, and words.json {word: duration in seconds}.
"""

import argparse
import io
import json
import os
import subprocess

import soundfile as sf
import torch
import torchaudio.functional as AF

WORDS = ("red", "green", "blue", "seven", "house", "water", "morning", "table")
SAMPLE_RATE = 16000
FLOOR_DB = 40.0  # frames quieter than the loudest by more than this are silence


def speak(word: str, voice: str, rate: int) -> torch.Tensor:
    """espeak-ng's waveform for `word`, at SAMPLE_RATE, trimmed to the speech."""
    wav_bytes = subprocess.run(["espeak-ng", "-v", voice, "-s", str(rate), "--stdout", word],
                               check=True, capture_output=True).stdout
    wav, sr = sf.read(io.BytesIO(wav_bytes), dtype="float32")
    wav = AF.resample(torch.from_numpy(wav), sr, SAMPLE_RATE)
    hop = SAMPLE_RATE // 100
    energy = wav[: wav.numel() // hop * hop].view(-1, hop).pow(2).mean(dim=1)  # (frames,)
    loud = (10 * torch.log10(energy / energy.max() + 1e-12) > -FLOOR_DB).nonzero().flatten()
    return wav[int(loud[0]) * hop: (int(loud[-1]) + 1) * hop]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-o", "--out", required=True, help="output folder")
    p.add_argument("--voice", default="en-us")
    p.add_argument("--rate", type=int, default=150, help="words per minute (espeak-ng -s)")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    durations = {}
    for word in WORDS:
        wav = speak(word, args.voice, args.rate)
        sf.write(os.path.join(args.out, f"{word}.flac"), wav.numpy(), SAMPLE_RATE, subtype="PCM_16")
        durations[word] = round(wav.numel() / SAMPLE_RATE, 4)
    with open(os.path.join(args.out, "words.json"), "w") as f:
        json.dump(durations, f, indent=1)
    print(f"{len(WORDS)} clips in {args.out}: {durations}")


if __name__ == "__main__":
    main()
