"""Build the bundled multilingual mini data set (data/mini/) from synthesized speech.

English, German, French and Spanish sentences from Debian text packages are spoken by espeak-ng
with a voice, speaking rate, pitch and level drawn per utterance from a seeded RNG, and written as
16 kHz mono FLAC with NeMo-style JSONL manifests. English->Spanish and Spanish->English speech
translation pairs use Apertium's translation of the spoken sentence as the target text.

Text sources (all Debian packages):
    en: fortunes        de: fortunes-de        es: fortunes-es
    fr: gnome-user-docs and libreoffice-help-fr (the French GNOME and LibreOffice help; Debian has
        no French fortune package, and GNOME's help alone gives only 131 clean sentences)

Dependencies (Debian/Ubuntu):
    apt-get install espeak-ng apertium apertium-eng-spa fortunes fortunes-de fortunes-es \\
        gnome-user-docs libreoffice-help-fr

The committed data/mini/ was produced by (about 30 s on 2 cores; it predates the LibreOffice source):
    python data/make_mini_data.py -o data/mini --seed 0 --french-text gnome-help

A larger corpus for benchmarks, about 10 hours (~15 minutes on 2 cores; sentences repeat with
fresh voices, and train and dev still share no sentence):
    python data/make_mini_data.py -o /tmp/mini10h --hours 10 --num-workers 2

The laptop recipe's corpus (configs/laptop.yaml; ~5 minutes): 9 hours of train, 150 dev and 240 test
utterances; the test sentences are in neither train nor dev, and are spoken by voice variants
(TEST_VARIANTS) that no train or dev utterance uses:
    python data/make_mini_data.py -o data/sentences --hours 9 --dev-per-lang 25 --test-per-lang 40

The same with sentences of 3-30 words (mean ~11 words, ~4.5 s; up to ~17 s), nearer real users'
utterances; a second seed draws other sentences, voices and splits:
    python data/make_mini_data.py -o data/long --hours 9 --dev-per-lang 25 --test-per-lang 40 --words 3-30

Output (existing audio/ and examples/ sub-folders of the output folder are replaced):
    train.jsonl, dev.jsonl   one utterance per line: audio_filepath (relative to the manifest's
    (test.jsonl)             folder), duration, text, source_lang, target_lang, pnc, taskname
    audio/*.flac             16 kHz mono 16-bit FLAC
    examples/*.wav           three training utterances as WAV files for infer.py, one of them
    examples.jsonl           resampled to 44.1 kHz stereo to exercise the loader's conversions
"""

import argparse
import glob
import html
import io
import json
import multiprocessing
import os
import random
import re
import shutil
import subprocess
import sys
import time
import unicodedata
from dataclasses import dataclass

import numpy as np
import soundfile as sf
import torch
import torchaudio.functional as AF

LANGS = ("en", "de", "fr", "es")
SPLITS = ("dev", "test", "train")
AST_PAIRS = (("en", "es"), ("es", "en"))
APERTIUM_MODES = {("en", "es"): "eng-spa", ("es", "en"): "spa-eng"}
APT_PACKAGES = ("espeak-ng apertium apertium-eng-spa fortunes fortunes-de fortunes-es gnome-user-docs "
                "libreoffice-help-fr")

SAMPLE_RATE = 16000
DEFAULT_WORDS = "3-8"  # short sentences: more utterances fit in data/mini's ~12 MB budget
LEAD_SILENCE, TAIL_SILENCE = 0.10, 0.15  # seconds of silence kept around the speech
MAX_UNKNOWN = 0  # an unknown word stays untranslated in the target text; candidates are plentiful
AST_CANDIDATE_FACTOR = 3  # translate this many candidates per wanted pair; some are rejected
CHUNK = 128  # utterances per progress line; also the granularity at which --hours stops

# --- text sources

FORTUNES = "/usr/share/games/fortunes"
# Quotations, proverbs and aphorisms. Skipped: the offensive (off/) and ethnic collections, ASCII
# art, dialogues, recipes, program code, definitions and TV-series quotes.
FORTUNE_FILES = {
    "en": ["art", "education", "food", "fortunes", "goedel", "humorists", "kids", "law", "literature",
           "love", "magic", "medicine", "miscellaneous", "paradoxum", "people", "pets", "platitudes",
           "science", "songs-poems", "sports", "tao", "wisdom", "work"],
    "de": ["de/anekdoten", "de/kinderzitate", "de/letzteworte", "de/lieberals", "de/mathematiker",
           "de/murphy", "de/regeln", "de/sprichworte", "de/sprichwortev", "de/sprueche",
           "de/stilblueten", "de/tips", "de/unfug", "de/zitate"],
    "es": ["es/amistad.fortunes", "es/arte.fortunes", "es/ciencia.fortunes", "es/familia.fortunes",
           "es/famosos.fortunes", "es/filosofia.fortunes", "es/humanos.fortunes", "es/lao-tse.fortunes",
           "es/leydemurphy.fortunes", "es/libertad.fortunes", "es/poder.fortunes",
           "es/proverbios.fortunes", "es/refranes.fortunes", "es/sabiduria.fortunes",
           "es/sentimientos.fortunes", "es/verdad.fortunes", "es/vida.fortunes"],
}
# French instructions ("Sélectionnez l'image dans votre document."): natural, well punctuated prose.
FRENCH_HELP = {"gnome-help": "/usr/share/help/fr/gnome-help",  # 131 clean sentences
               "libreoffice-help": "/usr/share/libreoffice/help/fr"}  # 1320 (LibreOffice 7.4); 1450 together

LETTERS = {
    "en": "a-zA-Z",
    "de": "a-zA-ZäöüÄÖÜß",
    "fr": "a-zA-ZàâæçéèêëîïôœùûüÿÀÂÆÇÉÈÊËÎÏÔŒÙÛÜŸ",
    "es": "a-zA-ZáéíóúüñÁÉÍÓÚÜÑ",
}
# Words of another language: drops untranslated English paragraphs in the French help and
# foreign quotations in the fortunes.
FOREIGN_WORDS = {
    "en": {"und", "der", "ist", "nicht", "el", "los", "que", "est", "les", "une", "et", "la"},
    "de": {"the", "and", "you", "is", "of", "with", "this", "that", "el", "que", "les"},
    "fr": {"the", "and", "you", "your", "is", "of", "with", "this", "will", "can", "to"},
    "es": {"the", "and", "you", "is", "of", "with", "this", "that", "und", "der", "les"},
}
# A demo data set should not make its users wince; the fortunes have some coarse lines.
CRUDE_WORDS = {"fuck", "fucking", "shit", "ass", "bitch", "scheiße", "scheiß", "arsch", "ficken",
               "mierda", "puta", "coño", "cojones", "culo", "joder", "merde", "putain"}
# Sentence splitting at these would cut a sentence in two.
ABBREVIATIONS = {"mr.", "mrs.", "ms.", "dr.", "st.", "jr.", "sr.", "sra.", "vs.", "etc.", "z.b.",
                 "bzw.", "usw.", "ca.", "dh.", "d.h.", "ggf.", "prof.", "no.", "nr.", "m.", "mme."}


def read_fortunes(path):
    """A fortune file -> its entries as single-line strings, attribution lines removed."""
    with open(path, encoding="utf-8", errors="replace") as f:
        entries = f.read().split("\n%\n")
    out = []
    for entry in entries:
        # Attributions are indented "-- Author" lines; everything after them is source detail.
        lines = []
        for line in entry.splitlines():
            if re.match(r"\s*(--|—|~)", line):
                break
            lines.append(line)
        out.append(" ".join(lines))
    return out


def read_help_pages(folder):
    """French help pages -> the text of every paragraph without inline markup.

    GNOME's Mallard pages (*.page) count plain <p> elements; LibreOffice's HTML pages (*.html) put
    an id and class on every <p>.
    """
    out = []
    for pattern, paragraph in (("*.page", r"<p>(.*?)</p>"), ("**/*.html", r"<p [^>]*>(.*?)</p>")):
        for path in sorted(glob.glob(os.path.join(folder, pattern), recursive=True)):
            with open(path, encoding="utf-8", errors="replace") as f:  # a stray byte fails the letter check
                page = f.read()
            for para in re.findall(paragraph, page, re.S):
                if "<" not in para:  # inline markup (links, GUI labels, keys) does not read well
                    out.append(html.unescape(para))
    return out


def split_sentences(paragraph):
    return re.split(r"(?<=[.!?])\s+", paragraph)


def clean_sentence(s, lang, words_range):
    """Normalise one candidate sentence; None when it is not a clean, speakable PnC sentence of
    words_range = (min, max) words."""
    s = unicodedata.normalize("NFC", s).replace("’", "'").replace("‘", "'")
    s = " ".join(s.split())  # also turns French non-breaking spaces before "?!;" into spaces
    letters = LETTERS[lang]
    opening = "¿¡" if lang == "es" else ""
    words = s.split()
    if not words_range[0] <= len(words) <= words_range[1]:
        return None
    # Letters, apostrophes, intra-word hyphens and sentence punctuation only: no digits, quotes,
    # brackets, colons, dashes or ellipses, which a listener cannot hear.
    if not re.fullmatch(rf"[{opening}]?[{letters}][{letters}' ,;{opening}?!.-]*[.!?]", s):
        return None
    if not s.lstrip(opening)[0].isupper():
        return None  # a fragment from a sentence split in two
    if re.search(r"[.!?][.!?]|--|\s-|-\s|-[.,;!?]|''|'\s|\s'|,[^ ]|;[^ ]", s):
        return None
    if words[-1].lower() in ABBREVIATIONS or re.search(r"(^|\s)[A-Za-z]\.", s):
        return None  # cut at an abbreviation, or contains initials
    if any(len(w.strip(".,;!?¿¡")) > 1 and w.strip(".,;!?¿¡").isupper() for w in words):
        return None  # acronyms and shouting: spelled-out letters make poor transcripts
    if lang == "es" and (s.count("¿"), s.count("¡")) != (s.count("?"), s.count("!")):
        return None  # Spanish questions and exclamations must open and close
    if {w.strip(".,;!?¿¡").lower() for w in words} & (FOREIGN_WORDS[lang] | CRUDE_WORDS):
        return None
    return s


def dedup_key(s):
    """Case- and punctuation-insensitive identity of a sentence, for dedup and train/dev checks."""
    return " ".join(re.sub(r"[^\w\s]", " ", s.lower()).split())


def load_sentences(lang, french_text, words_range):
    """All clean sentences of one language, deduplicated and sorted (the RNG shuffles later)."""
    if lang == "fr":
        paragraphs = [p for name in french_text for p in read_help_pages(FRENCH_HELP[name])]
    else:
        paragraphs = [e for name in FORTUNE_FILES[lang] for e in read_fortunes(os.path.join(FORTUNES, name))]
    by_key = {}
    for paragraph in paragraphs:
        for s in split_sentences(paragraph):
            s = clean_sentence(s, lang, words_range)
            if s is not None:
                by_key.setdefault(dedup_key(s), s)
    return sorted(by_key.values())


def translate(sentences, src, tgt):
    """Translate with one Apertium process, one sentence per line.

    Returns one entry per input: the translation with Apertium's markers (*unknown, #generation
    error, @transfer error) stripped, or None when more than MAX_UNKNOWN words are marked * or @.
    """
    mode = APERTIUM_MODES[(src, tgt)]
    proc = subprocess.run(["apertium", mode], input="\n".join(sentences) + "\n",
                          capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"apertium {mode} failed ({proc.stderr.strip()}); install apertium-eng-spa")
    lines = proc.stdout.rstrip("\n").split("\n")
    if len(lines) != len(sentences):
        sys.exit(f"apertium {mode}: got {len(lines)} lines for {len(sentences)} sentences")
    out = []
    for line in lines:
        if len(re.findall(r"[*@](?=\w)", line)) > MAX_UNKNOWN:
            out.append(None)
            continue
        text = re.sub(r"[*#@](?=\w)", "", line)
        text = re.sub(r"\s+([.,;!?])", r"\1", " ".join(text.split()))  # "Lo siento ." -> "Lo siento."
        if tgt == "es":  # Apertium keeps English punctuation; Spanish opens questions and exclamations
            for opening, closing in (("¿", "?"), ("¡", "!")):
                if text.endswith(closing) and opening not in text:
                    text = opening + text
        out.append(text[:1].upper() + text[1:] if text.strip("¿¡") else None)
    return out


# --- planning: which sentence is spoken by which voice


@dataclass(frozen=True)
class Job:
    """One utterance to synthesize."""
    name: str  # file stem, e.g. "train_en-es_000012"
    source_lang: str
    target_lang: str
    spoken: str  # the source-language sentence espeak-ng reads
    text: str  # the manifest text: `spoken` for ASR, its translation for AST
    voice: str  # espeak-ng voice with variant, e.g. "en-us+f2"
    rate: int  # words per minute (espeak-ng -s)
    pitch: int  # 0..99 (espeak-ng -p)
    gain_db: float  # level below espeak-ng's near-full-scale output


ACCENTS = {"en": ["en-us", "en-gb", "en-gb-x-rp", "en-gb-scotland"], "de": ["de"],
           "fr": ["fr-fr", "fr-be", "fr-ch"], "es": ["es", "es-419"]}
VARIANTS = ["", "+m1", "+m2", "+m3", "+m4", "+m5", "+m7", "+f1", "+f2", "+f3", "+f4", "+f5"]
# The test split's voices: variants no train or dev utterance uses.
TEST_VARIANTS = ["+m6", "+Andy", "+Annie", "+anika", "+john"]


def split_pool(lang, sentences, rng, args):
    """Shuffle one language's sentences and cut them into disjoint dev/test/train ASR and AST lists.

    Returns {(split, target_lang): [sentence, ...]}; AST lists hold candidates, more than needed,
    because some translations are rejected.
    """
    pool = list(sentences)
    rng.shuffle(pool)
    n_ast_dev = AST_CANDIDATE_FACTOR * args.dev_per_lang if lang in ("en", "es") else 0
    dev_asr, pool = pool[:args.dev_per_lang], pool[args.dev_per_lang:]
    dev_ast, pool = pool[:n_ast_dev], pool[n_ast_dev:]
    n_ast_test = AST_CANDIDATE_FACTOR * args.test_per_lang if lang in ("en", "es") else 0
    test_asr, pool = pool[:args.test_per_lang], pool[args.test_per_lang:]
    test_ast, pool = pool[:n_ast_test], pool[n_ast_test:]
    if lang not in ("en", "es"):
        train_ast, train_asr = [], pool
    elif args.ast_pairs is None:  # --hours: a third of what is left becomes translation candidates
        train_ast, train_asr = pool[:len(pool) // 3], pool[len(pool) // 3:]
    else:
        n = AST_CANDIDATE_FACTOR * args.ast_pairs
        train_ast, train_asr = pool[:n], pool[n:]
    n_train = len(train_asr) if args.train_per_lang is None else args.train_per_lang
    if n_train > len(train_asr) or len(dev_asr) < args.dev_per_lang:
        print(f"{lang}: only {len(train_asr)} train / {len(dev_asr)} dev sentences available "
              f"for ASR, asked for {n_train} / {args.dev_per_lang}")
    other = "es" if lang == "en" else "en"
    return {("dev", lang): dev_asr, ("dev", other): dev_ast,
            ("test", lang): test_asr, ("test", other): test_ast,
            ("train", lang): train_asr[:n_train], ("train", other): train_ast}


def plan_texts(args, rng):
    """-> {split: [(source_lang, target_lang, spoken, text), ...]} with train, dev and test disjoint."""
    lists = {}
    for lang in LANGS:
        sentences = load_sentences(lang, args.french_text, args.words)
        print(f"{lang}: {len(sentences)} clean sentences")
        for (split, tgt), items in split_pool(lang, sentences, rng, args).items():
            lists[(split, lang, tgt)] = items

    texts = {split: [(lang, lang, s, s) for lang in LANGS for s in lists[(split, lang, lang)]]
             for split in SPLITS}
    for src, tgt in AST_PAIRS:
        for split in ("train", "dev", "test"):
            # A translation can coincide with a sentence of another split ("Time is money.").
            taken = {dedup_key(t[i]) for other in SPLITS if other != split for t in texts[other] for i in (2, 3)}
            candidates = lists[(split, src, tgt)]
            translations = translate(candidates, src, tgt) if candidates else []
            pairs = [(src, tgt, s, t) for s, t in zip(candidates, translations)
                     if t is not None and dedup_key(t) not in taken]
            wanted = {"dev": args.dev_per_lang, "test": args.test_per_lang, "train": args.ast_pairs}[split]
            print(f"{split} {src}->{tgt}: {len(pairs)} of {len(candidates)} translations kept"
                  + (f", using {wanted}" if wanted is not None else ""))
            texts[split] += pairs[:wanted]

    # The property the whole set is built around: nothing said or written in dev or test is in train.
    keys = {split: {dedup_key(t[i]) for t in texts[split] for i in (2, 3)} for split in SPLITS}
    for a, b in (("train", "dev"), ("train", "test"), ("dev", "test")):
        assert not keys[a] & keys[b], f"{a}/{b} overlap: {sorted(keys[a] & keys[b])[:5]}"
    return texts


def plan_jobs(split, texts, rng, repeat, variants=VARIANTS):
    """Yield Jobs for one split, taking turns between the language pairs.

    Without `repeat` every text is spoken once. With `repeat` (--hours) each pair cycles through
    its texts forever, reshuffled and with fresh voices every pass; taking turns keeps the pairs
    equally represented wherever the caller stops, although French has far fewer sentences.
    """
    groups = {}
    for item in texts:
        src, tgt = item[:2]
        groups.setdefault(src if src == tgt else f"{src}-{tgt}", []).append(item)
    queues = {pair: [] for pair in groups}
    counters = dict.fromkeys(groups, 0)
    while queues:
        for pair in list(queues):
            if not queues[pair]:
                if counters[pair] and not repeat:
                    del queues[pair]
                    continue
                queues[pair] = rng.sample(groups[pair], len(groups[pair]))
            src, tgt, spoken, text = queues[pair].pop()
            counters[pair] += 1
            voice = rng.choice(ACCENTS[src]) + rng.choice(variants)
            yield Job(f"{split}_{pair}_{counters[pair]:06d}", src, tgt, spoken, text, voice,
                      rate=rng.randint(150, 210), pitch=rng.randint(30, 70),
                      gain_db=round(rng.uniform(-18.0, -6.0), 1))


# --- synthesis


def synthesize(job, out_dir):
    """Speak one Job, write audio/<name>.flac and return its manifest entry."""
    cmd = ["espeak-ng", "-v", job.voice, "-s", str(job.rate), "-p", str(job.pitch), "--stdout", job.spoken]
    proc = subprocess.run(cmd, capture_output=True, check=True)
    wav, sr = sf.read(io.BytesIO(proc.stdout), dtype="float32")
    # Keep the speech plus a short natural pause; espeak-ng pads ~0.4 s at the end, ~0 at the start.
    loud = np.flatnonzero(np.abs(wav) > 0.005)
    if len(loud) == 0:
        raise RuntimeError(f"{job.name}: espeak-ng produced silence for {job.spoken!r} ({job.voice})")
    start = max(0, loud[0] - int(0.05 * sr))  # weak onsets (f, s, h) begin below the threshold
    end = min(len(wav), loud[-1] + int(TAIL_SILENCE * sr))
    wav = np.concatenate([np.zeros(int(LEAD_SILENCE * sr), np.float32), wav[start:end]])
    wav = AF.resample(torch.from_numpy(wav), sr, SAMPLE_RATE).numpy()
    # Recordings rarely peak near full scale; the quieter level also makes FLAC ~20% smaller.
    wav *= 10 ** (job.gain_db / 20)
    pcm = np.clip(np.round(wav * 32768), -32768, 32767).astype(np.int16)
    rel = f"audio/{job.name}.flac"
    sf.write(os.path.join(out_dir, rel), pcm, SAMPLE_RATE, format="FLAC", subtype="PCM_16",
             compression_level=1.0)
    info = sf.info(os.path.join(out_dir, rel))  # the duration of what was written, not planned
    return {"audio_filepath": rel, "duration": round(info.frames / info.samplerate, 3), "text": job.text,
            "source_lang": job.source_lang, "target_lang": job.target_lang, "pnc": "yes",
            "taskname": "asr" if job.source_lang == job.target_lang else "ast"}


def _worker_init():
    torch.set_num_threads(1)  # parallelism comes from the processes


def run_split(split, jobs, out_dir, pool, max_hours):
    """Synthesize jobs in chunks; stop after the chunk that reaches max_hours (if given)."""
    entries, seconds, start = [], 0.0, time.time()
    while True:
        chunk = [next(jobs, None) for _ in range(CHUNK)]
        chunk = [j for j in chunk if j is not None]
        if not chunk:
            break
        for entry in pool.starmap(synthesize, [(j, out_dir) for j in chunk]):
            entries.append(entry)
            seconds += entry["duration"]
        goal = f" of {max_hours:.2f}" if max_hours else ""
        print(f"[{split}] {len(entries)} utterances, {seconds / 3600:.3f}{goal} h, "
              f"{len(entries) / (time.time() - start):.1f} utt/s", flush=True)
        if max_hours and seconds >= max_hours * 3600:
            break
    return sorted(entries, key=lambda e: e["audio_filepath"])


def write_manifest(path, entries):
    with open(path, "w", encoding="utf-8") as f:
        for e in entries:
            f.write(json.dumps(e, ensure_ascii=False) + "\n")


# --- demo examples


def write_examples(out_dir, train):
    """Copy three training utterances to examples/*.wav (16-bit PCM) plus examples.jsonl.

    They are deliberately IN the training set: a small model trained on the sentences can be
    shown transcribing (and translating) them. One is resampled to 44.1 kHz stereo, a bonus
    input that exercises the loader's resampling and down-mixing.
    """
    # (source, target, file name, sample rate or None to keep 16 kHz, duration window in s):
    # about 2 s long, a real sentence yet small on disk; the 44.1 kHz stereo file takes 5.5x the
    # bytes per second, so it gets a shorter one. A corpus of longer sentences has none that short:
    # then the pair's shortest utterance.
    picks = [("en", "en", "en_asr_16k.wav", None, (1.8, 2.6)),
             ("es", "en", "es-en_ast_16k.wav", None, (1.8, 2.6)),
             ("de", "de", "de_asr_44k_stereo.wav", 44100, (1.3, 1.8))]
    os.makedirs(os.path.join(out_dir, "examples"), exist_ok=True)
    entries = []
    for src, tgt, filename, rate, (shortest, longest) in picks:
        pair = [e for e in train if (e["source_lang"], e["target_lang"]) == (src, tgt)]
        if not pair:
            sys.exit(f"no {src}->{tgt} train utterance for {filename}")
        entry = next((e for e in pair if shortest <= e["duration"] <= longest), None)
        if entry is None:
            entry = min(pair, key=lambda e: e["duration"])
            print(f"{filename}: no {src}->{tgt} train utterance of {shortest}-{longest} s, taking the shortest "
                  f"({entry['duration']:.2f} s)", file=sys.stderr)
        pcm, sr = sf.read(os.path.join(out_dir, entry["audio_filepath"]), dtype="int16")
        if rate is not None:
            wav = AF.resample(torch.from_numpy(pcm / 32768.0).float(), sr, rate).numpy()
            wav = np.stack([wav, 0.5 * wav], axis=1)  # channels differ, as in a real stereo file
            pcm = np.clip(np.round(wav * 32768), -32768, 32767).astype(np.int16)
            sr = rate
        rel = f"examples/{filename}"
        sf.write(os.path.join(out_dir, rel), pcm, sr, format="WAV", subtype="PCM_16")
        info = sf.info(os.path.join(out_dir, rel))
        entries.append({**entry, "audio_filepath": rel, "duration": round(info.frames / info.samplerate, 3)})
    write_manifest(os.path.join(out_dir, "examples.jsonl"), entries)
    return entries


# --- main


def check_dependencies(french_text):
    missing = [tool for tool in ("espeak-ng", "apertium") if shutil.which(tool) is None]
    missing += [p for p in [FORTUNES + "/fortunes", FORTUNES + "/de", FORTUNES + "/es"]
                + [FRENCH_HELP[name] for name in french_text] if not os.path.exists(p)]
    if missing:
        sys.exit(f"missing: {', '.join(missing)}\ninstall with: apt-get install {APT_PACKAGES}")


def summarize(name, entries):
    rows = {}
    for e in entries:
        key = (e["taskname"], f"{e['source_lang']}->{e['target_lang']}")
        n, secs = rows.get(key, (0, 0.0))
        rows[key] = (n + 1, secs + e["duration"])
    for (task, pair), (n, secs) in sorted(rows.items()):
        print(f"  {name:<9} {task:<4} {pair:<7} {n:>6} utts {secs / 60:>8.2f} min")
    total = sum(e["duration"] for e in entries)
    print(f"  {name:<9} all  {'':<7} {len(entries):>6} utts {total / 60:>8.2f} min ({total / 3600:.3f} h)")


def words_range(text):
    """'3-30' -> (3, 30)."""
    try:
        low, high = (int(x) for x in text.split("-"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN-MAX, e.g. 3-30, got {text!r}") from None
    if not 1 <= low <= high:
        raise argparse.ArgumentTypeError(f"expected 1 <= MIN <= MAX, got {text!r}")
    return low, high


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-o", "--output", required=True, help="output folder, e.g. data/mini")
    parser.add_argument("--seed", type=int, default=0, help="same seed -> byte-identical output")
    parser.add_argument("--train-per-lang", type=int, default=None,
                        help="distinct ASR train sentences per language (default 60; all with --hours)")
    parser.add_argument("--dev-per-lang", type=int, default=8,
                        help="dev ASR sentences per language and dev pairs per AST direction")
    parser.add_argument("--test-per-lang", type=int, default=0,
                        help="test ASR sentences per language and test pairs per AST direction, "
                             "spoken by voices no train or dev utterance uses (default 0: no test split)")
    parser.add_argument("--ast-pairs", type=int, default=None,
                        help="distinct train pairs per AST direction (default 25; all with --hours)")
    parser.add_argument("--hours", type=float, default=None,
                        help="keep cycling through the train sentences with fresh voices until the "
                             "train set holds about this many hours")
    parser.add_argument("--num-workers", type=int, default=os.cpu_count() or 1,
                        help="parallel espeak-ng processes")
    parser.add_argument("--french-text", type=lambda s: s.split(","), default=list(FRENCH_HELP),
                        help=f"comma-separated French help sources, of {', '.join(FRENCH_HELP)} (default: all)")
    parser.add_argument("--words", type=words_range, default=words_range(DEFAULT_WORDS),
                        help=f"MIN-MAX words per sentence (default {DEFAULT_WORDS})")
    args = parser.parse_args()
    if unknown := set(args.french_text) - set(FRENCH_HELP):
        parser.error(f"--french-text: unknown source {', '.join(sorted(unknown))}; choose from {', '.join(FRENCH_HELP)}")
    if args.hours is None:
        args.train_per_lang = 60 if args.train_per_lang is None else args.train_per_lang
        args.ast_pairs = 25 if args.ast_pairs is None else args.ast_pairs
    check_dependencies(args.french_text)

    rng = random.Random(args.seed)
    texts = plan_texts(args, rng)

    for sub in ("audio", "examples"):  # stale files from an earlier run would hide in the folder
        shutil.rmtree(os.path.join(args.output, sub), ignore_errors=True)
    os.makedirs(os.path.join(args.output, "audio"))
    with multiprocessing.get_context("fork").Pool(args.num_workers, initializer=_worker_init) as pool:
        dev = run_split("dev", plan_jobs("dev", texts["dev"], rng, repeat=False), args.output, pool, None)
        test = run_split("test", plan_jobs("test", texts["test"], rng, repeat=False, variants=TEST_VARIANTS),
                         args.output, pool, None)
        train = run_split("train", plan_jobs("train", texts["train"], rng, repeat=args.hours is not None),
                          args.output, pool, args.hours)
    write_manifest(os.path.join(args.output, "dev.jsonl"), dev)
    write_manifest(os.path.join(args.output, "train.jsonl"), train)
    if test:
        write_manifest(os.path.join(args.output, "test.jsonl"), test)
    examples = write_examples(args.output, train)

    print(f"wrote {args.output}:")
    summarize("train", train)
    summarize("dev", dev)
    if test:
        summarize("test", test)
    summarize("examples", examples)


if __name__ == "__main__":
    main()
