"""aed/decode_metrics.py: the leaderboard normalisers, from a table of cases.

Every expected output below is what Whisper's normalisers give (checked against the
whisper-normalizer package, which `test_agrees_with_whisper_normalizer` re-checks when installed).
"""

import pytest

from aed.decode_metrics import american_spelling, basic, corpus_scores, english, get_normalizer, simple

ENGLISH = [
    # numbers
    ("twenty-one colours", "21 colors"),
    ("It's one hundred and five percent", "it is 105%"),
    ("one oh one", "101"),  # digit strings
    ("double seven three", "773"),
    ("nineteen ninety nine", "1999"),  # years
    ("two thousand and twenty", "2020"),
    ("one million two hundred thousand three hundred and four", "1200304"),
    ("two point five", "2.5"),
    ("zero point zero five", "0.05"),
    ("the first of March", "the 1st of march"),
    ("twenty first century", "21st century"),
    ("the sixties and the nineteen eighties", "the 60s and the 1980s"),
    ("minus two degrees", "-2 degrees"),
    ("ten per cent of 20%", "10% of 20%"),
    ("I won 1,000 games", "i won 1000 games"),
    ("one two three four five", "12345"),
    ("the one I saw, and the ones you saw", "the one i saw and the ones you saw"),  # a lone one stays a word
    ("the ninth and the eighth", "the ninth and the 8th"),  # Whisper only knows "nineth"
    # money
    ("Mr. Smith paid $20 million", "mister smith paid $20000000"),
    ("five dollars and fifty cents", "$5.50"),
    ("$2 and 7 cents", "$2.07"),
    ("It costs £3.50 or 3.5 euros", "it costs £3.50 or €3.5"),
    # contractions, titles, fillers, brackets
    ("I won't go", "i will not go"),
    ("He's been there. She'd gone home.", "he has been there she had gone home"),
    ("Let's say y'all gonna wanna see it, ain't it?", "let us say you all going to want to see it aint it"),
    ("Dr. Jones and St. Paul", "doctor jones and saint paul"),
    ("uh, I mean, um, hmm", "i mean"),
    ("I'm sure they've won [laughter] (applause)", "i am sure they have won"),
    # spelling and diacritics
    ("I organised the centre's travelled catalogue, analysed behaviour and labour.",
     "i organized the center is traveled catalog analyzed behavior and labor"),
    ("They realise the programme was cancelled; we apologise.", "they realize the program was canceled we apologize"),
    ("Advise, exercise, surprise and promise the wise.", "advise exercise surprise and promise the wise"),
    ("café naïve façade Œuvre straße", "cafe naive facade oeuvre strasse"),
]

BASIC = [
    ("Ein Hund, bitte!", "ein hund bitte"),
    ("¿Qué tal? [ruido] Muy bien.", "qué tal muy bien"),  # diacritics stay
    ("Ça va (très) bien — merci.", "ça va bien merci"),
    ("Zwölf  Äpfel\tund Straße", "zwölf äpfel und straße"),
]


@pytest.mark.parametrize("text, expected", ENGLISH)
def test_english(text, expected):
    assert english(text) == expected


@pytest.mark.parametrize("text, expected", BASIC)
def test_basic(text, expected):
    assert basic(text) == expected


def test_american_spelling_leaves_american_and_ordinary_words_alone():
    for word in ("color", "organize", "center", "our", "four", "hour", "tour", "advise", "exercise", "surprise",
                 "cosine", "called", "controlled", "filled", "metric", "literal", "mediocre", "program", "neighbor"):
        assert american_spelling(word) == word, word


def test_whisper_scores_english_with_english_and_other_languages_with_basic():
    assert get_normalizer("whisper", "en") is english and get_normalizer("whisper", "de") is basic
    assert get_normalizer("simple", "en") is simple
    with pytest.raises(ValueError, match="unknown normalizer"):
        get_normalizer("nemo", "en")
    rows = [("asr", "en", "en", "It's twenty one.", "it is 21"), ("asr", "de", "de", "Ein Hund.", "ein hund")]
    scores, _ = corpus_scores(rows, normalizer="whisper")
    assert scores["asr en"]["wer"] == 0.0 and scores["asr de"]["wer"] == 0.0
    assert scores["asr en"]["wer_pnc"] == 100.0  # raw text: every word differs
    simple_scores, _ = corpus_scores(rows)  # the default: punctuation and case only
    assert simple_scores["asr en"]["wer"] == 100.0


def test_agrees_with_whisper_normalizer():
    whisper = pytest.importorskip("whisper_normalizer.english")
    basic_ref = pytest.importorskip("whisper_normalizer.basic")
    english_ref, basic_norm = whisper.EnglishTextNormalizer(), basic_ref.BasicTextNormalizer()
    for text, _ in ENGLISH:
        assert english(text) == " ".join(english_ref(text).split()), text
    for text, _ in BASIC:
        assert basic(text) == " ".join(basic_norm(text).split()), text
