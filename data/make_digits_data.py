"""Build data/mini/digits/: spoken digit strings in English, German, French and Spanish.

The sentence part of the mini set (make_mini_data.py) is too small for a model trained from
scratch to recognise unseen sentences: most dev words never occur in training. Connected digits
are the classic answer (TIDIGITS): a closed vocabulary of ten words per language, so every dev
word is well trained, yet every dev string is new. A tiny model learns to transcribe them within
a few hundred CPU steps, which is what the training test and the demo need to show that dev WER
falls for real.

Strings are 2 to 5 digits, spoken by espeak-ng with a voice, rate, pitch and level drawn per
utterance (as for the sentences). Text is written in words with PnC, e.g. "Drei null sieben.";
no string appears in both train and dev.

    apt-get install espeak-ng
    python data/make_digits_data.py -o data/mini/digits --seed 0     # the committed set, ~20 s
    python data/make_digits_data.py -o /tmp/it_digits --langs it     # Italian, for the new-language recipe

Output (an existing audio/ sub-folder is replaced): train.jsonl, dev.jsonl and audio/*.flac,
in the format of the sentence manifests (audio paths relative to the output folder).
"""

import argparse
import multiprocessing
import os
import random
import shutil
import sys

from make_mini_data import ACCENTS, LANGS, VARIANTS, Job, _worker_init, run_split, summarize, \
    write_manifest

ACCENTS = {**ACCENTS, "it": ["it"]}  # Italian is not in the sentence set: a language to add to a trained model

DIGITS = {
    "en": "zero one two three four five six seven eight nine".split(),
    "de": "null eins zwei drei vier fünf sechs sieben acht neun".split(),
    "fr": "zéro un deux trois quatre cinq six sept huit neuf".split(),
    "es": "cero uno dos tres cuatro cinco seis siete ocho nueve".split(),
    "it": "zero uno due tre quattro cinque sei sette otto nove".split(),
}
MIN_DIGITS, MAX_DIGITS = 2, 5


def plan_strings(rng, per_split, langs):
    """-> {split: {lang: [digit tuple, ...]}}: distinct strings, none shared by two splits."""
    plan = {split: {} for split in per_split}
    for lang in langs:
        used = set()
        for split, n in per_split.items():
            strings = []
            while len(strings) < n:
                digits = tuple(rng.randrange(10) for _ in range(rng.randint(MIN_DIGITS, MAX_DIGITS)))
                if digits not in used:
                    used.add(digits)
                    strings.append(digits)
            plan[split][lang] = strings
    return plan


def plan_jobs(split, strings, rng):
    """Yield one Job per string, taking turns between the languages."""
    for i in range(max(len(s) for s in strings.values())):
        for lang in strings:
            if i < len(strings[lang]):
                text = " ".join(DIGITS[lang][d] for d in strings[lang][i]).capitalize() + "."
                voice = rng.choice(ACCENTS[lang]) + rng.choice(VARIANTS)
                yield Job(f"{split}_{lang}_{i + 1:06d}", lang, lang, text, text, voice,
                          rate=rng.randint(150, 210), pitch=rng.randint(30, 70),
                          gain_db=round(rng.uniform(-18.0, -6.0), 1))


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-o", "--output", required=True, help="output folder, e.g. data/mini/digits")
    parser.add_argument("--seed", type=int, default=0, help="same seed -> byte-identical output")
    parser.add_argument("--train-per-lang", type=int, default=100, help="train strings per language")
    parser.add_argument("--dev-per-lang", type=int, default=12, help="dev strings per language")
    parser.add_argument("--langs", nargs="+", default=list(LANGS), choices=sorted(DIGITS),
                        help="languages to speak (the committed set: en de fr es)")
    parser.add_argument("--num-workers", type=int, default=os.cpu_count() or 1,
                        help="parallel espeak-ng processes")
    args = parser.parse_args()
    if shutil.which("espeak-ng") is None:
        sys.exit("missing: espeak-ng\ninstall with: apt-get install espeak-ng")

    rng = random.Random(args.seed)
    strings = plan_strings(rng, {"dev": args.dev_per_lang, "train": args.train_per_lang}, args.langs)
    shutil.rmtree(os.path.join(args.output, "audio"), ignore_errors=True)
    os.makedirs(os.path.join(args.output, "audio"))
    entries = {}
    with multiprocessing.get_context("fork").Pool(args.num_workers, initializer=_worker_init) as pool:
        for split in ("dev", "train"):
            jobs = plan_jobs(split, strings[split], rng)
            entries[split] = run_split(split, jobs, args.output, pool, None)
            write_manifest(os.path.join(args.output, f"{split}.jsonl"), entries[split])
    print(f"wrote {args.output}:")
    for split in ("train", "dev"):
        summarize(split, entries[split])


if __name__ == "__main__":
    main()
