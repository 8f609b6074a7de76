import importlib.util
import itertools
import json
from pathlib import Path

import pytest

from aed.data_tokenizer import SpecialBlock, Tokenizer, default_special_tokens

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("train_tokenizer", ROOT / "tools" / "train_tokenizer.py")
train_tokenizer = importlib.util.module_from_spec(spec)
spec.loader.exec_module(train_tokenizer)

# subjects x predicates: 12 x 12 = 144 sentences per language, with the accents each language uses.
PHRASES = {
    "en": (
        ["The teacher", "My neighbour", "Our team", "The old man", "A young girl", "The doctor",
         "Her brother", "The cook", "This student", "The pilot", "My friend", "The singer"],
        ["reads a book about history.", "drinks coffee every morning.", "walks to the station slowly.",
         "is writing a long letter.", "bought fresh bread yesterday.", "likes the blue sea.",
         "speaks three languages fluently.", "opened the window at night.", "plays the piano well.",
         "found a key in the garden.", "watches the rain outside.", "waited for the last train."],
    ),
    "de": (
        ["Der Lehrer", "Meine Nachbarin", "Unser Bürgermeister", "Der alte Mann", "Ein junges Mädchen",
         "Die Ärztin", "Ihr Bruder", "Der Koch", "Diese Schülerin", "Der Pilot", "Mein Freund", "Die Sängerin"],
        ["liest ein Buch über Geschichte.", "trinkt jeden Morgen Kaffee.", "geht langsam zur Straße.",
         "schreibt einen langen Brief.", "kaufte gestern frisches Brot.", "mag das große Meer.",
         "spricht fließend drei Sprachen.", "öffnete nachts das Fenster.", "spielt gut Klavier.",
         "fand einen Schlüssel im Garten.", "schaut dem Regen zu.", "wartete auf den letzten Zug."],
    ),
    "fr": (
        ["Le professeur", "Ma voisine", "Notre équipe", "Le vieil homme", "Une jeune fille", "La médecin",
         "Son frère", "Le cuisinier", "Cette élève", "Le pilote", "Mon ami", "La chanteuse"],
        ["lit un livre sur l'histoire.", "boit du café chaque matin.", "marche lentement vers la gare.",
         "écrit une très longue lettre.", "a acheté du pain frais hier.", "aime la mer bleue.",
         "parle couramment trois langues.", "a ouvert la fenêtre la nuit.", "joue bien du piano.",
         "a trouvé une clé dans le jardin.", "regarde la pluie dehors.", "attendait le dernier train, déçu."],
    ),
    "es": (
        ["El profesor", "Mi vecina", "Nuestro equipo", "El anciano", "Una niña", "La médica",
         "Su hermano", "El cocinero", "Esta alumna", "El piloto", "Mi amigo", "La cantante"],
        ["lee un libro sobre la historia.", "bebe café cada mañana.", "camina despacio a la estación.",
         "escribe una carta muy larga.", "compró pan fresco ayer.", "ama el mar azul.",
         "habla tres idiomas con fluidez.", "abrió la ventana por la noche.", "toca bien el piano.",
         "encontró una llave en el jardín.", "mira la lluvia, ¿verdad?", "esperó el último tren."],
    ),
}
SENTENCES = {lang: [f"{s} {p}" for s, p in itertools.product(*parts)] for lang, parts in PHRASES.items()}
# Held-out text (not in the training sentences): accents, umlauts, ß, ñ, ¿¡, digits, an unseen €.
HELD_OUT = {
    "en": "The café's owner paid 12 euros for a naïve print.",
    "de": "Größere Übungen für Bäcker: Straße, Öfen, Füße – 20 €!",
    "fr": "Où est la bibliothèque ? Ça coûte 5 €, garçon, déjà payé.",
    "es": "¿Dónde está el niño? ¡Señor Muñoz, la pingüina comió!",
}
# <unk> <pad> eos bos transcribe translate pnc nopnc nospeech, canary2's startofcontext emo:undefined
# noitn notimestamp nodiarize, then de en es fr sorted
EOS, BOS, TRANSCRIBE, TRANSLATE, PNC, NOPNC = 2, 3, 4, 5, 6, 7
CONTEXT, EMO, NOITN, NOTIMESTAMP, NODIARIZE = 9, 10, 11, 12, 13
LANG = {"de": 14, "en": 15, "es": 16, "fr": 17}
SPECIALS = 18


def write_manifest(path, records):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")


@pytest.fixture(scope="module")
def manifest(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    records = []
    for lang, sentences in SENTENCES.items():
        records += [{"audio_filepath": "x.wav", "duration": 1.0, "text": s, "source_lang": lang, "target_lang": lang}
                    for s in sentences]
    # An AST line whose text uses `answer`: the English source speech, German text.
    records.append({"answer": "Guten Morgen, Frau Müller.", "source_lang": "en", "target_lang": "de"})
    write_manifest(path, records)
    return path


@pytest.fixture(scope="module")
def tokenizers(manifest, tmp_path_factory):
    """{"single": Tokenizer, "aggregate": Tokenizer}, each trained with the CLI and loaded from disk:
    the default "canary2" prompts for the single layout, Canary-1B's "canary" for the aggregate one."""
    out = {}
    for layout, vocab, prompt in (("single", 512, "canary2"), ("aggregate", 320, "canary")):
        directory = tmp_path_factory.mktemp(layout)
        train_tokenizer.main(["--manifest", str(manifest), "--layout", layout, "--vocab-size", str(vocab),
                              "-o", str(directory)] + (["--prompt-format", prompt] if prompt != "canary2" else []))
        out[layout] = Tokenizer.load(directory)
    return out


@pytest.mark.parametrize("layout", ["single", "aggregate"])
@pytest.mark.parametrize("lang", ["en", "de", "fr", "es"])
def test_round_trip(tokenizers, layout, lang):
    tok = tokenizers[layout]
    for text in SENTENCES[lang][::17] + [HELD_OUT[lang]]:
        ids = tok.encode(text, lang)
        assert ids and not any(tok.is_special(i) for i in ids)
        assert tok.decode(ids) == text


def test_layouts(tokenizers):
    single, aggregate = tokenizers["single"], tokenizers["aggregate"]
    assert single.languages == aggregate.languages == ["de", "en", "es", "fr"]
    assert [b.size for b in single.blocks] == [SPECIALS, 512]
    assert [getattr(b, "lang", None) for b in aggregate.blocks] == [None, "de", "en", "es", "fr"]
    assert single.vocab_size == SPECIALS + 512
    assert aggregate.vocab_size == SPECIALS + 4 * 320
    assert (single.prompt_format, aggregate.prompt_format) == ("canary2", "canary")
    for tok in (single, aggregate):
        assert tok.padded_vocab_size % 8 == 0
        assert tok.vocab_size <= tok.padded_vocab_size < tok.vocab_size + 8
        assert (tok.bos, tok.eos, tok.pad) == (BOS, EOS, 1)
        assert [tok.lang_id(lang) for lang in LANG] == list(LANG.values())
        assert tok.id_to_token(tok.bos) == "<|startoftranscript|>"
        assert tok.token_to_id("<|translate|>") == TRANSLATE


def test_aggregate_offsets_and_cross_block_decode(tokenizers):
    tok = tokenizers["aggregate"]
    ranges = {lang: range(SPECIALS + 320 * k, SPECIALS + 320 * (k + 1)) for k, lang in enumerate(["de", "en", "es", "fr"])}
    ids = {}
    for lang, block_range in ranges.items():
        ids[lang] = tok.encode(HELD_OUT[lang], lang)
        assert all(i in block_range for i in ids[lang]), lang
        # The piece behind an id is the piece of L's own model at id - offset.
        sp = next(b.sp for b in tok.blocks if getattr(b, "lang", None) == lang)
        assert [tok.id_to_token(i) for i in ids[lang]] == sp.encode(HELD_OUT[lang], out_type=str)
        assert tok.token_to_id(tok.id_to_token(ids[lang][0]), lang=lang) == ids[lang][0]
    # Mixed blocks with special ids in between: runs of one block decode together, specials vanish.
    mixed = [tok.bos] + ids["en"] + ids["de"] + [tok.lang_id("fr")] + ids["fr"] + ids["es"] + [tok.eos, tok.pad]
    assert tok.decode(mixed) == " ".join(HELD_OUT[lang] for lang in ("en", "de", "fr", "es"))
    with pytest.raises(ValueError, match="no SentencePiece block for language 'it'"):
        tok.encode("ciao", "it")


@pytest.mark.parametrize("layout", ["single", "aggregate"])
def test_special_strings_in_text_stay_text(tokenizers, layout):
    tok = tokenizers[layout]
    text = "<|en|> hello <|endoftext|><|startoftranscript|> <pad> <unk> <|nospeech|>"
    ids = tok.encode(text, "en")
    assert not any(tok.is_special(i) for i in ids)
    assert not {tok.bos, tok.eos, tok.pad, tok.lang_id("en"), 0, 8} & set(ids)
    assert tok.decode(ids) == text


def test_prompts_canary(tokenizers):
    tok = tokenizers["aggregate"]
    en, de, fr = LANG["en"], LANG["de"], LANG["fr"]
    assert tok.prompt_ids("en", "en", pnc=True) == [BOS, en, TRANSCRIBE, en, PNC]
    assert tok.prompt_ids("en", "en", pnc=False) == [BOS, en, TRANSCRIBE, en, NOPNC]
    assert tok.prompt_ids("en", "de", pnc=True) == [BOS, en, TRANSLATE, de, PNC]
    assert tok.prompt_ids("fr", "en", pnc=False) == [BOS, fr, TRANSLATE, en, NOPNC]
    assert tok.prompt_ids("de", "de", pnc=True, task="translate") == [BOS, de, TRANSLATE, de, PNC]
    with pytest.raises(ValueError, match="unknown language 'it'"):
        tok.prompt_ids("it", "en", pnc=True)
    with pytest.raises(ValueError, match="unknown task"):
        tok.prompt_ids("en", "en", pnc=True, task="asr")


def test_prompts_canary2_the_default(tokenizers):
    tok = tokenizers["single"]
    en, de = LANG["en"], LANG["de"]
    tail = [NOITN, NOTIMESTAMP, NODIARIZE]
    assert tok.prompt_ids("en", "en", pnc=True) == [CONTEXT, BOS, EMO, en, en, PNC] + tail
    assert tok.prompt_ids("en", "de", pnc=False) == [CONTEXT, BOS, EMO, en, de, NOPNC] + tail
    with pytest.raises(ValueError, match="no task token"):
        tok.prompt_ids("de", "de", pnc=True, task="translate")


@pytest.mark.parametrize("layout", ["single", "aggregate"])
def test_encode_example(tokenizers, layout):
    tok = tokenizers[layout]
    text = HELD_OUT["de"]
    ids, prompt_len = tok.encode_example(text, "en", "de", pnc=True)
    assert prompt_len == len(tok.prompt_ids("en", "de", pnc=True)) == {"single": 9, "aggregate": 5}[layout]
    assert ids[:prompt_len] == tok.prompt_ids("en", "de", pnc=True)
    assert ids[prompt_len:-1] == tok.encode(text, "de")  # text of the TARGET language
    assert ids[-1] == EOS
    assert tok.decode(ids) == text


@pytest.mark.parametrize("layout", ["single", "aggregate"])
def test_save_load_round_trip(tokenizers, layout, tmp_path):
    tok = tokenizers[layout]
    tok.save(tmp_path)
    again = Tokenizer.load(tmp_path)
    assert again.vocab_size == tok.vocab_size and again.languages == tok.languages
    for lang in ("en", "de", "fr", "es"):
        assert again.encode_example(HELD_OUT[lang], "en", lang, pnc=True) == tok.encode_example(
            HELD_OUT[lang], "en", lang, pnc=True
        )
    assert [again.id_to_token(i) for i in range(tok.vocab_size)] == [tok.id_to_token(i) for i in range(tok.vocab_size)]


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda c: c.pop("blocks"), "missing field 'blocks'"),
        (lambda c: c.update(format_version=99), "field 'format_version' is 99"),
        (lambda c: c.update(prompt_format="whisper"), "field 'prompt_format'"),
        (lambda c: c.update(languages="en"), "field 'languages' must be list"),
        (lambda c: c["blocks"][0].pop("tokens"), r"missing field 'blocks\[0\].tokens'"),
        (lambda c: c["blocks"][1].update(kind="bpe"), r"field 'blocks\[1\].kind'"),
        (lambda c: c["blocks"][1].update(size=7), r"field 'blocks\[1\].size' is 7"),
        (lambda c: c["blocks"][1].update(model="missing.model"), r"field 'blocks\[1\].model'"),
        (lambda c: c["blocks"][0]["tokens"].remove("<|endoftext|>"), "'<|endoftext|>' is missing"),
        (lambda c: c["languages"].append("it"), "'<|it|>' is missing"),
    ],
)
def test_malformed_config_names_the_field(tokenizers, tmp_path, corrupt, message):
    tokenizers["single"].save(tmp_path)
    path = tmp_path / "tokenizer.json"
    config = json.loads(path.read_text())
    corrupt(config)
    path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message) as e:
        Tokenizer.load(tmp_path)
    assert "tokenizer.json" in str(e.value)


def test_invalid_json_names_the_file(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.load(tmp_path)


def test_decode_rejects_ids_outside_the_vocab(tokenizers):
    tok = tokenizers["single"]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([tok.vocab_size])


def test_decode_hypothesis_skips_the_padded_vocabulary_and_special_tokens(tokenizers):
    tok = tokenizers["single"]
    ids = tok.encode(HELD_OUT["en"], "en")
    generated = [ids[0], tok.padded_vocab_size - 1, tok.eos, *ids[1:]]  # an id of the model's padding rows
    assert tok.padded_vocab_size - 1 >= tok.vocab_size
    assert tok.text_ids(generated) == ids
    assert tok.decode_hypothesis(generated) == tok.decode(ids) == HELD_OUT["en"]


def test_training_is_deterministic_and_lowers_too_large_vocab(capsys):
    sentences = train_tokenizer.sample_sentences(iter(SENTENCES["fr"] * 3), max_sentences=200, seed=0)
    assert len(sentences) == 200
    assert sentences == train_tokenizer.sample_sentences(iter(SENTENCES["fr"] * 3), max_sentences=200, seed=0)
    first = train_tokenizer.train_sentencepiece(sentences, 300)
    second = train_tokenizer.train_sentencepiece(sentences, 300)
    assert first.serialized_model_proto() == second.serialized_model_proto()
    big = train_tokenizer.train_sentencepiece(sentences, 100_000)
    assert 300 < big.get_piece_size() < 100_000
    assert "lowering it to" in capsys.readouterr().out


def test_a_character_tokenizer_spells_every_text_one_token_per_character(manifest, tmp_path):
    train_tokenizer.main(["--manifest", str(manifest), "--model-type", "char", "-o", str(tmp_path / "tok")])
    tok = Tokenizer.load(tmp_path / "tok")
    for lang in ("en", "de", "fr", "es"):
        for text in SENTENCES[lang][::17]:
            ids = tok.encode(text, lang)
            assert tok.decode(ids) == text
            assert len(ids) == len(text) + 1  # each character, and the word-boundary mark the text starts with
        held_out = tok.encode(HELD_OUT[lang], lang)  # characters never seen are spelled as their UTF-8 bytes
        assert tok.decode(held_out) == HELD_OUT[lang] and len(held_out) >= len(HELD_OUT[lang]) + 1
    pieces = {tok.id_to_token(i) for lang in ("en", "de") for i in tok.encode(SENTENCES[lang][0], lang)}
    assert all(len(p) == 1 for p in pieces), pieces


def test_extra_language_and_bad_manifest_line(tmp_path):
    good = tmp_path / "it.jsonl"
    write_manifest(good, [{"text": s, "source_lang": "it", "target_lang": "en"} for s in SENTENCES["en"]])
    train_tokenizer.main(["--manifest", str(good), "--vocab-size", "300", "-o", str(tmp_path / "tok")])
    tok = Tokenizer.load(tmp_path / "tok")
    assert tok.languages == ["de", "en", "es", "fr", "it"]
    assert tok.blocks[0].tokens == default_special_tokens(["it", "en", "de", "fr", "es"])
    assert tok.prompt_ids("it", "en", pnc=True)[3] == tok.token_to_id("<|it|>")  # canary2: <|SRC|> is 4th

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok", "source_lang": "en", "target_lang": "en"}\n{"text": "no langs"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: field 'source_lang': missing"):
        train_tokenizer.main(["--manifest", str(bad), "-o", str(tmp_path / "never")])


def test_constructor_checks():
    special = SpecialBlock(default_special_tokens(["en"]))
    with pytest.raises(ValueError, match="appears twice"):
        Tokenizer([special, SpecialBlock(["<pad>"])], ["en"])
    with pytest.raises(TypeError, match="not a tokenizer block"):
        Tokenizer([special, "en.model"], ["en"])
