"""A manifest (JSONL, one utterance a line) from a folder of recorded prompts and their transcript:
real recorded speech to measure on where the bundled sets are synthetic. Debian packages two such
sets that install without an account or a download script:

    # the Asterisk PBX's voice prompts: 8 kHz WAVs, transcript lines `name: text`
    apt-get install asterisk-core-sounds-en-wav asterisk-core-sounds-es-wav asterisk-core-sounds-fr-wav
    python tools/manifest_from_prompts.py --lang en -o runs/prompts/en.jsonl
    python tools/manifest_from_prompts.py --lang fr --audio /usr/share/asterisk/sounds/fr_CA_f_June \\
        -o runs/prompts/fr.jsonl
    # CMU Sphinx's test recordings (16 kHz, read speech), transcript lines `<s> text </s> (name)`
    apt-get install pocketsphinx-testdata
    python tools/manifest_from_prompts.py --lang en --format sphinx \\
        --audio /usr/share/pocketsphinx/test/data/librivox \\
        --transcript /usr/share/pocketsphinx/test/data/librivox/transcription -o runs/prompts/librivox.jsonl

Without --audio and --transcript, the Asterisk prompts of --lang where Debian installs them
(/usr/share/asterisk/sounds/LANG and /usr/share/doc/asterisk-core-sounds-LANG/core-sounds-LANG.txt.gz).
A transcript line names a file by its path under --audio without the extension (`digits/7`);
`;` starts a comment line; a plain or gzipped file. Notes in brackets or parentheses
(`dot [.]`, `[ascending tones]`, `(1 second of silence)`) are not words and are dropped; a prompt
left with no words (a tone, silence) is skipped. So are prompts whose audio is missing or cannot be
read, and audio files that the transcript does not name: each skip is logged with its reason, and
the counts at the end. Lines are sorted by name; audio paths are absolute.
"""

import argparse
import gzip
import json
import os
import re
import sys
from collections import Counter

from aed.data_audio import AudioError, audio_seconds

ASTERISK_AUDIO = "/usr/share/asterisk/sounds/{lang}"
ASTERISK_TRANSCRIPT = "/usr/share/doc/asterisk-core-sounds-{lang}/core-sounds-{lang}.txt.gz"
SPHINX_LINE = re.compile(r"(?:<s>)?(.*?)(?:</s>)?\s*\(([^()]+)\)\s*$")  # `<s> text </s> (name)`
NOTE = re.compile(r"\[[^\]]*\]|\([^)]*\)")  # a bracketed or parenthesised note: not spoken words


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lang", required=True, help="the prompts' language (source_lang and target_lang)")
    p.add_argument("--audio", help=f"folder of the recordings (default: {ASTERISK_AUDIO})")
    p.add_argument("--transcript", help=f"the transcript (default: {ASTERISK_TRANSCRIPT})")
    p.add_argument("--format", choices=["asterisk", "sphinx"], default="asterisk",
                   help="transcript lines `name: text` (asterisk) or `<s> text </s> (name)` (sphinx)")
    p.add_argument("--ext", default="wav", help="the recordings' file extension (default wav)")
    p.add_argument("-o", "--out", required=True, help="the manifest to write")
    args = p.parse_args(argv)
    args.audio = args.audio or ASTERISK_AUDIO.format(lang=args.lang)
    args.transcript = args.transcript or ASTERISK_TRANSCRIPT.format(lang=args.lang)
    return args


def read_transcript(path: str, fmt: str) -> dict[str, str]:
    """{name: text as written} of a transcript's lines, comments and blank lines left out."""
    with (gzip.open if path.endswith(".gz") else open)(path, "rt", encoding="utf-8") as f:
        lines = [line.strip() for line in f]
    texts = {}
    for number, line in enumerate(lines, 1):
        if not line or line.startswith(";"):
            continue
        if fmt == "sphinx":
            match = SPHINX_LINE.match(line)
            name, text = (match.group(2), match.group(1)) if match else (None, "")
        else:
            name, colon, text = line.partition(":")
            name = name if colon else None
        if name is None:
            print(f"{path}:{number}: not a `{fmt}` transcript line, left out: {line[:60]!r}", file=sys.stderr)
            continue
        texts[name.strip()] = text
    return texts


def spoken(text: str) -> str:
    """The words of a transcript text: notes in brackets or parentheses dropped, spaces collapsed."""
    return " ".join(NOTE.sub(" ", text).split())


def main(argv=None) -> int:
    args = parse_args(argv)
    for what, path in (("--audio", args.audio), ("--transcript", args.transcript)):
        if not os.path.exists(path):
            sys.exit(f"{what} {path}: not found (the Asterisk defaults need asterisk-core-sounds-{args.lang}-wav)")
    texts = read_transcript(args.transcript, args.format)
    suffix = "." + args.ext
    on_disk = {os.path.relpath(os.path.join(folder, f), args.audio)[: -len(suffix)]
               for folder, _, files in os.walk(args.audio, followlinks=True) for f in files if f.endswith(suffix)}
    skipped, rows = Counter(), []
    for name in sorted(on_disk - set(texts)):
        print(f"skipping {name}{suffix}: not in the transcript", file=sys.stderr)
        skipped["no transcript"] += 1
    for name in sorted(texts):
        path = os.path.abspath(os.path.join(args.audio, name + suffix))
        text = spoken(texts[name])
        if not text:
            why = "no words in the transcript: " + (texts[name].strip() or "(empty)")
        elif name not in on_disk:
            why = "no audio file"
        else:
            try:
                rows.append({"audio_filepath": path, "duration": round(audio_seconds(path), 3), "text": text,
                             "source_lang": args.lang, "target_lang": args.lang, "pnc": "yes", "taskname": "asr"})
                continue
            except AudioError as e:
                why = f"unreadable audio: {e}"
        print(f"skipping {name}: {why}", file=sys.stderr)
        skipped[why.split(":")[0]] += 1
    if not rows:
        sys.exit(f"{args.transcript}: no prompt with words and readable audio under {args.audio}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    counts = ", ".join(f"{n} {why}" for why, n in sorted(skipped.items())) or "none"
    hours = sum(r["duration"] for r in rows) / 3600
    print(f"wrote {args.out}: {len(rows)} prompts ({hours:.2f} h); skipped: {counts}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
