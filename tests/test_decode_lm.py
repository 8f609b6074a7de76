import dataclasses
import json
import math
import subprocess
import sys

import pytest
import torch
from test_decode_search import V, batch, pick_eos, random_model, reference_beam_search

from aed.data_tokenizer import Tokenizer
from aed.decode_lm import NGramLM, check_fits, load
from aed.decode_search import DecodingOptions, search


def test_witten_bell_probabilities_by_hand():
    """Two transcripts, 1 2 and 1 3, EOS 4, five ids. Unigrams (EOS counted): 1 and 4 twice, 2 and 3
    once, 6 in all, 4 kinds, over a uniform 1/5: P(2) = (1 + 4/5) / (6 + 4) = 0.18. After 1 came 2 and 3
    once each (2 kinds): P(2 | 1) = (1 + 2 x 0.18) / (2 + 2) = 0.34. An unseen context backs off to the
    unigrams, and so does the part of a longer context that was never seen."""
    lm = NGramLM([[1, 2], [1, 3]], vocab_size=5, eos_id=4, order=3)
    assert math.exp(lm.next_log_probs(())[2]) == pytest.approx(0.18)
    assert math.exp(lm.next_log_probs((1,))[2]) == pytest.approx(0.34)
    assert math.exp(lm.next_log_probs((0,))[2]) == pytest.approx(0.18)
    # (1, 2) was followed by EOS only: P(4 | 1 2) = (1 + 1 x P(4 | 2)), P(4 | 2) = (1 + P(4)) / 2, P(4) = 2.8 / 10
    assert math.exp(lm.next_log_probs((0, 1, 2))[4]) == pytest.approx((1 + (1 + 0.28) / 2) / 2)
    for history in [(), (1,), (3,), (1, 3), (2, 2, 2)]:
        assert lm.next_log_probs(history).exp().sum().item() == pytest.approx(1.0, abs=1e-6)


def test_the_file_holds_the_transcripts_and_gives_the_same_model(tmp_path):
    lm = NGramLM([[5, 6, 7], [5, 7], [8]], vocab_size=12, eos_id=11, order=4)
    lm.save(tmp_path / "lm.pt")
    again = load(str(tmp_path / "lm.pt"))
    for history in [(), (5,), (5, 6), (9, 9, 5, 7)]:
        assert torch.equal(again.next_log_probs(history), lm.next_log_probs(history))
    check_fits(again, 12, 11, "lm.pt")
    with pytest.raises(ValueError, match="lm.pt: counted for a vocabulary of 12 with EOS 11, but the model has 40"):
        check_fits(again, 40, 11, "lm.pt")
    torch.save({"weights": torch.zeros(2)}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="other.pt: not a language model file"):
        load(str(tmp_path / "other.pt"))
    with pytest.raises(ValueError, match="token id 12 outside the vocabulary of 12"):
        NGramLM([[12]], vocab_size=12, eos_id=11)


@pytest.mark.parametrize("beam_size,ctc_weight", [(1, 0.0), (3, 0.0), (3, 0.5)])
def test_a_fused_search_equals_the_slow_reference_and_follows_the_ngram(tmp_path, beam_size, ctc_weight):
    model = random_model(seed=2, ctc_loss_weight=0.3)
    feats, lens, prompt = batch(lens=(100, 48, 75), seed=2)
    memory, memory_lens, ctc_log_probs = model.encode_with_ctc(feats, lens)
    eos = pick_eos(model, memory, memory_lens, prompt)
    g = torch.Generator().manual_seed(0)
    texts = [[t for t in torch.randint(2, V - 1, (6,), generator=g).tolist() if t != eos] for _ in range(3)]
    NGramLM(texts, V, eos, order=3).save(tmp_path / "lm.pt")
    options = DecodingOptions(beam_size, max_delta=4, ctc_weight=ctc_weight, ctc_candidates=5, max_repeats=0,
                              max_tokens_per_second=None, lm=str(tmp_path / "lm.pt"), lm_weight=1.0)
    got = search(model, memory, memory_lens, prompt, eos, options, ctc_log_probs)
    ctc = (ctc_log_probs, ctc_weight, 5) if ctc_weight else None
    lm = load(str(tmp_path / "lm.pt"))
    assert got == reference_beam_search(model, memory, memory_lens, prompt, eos, beam_size, 0.0, 4, ctc, (lm, 1.0))
    plain = search(model, memory, memory_lens, prompt, eos, dataclasses.replace(options, lm=None), ctc_log_probs)
    assert got != plain, "the n-gram should change some hypothesis, or this test shows nothing"
    # A weight of 0 leaves the search as it was.
    assert search(model, memory, memory_lens, prompt, eos, dataclasses.replace(options, lm_weight=0.0),
                  ctc_log_probs) == plain


def test_train_lm_counts_a_manifests_transcripts_with_the_models_tokenizer(tmp_path):
    manifest = tmp_path / "train.jsonl"
    rows = [{"audio_filepath": "a.wav", "duration": 1.0, "text": "Hallo Welt.", "lang": "de"},
            {"audio_filepath": "b.wav", "duration": 1.0, "text": "Hello world.", "lang": "en"},
            {"audio_filepath": "c.wav", "duration": 1.0, "text": "", "lang": "en"}]
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "lm.pt"
    p = subprocess.run([sys.executable, "tools/train_lm.py", "--manifest", str(manifest), "--tokenizer",
                        "data/mini/tokenizer", "--order", "5", "-o", str(out)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert "2 transcripts" in p.stdout and "1 invalid row" in p.stdout  # the empty transcript, counted
    tokenizer = Tokenizer.load("data/mini/tokenizer")
    lm = load(str(out))
    check_fits(lm, tokenizer.padded_vocab_size, tokenizer.eos, str(out))
    hello = tokenizer.encode("Hello world.", "en")
    assert lm.sequences == [tokenizer.encode("Hallo Welt.", "de"), hello] and lm.order == 5
    # The n-gram knows how the English transcript goes on.
    assert lm.next_log_probs(tuple(hello[:2])).argmax().item() == hello[2]
    manifest.write_text('{"audio_filepath": "a.wav", "duration": 1.0}\n')
    p = subprocess.run([sys.executable, "tools/train_lm.py", "--manifest", str(manifest), "--tokenizer",
                        "data/mini/tokenizer", "-o", str(out)], capture_output=True, text=True)
    assert p.returncode != 0 and "train.jsonl:1" in p.stderr
