"""The fixed-shape decoder step (aed/model_static.py: the KVCache with a tensor position) gives eager decoding's tokens, and int8 weights keep
a trained model's transcripts (aed.model_checkpoint.quantize_int8)."""

import dataclasses
import os
import random

import pytest
import soundfile as sf
import torch
from fixtures.make_word_model import load_clips, word_sequence
from test_decode_search import batch, pick_eos, random_model
from torch import nn

from aed.decode_metrics import wer
from aed.decode_search import DecodingOptions, decode_features
from aed.decode_transcribe import transcribe
from aed.model_checkpoint import load_model, quantize_int8
from aed.model_decoder import KVCache
from aed.model_static import CompiledAED

WORD_MODEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "word_model.pt")
SEARCHES = {  # name: options; "joint" ranks by CTC and attention scores (the word model has a CTC head)
    "greedy": DecodingOptions(ctc_weight=0.0),
    "beam": DecodingOptions(ctc_weight=0.0, beam_size=4),
    "joint greedy": DecodingOptions(),
    "joint beam": DecodingOptions(beam_size=4),
}


def word_files(directory, n: int, seed: int) -> tuple[list[str], list[str]]:
    """n files of 1-5 random words of the word model's clips -> their paths and transcripts."""
    rng, gen, clips = random.Random(seed), torch.Generator().manual_seed(seed), load_clips()
    paths, texts = [], []
    for i in range(n):
        words = [rng.choice(sorted(clips)) for _ in range(rng.randint(1, 5))]
        wav, _ = word_sequence(clips, words, [rng.uniform(0.1, 0.4) for _ in words], rng.uniform(0.0, 0.5),
                               10 ** rng.uniform(-4, -2.5), gen)
        paths.append(str(directory / f"words{seed}_{i}.wav"))
        sf.write(paths[-1], wav.numpy(), 16000, subtype="FLOAT")
        texts.append(" ".join(words))
    return paths, texts


def test_a_tensor_position_writes_there_and_masks_what_is_not_written():
    layers, rows, heads, max_len, d_k = 2, 3, 2, 6, 4
    keys, values = ([torch.zeros(rows, heads, max_len, d_k) for _ in range(layers)] for _ in range(2))
    cache = KVCache(keys, values, torch.randn(layers, 2, rows, heads, 7, d_k),
                    torch.ones(rows, 1, 1, 7, dtype=torch.bool), torch.tensor(0))
    prompt_k = torch.randn(rows, heads, 2, d_k)
    k, _ = cache.update(0, prompt_k, -prompt_k)
    assert k.shape == (rows, heads, max_len, d_k) and torch.equal(k[:, :, :2], prompt_k) and k[:, :, 2:].abs().sum() == 0
    assert keys[1].abs().sum() == 0, "a layer's update writes only that layer"
    assert cache.self_attn_mask(2).tolist() == [[[[True, False, False, False, False, False],
                                                  [True, True, False, False, False, False]]]]  # causal in the chunk
    cache.advance(2)
    assert cache.length.item() == 2
    step_k = torch.randn(rows, heads, 1, d_k)
    k, v = cache.update(1, step_k, step_k)
    assert torch.equal(k[:, :, 2], step_k[:, :, 0]) and torch.equal(v[:, :, 2], step_k[:, :, 0])
    assert cache.self_attn_mask(1).tolist() == [[[[True, True, True, False, False, False]]]]
    cache.reorder(torch.tensor([1, 0]))  # the third row is padding: it keeps its own history
    assert torch.equal(keys[0][:, :, :2], prompt_k[[1, 0, 2]]) and torch.equal(values[0][:, :, :2], -prompt_k[[1, 0, 2]])


@pytest.mark.parametrize("name", list(SEARCHES))
def test_the_static_cache_decodes_the_tokens_of_the_eager_one(name, monkeypatch):
    """Every search through CompiledAED's fixed-shape buckets (3 utterances in 4 rows, 120 frames in 128,
    positions rounded up), its step run uncompiled here (the same computation; the slow tests compile
    it), on a float64 model: the same tokens as eager decoding, in greedy, beam and joint search."""
    model = random_model(ctc_loss_weight=0.3)
    feats, lens, prompt = batch(lens=(120, 70, 33))
    eos = pick_eos(model, *model.encode(feats, lens), prompt)
    compiled = CompiledAED(model)
    monkeypatch.setattr(compiled, "_step", model.decode_step)
    options = dataclasses.replace(SEARCHES[name], max_delta=12, max_repeats=0, max_tokens_per_second=None)
    ref = decode_features(model, feats, lens, prompt, eos, options)[0]
    assert decode_features(compiled, feats, lens, prompt, eos, options)[0] == ref
    assert len({len(h) for h in ref}) > 1, f"every hypothesis has the same length: {ref}"


def test_quantize_int8_replaces_every_linear_layer():
    model = random_model().float()
    quantized = quantize_int8(model)
    assert quantized is model  # in place: no second copy of the weights
    assert not any(type(m) is nn.Linear for m in quantized.modules())
    with pytest.raises(ValueError, match="do not combine"):
        load_model(WORD_MODEL, compile=True, int8=True)


def test_int8_weights_keep_the_word_models_transcripts(tmp_path):
    """The committed word model (tests/fixtures/make_word_model.py) on 16 files of unseen word sequences: int8
    weights (every Linear of encoder, decoder and CTC head) cost at most 5 points of WER."""
    paths, texts = word_files(tmp_path, 16, seed=123)
    scores = {}
    for int8 in (False, True):
        results, _ = transcribe(load_model(WORD_MODEL, int8=int8), paths, pnc=False)
        scores[int8] = wer(texts, [r.pred_text for r in results])
    assert scores[True] <= scores[False] + 5.0, scores


# --- compiled (slow: each shape bucket compiles in ~10-20 s on 2 CPU cores) --------------------------

@pytest.fixture(scope="module")
def compiled_asr():
    return load_model(WORD_MODEL, compile=True)  # one CompiledAED: its graphs are shared by the tests below


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SEARCHES))
def test_the_compiled_step_transcribes_as_eager_decoding_on_the_trained_word_model(name, compiled_asr, tmp_path):
    paths, texts = word_files(tmp_path, 6, seed=5)
    eager, _ = transcribe(load_model(WORD_MODEL), paths, SEARCHES[name], pnc=False)
    compiled, _ = transcribe(compiled_asr, paths, SEARCHES[name], pnc=False)
    assert [r.pred_text for r in compiled] == [r.pred_text for r in eager]
    assert wer(texts, [r.pred_text for r in eager]) < 50, "the fixture model should mostly recognise its words"


@pytest.mark.slow
def test_a_batch_of_a_seen_bucket_reuses_its_graphs(compiled_asr, tmp_path):
    """Other files of other lengths, as many of them: the same bucket, so no recompilation."""
    first, _ = word_files(tmp_path, 6, seed=5)
    other, _ = word_files(tmp_path, 6, seed=6)
    transcribe(compiled_asr, first, SEARCHES["greedy"], pnc=False)
    with torch._dynamo.config.patch(error_on_recompile=True):
        transcribe(compiled_asr, other, SEARCHES["greedy"], pnc=False)
