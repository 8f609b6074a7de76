"""Scoring: WER for speech recognition and BLEU for speech translation (`corpus_scores`), after the
text normalisers published leaderboards score with (`get_normalizer`); and a stream's latency as
simultaneous speech translation measures it (`stream_latency`: AL, LAAL, the lag behind the speech).

    normalizer = get_normalizer("whisper", "en")     # english(); any other language: basic()
    normalizer("Mr. Smith paid $20 million.")         # 'mister smith paid $20000000'

Why: raw WER counts "Mr." against "mister", "twenty one" against "21" and "colour" against "color"
as errors, so numbers from different papers only compare after the same normalisation. The Open
ASR Leaderboard scores English with Whisper's EnglishTextNormalizer and other languages with
its BasicTextNormalizer (Radford et al. 2022, appendix C). `english` and `basic` re-implement
their documented behaviour:

basic: lower case; text in [brackets], <angle brackets> and (parentheses) removed; every mark,
    symbol and punctuation character (Unicode categories M, S, P, after NFKC) becomes a space.
english: lower case; bracketed text and the fillers hmm/mm/mhm/mmm/uh/um removed; contractions
    expanded (won't -> will not, 're -> are, 's -> is, 's been -> has been, ...) and titles spelled
    out (mr -> mister, dr -> doctor, ...); diacritics dropped; spelled numbers become digits
    (`NumberNormalizer`); British spellings become American (`american_spelling`); punctuation
    removed except in numbers ("3.5", "$20", "5%").

Differences from Whisper's (whisper-normalizer 0.1.15, not a dependency; tests/test_decode_metrics.py
compares the two when it is installed): the spelling step maps British patterns by rule plus a
short list of irregular words, where Whisper looks words up in a list of 1,739; the rules map
1,472 of those words as the list does (the rest are rare: "pouffe", "gaging", "snowploughs").
Every other step agrees on the test table, Whisper's quirks included ("twelve o'clock" -> "120
clock", "one and a half" -> "one.5").

`simple` is aed's older convention (lower case, punctuation but apostrophes removed), kept
because the demo numbers in the README were measured with it.

WER and BLEU are corpus-level: WER = total word edits / total reference words, BLEU = sacreBLEU's
corpus score. Callers gather every rank's (reference, hypothesis) pairs before scoring;
`corpus_scores` groups them by language (ASR) and language pair (AST). Normalised WER applies
one of the normalisers above to both sides first; raw WER scores the text as written.
"""

import math
import re
import unicodedata
from collections.abc import Callable
from fractions import Fraction

import jiwer
import torch
from sacrebleu.metrics import BLEU

from aed.data_speech import FRAME, speech_detector
from aed.decode_timing import PAUSE, align, feasible, speech_runs, to_words


_BRACKETED = re.compile(r"[<\[][^>\]]*[>\]]|\(([^)]+?)\)")
_SIMPLE_PUNCT = re.compile(r"[^\w\s']|_")


def simple(text: str) -> str:
    """Lower case, punctuation (not apostrophes) removed, whitespace collapsed."""
    text = unicodedata.normalize("NFKC", text).lower()
    return " ".join(_SIMPLE_PUNCT.sub(" ", text).split())


def basic(text: str) -> str:
    """Whisper's BasicTextNormalizer, as the multilingual leaderboards use it."""
    text = _BRACKETED.sub("", text.lower())
    text = "".join(" " if unicodedata.category(c)[0] in "MSP" else c for c in unicodedata.normalize("NFKC", text))
    return " ".join(text.lower().split())


# Letters NFKD does not decompose into a base letter and a diacritic.
_LETTER_FOLDS = {"œ": "oe", "Œ": "OE", "ø": "o", "Ø": "O", "æ": "ae", "Æ": "AE", "ß": "ss", "ẞ": "SS",
                 "đ": "d",
                 "Đ": "D", "ð": "d", "Ð": "D", "þ": "th", "Þ": "th", "ł": "l", "Ł": "L"}


def drop_symbols_and_diacritics(text: str, keep: str = "") -> str:
    """Diacritics dropped (NFKD, then combining marks removed), other marks, symbols and
    punctuation replaced by spaces, except the characters in `keep`."""
    out = []
    for c in unicodedata.normalize("NFKD", text):
        category = unicodedata.category(c)
        if c in keep:
            out.append(c)
        elif c in _LETTER_FOLDS:
            out.append(_LETTER_FOLDS[c])
        elif category != "Mn":
            out.append(" " if category[0] in "MSP" else c)
    return "".join(out)


# --- English numbers --------------------------------------------------------------------------

_ONES = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
         "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen"]
_TENS = ["twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]
_SCALES = ["thousand", "million", "billion", "trillion", "quadrillion", "quintillion", "sextillion",
           "septillion", "octillion", "nonillion", "decillion"]


class NumberNormalizer:
    """Spelled English numbers -> digits, the way Whisper's EnglishNumberNormalizer does it.

    "twenty one" -> 21, "two thousand and five" -> 2005, "nineteen ninety" -> 1990 (a year),
    "one oh one" -> 101 and "double seven" -> 77 (digit strings), "two point five" -> 2.5,
    "third" -> 3rd, "sixties" -> 60s, "five dollars" -> $5, "ten percent" -> 10%, "minus two" -> -2,
    "two and a half" -> 2.5. A lone "one"/"ones" stays a word ("the one"), as does "ninth": Whisper
    builds ordinals by appending "th" and so only knows "nineth", and matching its numbers
    matters more here than the ninth.
    """

    ZEROS = {"o", "oh", "zero"}
    ONES = {w: i for i, w in enumerate(_ONES, 1)}
    TENS = {w: 10 * i for i, w in enumerate(_TENS, 2)}
    SCALES = {"hundred": 100, **{w: 1000 ** i for i, w in enumerate(_SCALES, 1)}}
    CURRENCY = {"pound": "£", "pounds": "£", "euro": "€", "euros": "€", "dollar": "$", "dollars": "$",
                "cent": "¢", "cents": "¢"}  # written before the number they follow
    SIGNS = {"minus": "-", "negative": "-", "plus": "+", "positive": "+"}

    def __init__(self):
        ordinal = {"first": 1, "second": 2, "third": 3, "fifth": 5, "twelfth": 12, "zeroth": 0}
        ordinal |= {w + ("h" if w.endswith("t") else "th"): n for w, n in self.ONES.items()
                    if n not in (1, 2, 3, 5, 12)}
        suffix = {1: "st", 2: "nd", 3: "rd"}
        # word -> (value, suffix): numbers that end a number on the spot ("thirds", "sixties", "hundredth")
        self.ones_with_suffix = {("sixes" if w == "six" else w + "s"): (n, "s") for w, n in self.ONES.items()}
        self.ones_with_suffix |= {w: (n, suffix.get(n, "th")) for w, n in ordinal.items()}
        self.tens_with_suffix = {w[:-1] + "ies": (n, "s") for w, n in self.TENS.items()}
        self.tens_with_suffix |= {w[:-1] + "ieth": (n, "th") for w, n in self.TENS.items()}
        self.scales_with_suffix = {w + s: (n, s) for w, n in self.SCALES.items() for s in ("s", "th")}
        self.decimals = set(self.ONES) | set(self.TENS) | self.ZEROS  # what may follow "point"
        self.number_words = (self.ZEROS | set(self.ONES) | set(self.TENS) | set(self.SCALES) | set(self.CURRENCY)
                             | set(self.SIGNS) | set(self.ones_with_suffix) | set(self.tens_with_suffix)
                             | set(self.scales_with_suffix) | {"per", "percent", "and", "double", "triple", "point"})

    def __call__(self, text: str) -> str:
        return self.postprocess(" ".join(self.convert(self.preprocess(text).split())))

    def preprocess(self, text: str) -> str:
        # "<number> and a half" -> "<number> point five"; any other "and a half" stays
        parts = re.split(r"\band\s+a\s+half\b", text)
        out = []
        for i, part in enumerate(parts):
            if not part.strip():
                continue
            out.append(part)
            if i < len(parts) - 1:
                last = part.rsplit(maxsplit=2)[-1]
                out.append("point five" if last in self.decimals or last in self.SCALES else "and a half")
        text = re.sub(r"([a-z])([0-9])", r"\1 \2", " ".join(out))  # "abc123" -> "abc 123"
        text = re.sub(r"([0-9])([a-z])", r"\1 \2", text)
        return re.sub(r"([0-9])\s+(st|nd|rd|th|s)\b", r"\1\2", text)  # ... but "21 st" -> "21st"

    def postprocess(self, text: str) -> str:
        def dollars_and_cents(m):
            return f"{m.group(1)}{m.group(2)}.{int(m.group(3)):02d}"

        text = re.sub(r"([€£$])([0-9]+) (?:and )?¢([0-9]{1,2})\b", dollars_and_cents, text)  # $2 and ¢7 -> $2.07
        text = re.sub(r"[€£$]0.([0-9]{1,2})\b", lambda m: f"¢{int(m.group(1))}", text)  # $0.07 -> ¢7
        return re.sub(r"\b1(s?)\b", r"one\1", text)  # a lone 1 reads better as "one"

    def convert(self, words: list[str]) -> list[str]:
        """The word-by-word pass. `value` is the number being read: an int while it is a sum of
        place values ("two hundred five"), a str once digits are being concatenated ("one two",
        "nineteen ninety", "3.") and None between numbers; `prefix` is a sign or currency symbol."""
        out = []
        value, prefix = None, None

        def flush(extra: str = ""):
            nonlocal value, prefix
            if value is not None or extra:
                out.append((prefix or "") + ("" if value is None else str(value)) + extra)
            value, prefix = None, None

        def add_ones(n: int, prev: str | None):
            """The value after a one-word number 1-19 (or the digit string it extends)."""
            if value is None:
                return n
            if isinstance(value, str) or prev in self.ONES:  # a digit string: "one two", "one oh one"
                return value[:-1] + str(n) if prev in self.TENS and n < 10 else str(value) + str(n)
            if value % (10 if n < 10 else 100) == 0:  # "twenty one", "two hundred twelve"
                return value + n
            return str(value) + str(n)  # "twenty one two" -> 212

        def add_tens(n: int):
            if value is None:
                return n
            if isinstance(value, str) or value % 100:
                return str(value) + str(n)  # "nineteen ninety" -> 1990
            return value + n

        def times(scale: int):
            """`value` x a scale word, or None when it cannot be scaled (then the caller flushes)."""
            if value is None:
                return scale
            if isinstance(value, str) or value == 0:  # "1.5 million" -> 1500000; "0.5 million" too
                f = _fraction(str(value))
                scaled = f * scale if f is not None else None
                return scaled.numerator if scaled is not None and scaled.denominator == 1 else None
            return value // 1000 * 1000 + value % 1000 * scale  # "two thousand three hundred"

        skip = False
        padded = [None] + words + [None]
        for prev, word, nxt in zip(padded, padded[1:], padded[2:]):
            if skip:
                skip = False
                continue
            nxt_is_number = nxt is not None and _NUMERIC.match(nxt) is not None
            symbol = word[0] if word[0] in "-+£€$¢" else None
            digits = word[1:] if symbol else word
            if _NUMERIC.match(digits):  # arabic numerals, maybe signed or with a currency symbol
                if value is not None:
                    if isinstance(value, str) and value.endswith("."):  # decimals, IP addresses
                        value += word
                        continue
                    flush()
                prefix = symbol or prefix
                f = _fraction(digits)
                value = f.numerator if f.denominator == 1 else digits
            elif word not in self.number_words:
                flush()
                out.append(word)
            elif word in self.ZEROS:
                value = str(value or "") + "0"
            elif word in self.ONES:
                value = add_ones(self.ONES[word], prev)
            elif word in self.ones_with_suffix:
                n, suffix = self.ones_with_suffix[word]
                value = add_ones(n, prev)
                flush(suffix)
            elif word in self.TENS:
                value = add_tens(self.TENS[word])
            elif word in self.tens_with_suffix:
                n, suffix = self.tens_with_suffix[word]
                value = add_tens(n)
                flush(suffix)
            elif word in self.SCALES or word in self.scales_with_suffix:
                scale, suffix = self.scales_with_suffix.get(word, (self.SCALES.get(word), None))
                scaled = times(scale)
                if scaled is None:  # "1.23 million" scales; "point one two three million" does too
                    flush()
                    scaled = scale
                value = scaled
                if suffix:
                    flush(suffix)
            elif word in self.SIGNS:
                flush()
                if nxt in self.number_words or nxt_is_number:
                    prefix = self.SIGNS[word]
                else:
                    out.append(word)
            elif word in self.CURRENCY:
                if value is not None:
                    prefix = self.CURRENCY[word]
                    flush()
                else:
                    out.append(word)
            elif word in ("percent", "per"):
                if value is None:
                    out.append(word)
                elif word == "percent":
                    flush("%")
                elif nxt == "cent":
                    flush("%")
                    skip = True
                else:
                    flush()
                    out.append(word)
            elif nxt not in self.number_words and not nxt_is_number:  # and/double/triple/point, no number next
                flush()
                out.append(word)
            elif word == "and":
                if prev not in self.SCALES:  # "hundred and five" reads through; other "and"s are words
                    flush()
                    out.append(word)
            elif word in ("double", "triple"):
                if nxt in self.ONES or nxt in self.ZEROS:
                    value = str(value or "") + str(self.ONES.get(nxt, 0)) * (2 if word == "double" else 3)
                    skip = True
                else:
                    flush()
                    out.append(word)
            elif word == "point" and (nxt in self.decimals or nxt_is_number):
                value = str(value or "") + "."
        flush()
        return out


_NUMERIC = re.compile(r"^\d+(\.\d+)?$")


def _fraction(s: str) -> Fraction | None:
    try:
        return Fraction(s)
    except ValueError:
        return None


# --- English spelling -------------------------------------------------------------------------

# British stems whose "our" is American "or", anywhere in a word (colours, unfavourable, watercolour).
_OUR = ("arbo", "ardo", "armo", "behavio", "cando", "clamo", "colo", "demeano", "endeavo", "favo", "fervo",
        "flavo", "harbo", "hono", "humo", "labo", "neighbo", "odo", "parlo", "ranco", "rigo", "rumo", "savio",
        "savo", "splendo", "succo", "tumo", "valo", "vapo", "vigo")
# Stems whose British "re" is American "er" (centre, centred, kilometres, fibreglass, lacklustre).
_TRE = ("calib", "cent", "fib", "goit", "lit", "lust", "maneuv", "meag", "met", "mit", "och", "sab", "scept",
        "somb", "spect", "theat")
# Words that end in -ise in American English too (advise, exercise, promise, ...): never -ize.
_ISE_KEEP = {"advert", "adv", "appr", "ar", "chast", "circumc", "compr", "comprom", "conc", "desp", "dev",
             "disgu", "enterpr", "exc", "exerc", "expert", "franch", "gu", "impr", "improv", "inc", "merchand",
             "parad", "po", "pra", "prec", "prem", "prom", "r", "ra", "rev", "superv", "surpr", "telev", "w",
             "no", "cru", "bru", "otherw", "likew", "clockw", "treat", "mort", "an", "val", "porpo", "turquo",
             "dem", "upr", "sunr", "moonr", "highr", "cer", "rem", "m", "l", "appra", "repr", "abse", "cle", "coi",
             "mai", "noi", "poi", "ma", "vi", "wi", "t", "pre", "fr", "dispr", "mi"}
_ISE = re.compile(r"^(\w+?)is(e|es|ed|ing|ingly|ation|ations|ational|er|ers|able|ably|ability)$")
_IRREGULAR = {"aeroplane": "airplane", "ageing": "aging", "aluminium": "aluminum", "analogue": "analog",
              "catalogue": "catalog", "catalogues": "catalogs", "cheque": "check", "defence": "defense",
              "dialogue": "dialog", "draught": "draft", "fulfil": "fulfill", "gaol": "jail", "grey": "gray",
              "jewellery": "jewelry", "judgement": "judgment", "kerb": "curb", "licence": "license",
              "moustache": "mustache", "offence": "offense", "practise": "practice", "pretence": "pretense",
              "programme": "program", "programmes": "programs", "pyjamas": "pajamas", "sceptic": "skeptic",
              "sceptical": "skeptical", "skilful": "skillful", "storey": "story", "tyre": "tire", "tyres": "tires",
              "wilful": "willful", "enrol": "enroll", "enrols": "enrolls", "enrolment": "enrollment",
              "instalment": "installment", "marvellous": "marvelous", "acknowledgement": "acknowledgment",
              "aeon": "eon", "glueing": "gluing", "woollen": "woolen", "woollens": "woolens"}
# Greek and Latin ae/oe spellings, and a few other British letter groups, anywhere in a word.
_INFIXES = [("archaeo", "archeo"), ("paed", "ped"), ("haem", "hem"), ("anaes", "anes"), ("anaem", "anem"),
            ("gynaec", "gynec"), ("encyclopaed", "encycloped"), ("leukaem", "leukem"), ("praesid", "presid"),
            ("oesoph", "esoph"), ("oestr", "estr"), ("foet", "fet"), ("homoeo", "homeo"), ("diarrhoea", "diarrhea"),
            ("gonorrhoea", "gonorrhea"), ("manoeuv", "maneuv"), ("mould", "mold"), ("plough", "plow"),
            ("sulph", "sulf")]
# Verbs that double their final l before a suffix in British English only (travelled, counsellor).
_DOUBLE_L = ("bevel", "cancel", "carol", "cavil", "channel", "chisel", "council", "counsel", "cudgel", "dial",
             "drivel", "duel", "enamel", "equal", "fuel", "funnel", "gravel", "grovel", "jewel", "label",
             "level", "libel", "marshal", "marvel", "medal", "model", "panel", "pedal", "pencil", "pummel",
             "quarrel", "revel", "rival", "shovel", "shrivel", "signal", "snivel", "snorkel", "spiral", "stencil",
             "swivel", "tassel", "total", "towel", "travel", "tunnel", "unravel", "yodel")
_DOUBLE_L_WORD = re.compile(rf"^(\w*?)({'|'.join(_DOUBLE_L)})l(ed|ing|er|ers|or|ors)$")
_OUR_IN = re.compile(rf"({'|'.join(_OUR)})ur")
_TRE_END = re.compile(rf"({'|'.join(_TRE)})r(ed|ing)$")  # centred -> centered
_TRE_IN = re.compile(rf"({'|'.join(_TRE)})re")  # centre, centres, fibreglass
_LYSE = re.compile(r"lys(e|es|ed|ing|er|ers)$")  # analyse, paralysed, breathalyser
_GRAMME = re.compile(r"gramme(s?)$")  # kilogramme -> kilogram


def american_spelling(word: str) -> str:
    """A British spelling's American form (colour -> color, organise -> organize, centre ->
    center, travelled -> traveled, analyse -> analyze, paediatric -> pediatric); other words
    unchanged. Rules for the regular patterns plus a short list of irregular words."""
    if word in _IRREGULAR:
        return _IRREGULAR[word]
    for british, american in _INFIXES:
        word = word.replace(british, american)
    word = _OUR_IN.sub(r"\1r", word)
    word = _TRE_IN.sub(r"\1er", _TRE_END.sub(r"\1er\2", word))
    word = _LYSE.sub(r"lyz\1", _GRAMME.sub(r"gram\1", word))
    if m := _DOUBLE_L_WORD.match(word):
        return m.group(1) + m.group(2) + m.group(3)
    if (m := _ISE.match(word)) and m.group(1) not in _ISE_KEEP and len(m.group(1)) >= 3:
        return m.group(1) + "iz" + m.group(2)
    return word


# --- English ----------------------------------------------------------------------------------

_FILLERS = re.compile(r"\b(hmm|mm|mhm|mmm|uh|um)\b")
# In order: whole-word contractions, titles, perfect tenses ("'s been" is "has", not "is"), then
# the general suffixes. "'s" alone becomes "is", as Whisper's normaliser does (possessives too).
_REPLACEMENTS = [(re.compile(p), r) for p, r in [
    (r"\bwon't\b", "will not"), (r"\bcan't\b", "can not"), (r"\blet's\b", "let us"), (r"\bain't\b", "aint"),
    (r"\by'all\b", "you all"), (r"\bwanna\b", "want to"), (r"\bgotta\b", "got to"), (r"\bgonna\b", "going to"),
    (r"\bi'ma\b", "i am going to"), (r"\bimma\b", "i am going to"), (r"\bwoulda\b", "would have"),
    (r"\bcoulda\b", "could have"), (r"\bshoulda\b", "should have"), (r"\bma'am\b", "madam"),
    (r"\bmr\b", "mister "), (r"\bmrs\b", "missus "), (r"\bst\b", "saint "), (r"\bdr\b", "doctor "),
    (r"\bprof\b", "professor "), (r"\bcapt\b", "captain "), (r"\bgov\b", "governor "), (r"\bald\b", "alderman "),
    (r"\bgen\b", "general "), (r"\bsen\b", "senator "), (r"\brep\b", "representative "),
    (r"\bpres\b", "president "), (r"\brev\b", "reverend "), (r"\bhon\b", "honorable "),
    (r"\basst\b", "assistant "), (r"\bassoc\b", "associate "), (r"\blt\b", "lieutenant "),
    (r"\bcol\b", "colonel "), (r"\bjr\b", "junior "), (r"\bsr\b", "senior "), (r"\besq\b", "esquire "),
    (r"'d been\b", " had been"), (r"'s been\b", " has been"), (r"'d gone\b", " had gone"),
    (r"'s gone\b", " has gone"), (r"'d done\b", " had done"), (r"'s got\b", " has got"),
    (r"n't\b", " not"), (r"'re\b", " are"), (r"'s\b", " is"), (r"'d\b", " would"), (r"'ll\b", " will"),
    (r"'t\b", " not"), (r"'ve\b", " have"), (r"'m\b", " am")]]
_NUMBERS = NumberNormalizer()


def english(text: str) -> str:
    """Whisper's EnglishTextNormalizer (the Open ASR Leaderboard's), step by step."""
    text = _BRACKETED.sub("", text.lower())
    text = _FILLERS.sub("", text)
    text = re.sub(r"\s+'", "'", text)  # "don 't" -> "don't"
    for pattern, replacement in _REPLACEMENTS:
        text = pattern.sub(replacement, text)
    text = re.sub(r"(\d),(\d)", r"\1\2", text)  # 1,000 -> 1000
    text = re.sub(r"\.([^0-9]|$)", r" \1", text)  # full stops go; decimal points stay
    text = drop_symbols_and_diacritics(text, keep=".%$¢€£")  # the symbols numbers need
    text = _NUMBERS(text)
    text = " ".join(american_spelling(w) for w in text.split())
    text = re.sub(r"([$¢€£])\s+([0-9])", r"\1\2", text)  # "$ 5" -> "$5"
    text = re.sub(r"([0-9])\s+%", r"\1%", text)
    text = re.sub(r"[.$¢€£]([^0-9])", r" \1", text)  # symbols that belong to no number go
    text = re.sub(r"([^0-9])%", r"\1 ", text)
    return " ".join(text.split())


# --- choosing one -----------------------------------------------------------------------------

NORMALIZERS = ("simple", "whisper")


def get_normalizer(name: str, lang: str):
    """The text -> text function `name` applies to `lang`: "whisper" is `english` for English and
    `basic` for every other language (the leaderboards' convention); "simple" is `simple`."""
    if name == "simple":
        return simple
    if name == "whisper":
        return english if lang == "en" else basic
    raise ValueError(f"unknown normalizer {name!r}; expected one of {NORMALIZERS}")


def wer(refs: list[str], hyps: list[str], normalize: Callable[[str], str] | None = simple) -> float:
    """Corpus WER in percent after `normalize` (text -> text) on both sides; None scores the raw
    text (punctuation and case count)."""
    if normalize is not None:
        refs, hyps = [normalize(r) for r in refs], [normalize(h) for h in hyps]
    pairs = [(r, h) for r, h in zip(refs, hyps, strict=True) if r.split()]
    if not pairs:
        return float("nan")
    out = jiwer.process_words([r for r, _ in pairs], [h for _, h in pairs])
    errors = out.substitutions + out.deletions + out.insertions
    return 100.0 * errors / sum(len(r.split()) for r, _ in pairs)


def bleu(refs: list[str], hyps: list[str]) -> float:
    """sacreBLEU corpus BLEU with its default 13a tokenisation."""
    return BLEU().corpus_score(hyps, [refs]).score


def corpus_scores(rows: list[tuple[str, str, str, str, str]],
                  normalizer: str = "simple") -> tuple[dict[str, dict], float | None]:
    """Rows (taskname, source_lang, target_lang, reference, hypothesis) -> per group, sorted by key,
    {"asr en": {"wer": .., "wer_pnc": .., "n": ..}, "ast es-en": {"bleu": .., "n": ..}}, and the
    normalised WER of all ASR rows together (None without ASR rows), a headline number for logs.
    `wer` is normalised (`aed.decode_metrics.get_normalizer(normalizer, language)`: "simple" or
    "whisper", the leaderboards' convention); `wer_pnc` scores the raw text, punctuation and case.
    """
    groups = {}
    for task, src, tgt, ref, hyp in rows:
        key = f"asr {src}" if task == "asr" else f"ast {src}-{tgt}"
        groups.setdefault(key, []).append((ref, hyp))
    scores = {}
    for key, pairs in sorted(groups.items()):
        refs, hyps = [r for r, _ in pairs], [h for _, h in pairs]
        if key.startswith("asr"):
            norm = get_normalizer(normalizer, key.split()[1])
            scores[key] = {"wer": wer(refs, hyps, norm), "wer_pnc": wer(refs, hyps, None), "n": len(pairs)}
        else:
            scores[key] = {"bleu": bleu(refs, hyps), "n": len(pairs)}
    asr = [(get_normalizer(normalizer, src)(ref), get_normalizer(normalizer, src)(hyp))
           for task, src, _, ref, hyp in rows if task == "asr"]
    return scores, (wer([r for r, _ in asr], [h for _, h in asr], None) if asr else None)


# --- latency, as simultaneous speech translation measures it ----------------------------------


def average_lagging(delays: list[float], source: float, reference_len: int | None = None,
                    length_adaptive: bool = True) -> float:
    """SimulEval's AL (STACL, Ma et al. 2019) and LAAL (Papi et al. 2022) of one output: delays[i] of
    its i-th word and `source` in the same unit (ms of audio):

        AL = 1/tau sum_{i=1..tau} (d_i - (i-1) |X| / |Y|),  tau = the first i with d_i >= |X|

    |Y| is the reference's word count (the output's where there is none); LAAL uses
    max(|Y|, output words), so output longer than the reference cannot lower its latency.
    An output whose first word comes after the source ends gets that delay; an empty one, nan."""
    if not delays:
        return math.nan
    if delays[0] > source:
        return delays[0]
    words = reference_len or len(delays)
    rate = (max(words, len(delays)) if length_adaptive else words) / source  # words per unit of source
    total = 0.0
    for i, d in enumerate(delays):
        total += d - i / rate
        if d >= source:
            return total / (i + 1)
    return total / len(delays)


@torch.inference_mode()
def spoken_ends(stream, wav: torch.Tensor) -> list[float] | None:
    """When each committed word was spoken: the end of its span in the CTC head's forced alignment of
    the stream's text to the whole audio `wav` (S,) (aed/decode_timing.py), in seconds; None
    without a CTC head, or where no CTC path through the audio fits the text. The alignment may
    place words only within PAUSE of the speech the stream's detector finds: over a whole file, it
    put words spoken after 45 s of room tone inside the room tone."""
    streamer, model = stream.streamer, stream.streamer.model
    ids = streamer.tokenizer.text_ids(stream.ids)
    if model.ctc is None or not ids or wav.numel() < streamer.frame:
        return None
    feats, lens = streamer.logmel(wav[None].to(streamer.loaded.device), torch.tensor([wav.numel()]))
    _, enc_lens, log_probs = model.encode_with_ctc(feats, lens)
    frames = log_probs[0, : int(enc_lens[0])].cpu()  # (T', V)
    detector = speech_detector(streamer.config.vad, streamer.rate)
    near = torch.zeros(frames.size(0), dtype=torch.bool)  # (T',) encoder frames within PAUSE of speech
    for stretch in speech_runs(detector.speech(detector.scores(wav.cpu(), final=True))):
        lo, hi = stretch[0][0] * FRAME - PAUSE, stretch[-1][1] * FRAME + PAUSE  # seconds
        near[max(0, math.floor(lo / streamer.frame_s)): math.ceil(hi / streamer.frame_s)] = True
    frames[~near] = -math.inf
    frames[~near, model.ctc.blank] = 0.0  # elsewhere only blank
    if not feasible(frames.size(0), ids):
        return None
    words = to_words(streamer.tokenizer, ids, align(frames, ids, model.ctc.blank), streamer.frame_s)
    return [w.end for w in words] if len(words) == len(stream.words()) else None


def stream_latency(stream, seconds: float, reference: str | None = None,
                   wav: torch.Tensor | None = None) -> dict:
    """A finished stream's latency in ms of audio: AL and LAAL over its words (each word timed by its
    last token), computation-unaware and -aware (`_ca`: SimulEval's, the processing time the
    stream had waited for added); the first word's delay; with the stream's audio `wav` and a CTC
    head, `spoken_lag`: the mean time from the end of each word in the audio (`spoken_ends`) to its
    commit; and the real-time factor of its chunks (processing seconds per second of chunk audio:
    mean and max, the last chunk excluded)."""
    words = stream.words()
    ref_len = len(reference.split()) if reference else None
    source = seconds * 1000
    unaware = [t * 1000 for _, t, _ in words]
    aware = [(t + c) * 1000 for _, t, c in words]
    chunk_s = stream.streamer.chunk / stream.streamer.rate
    ends = spoken_ends(stream, wav) if wav is not None else None
    lag = sum(t - end for (_, t, _), end in zip(words, ends)) / len(ends) * 1000 if ends else math.nan
    return {"al": average_lagging(unaware, source, ref_len, False), "laal": average_lagging(unaware, source, ref_len),
            "al_ca": average_lagging(aware, source, ref_len, False), "laal_ca": average_lagging(aware, source, ref_len),
            "first_word": unaware[0] if unaware else math.nan, "spoken_lag": lag,
            "rtf_mean": sum(stream.chunk_compute) / seconds if seconds > 0 else math.nan,
            "rtf_max": max(stream.chunk_compute, default=math.nan) / chunk_s}
