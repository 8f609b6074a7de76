"""torch.export of the encoder and of one decoder step with its KV cache: the exported programs
compute what the eager model does, for shapes other than the ones they were traced with, and the
searches decode the same tokens with them as with the eager model (tests/test_model_static.py
compares the compiled model's searches with eager ones)."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from aed.decode_search import DecodingOptions, decode_features
from aed.model import AED, AEDConfig

pytest.importorskip("torch.export", reason="torch.export is unavailable in this torch")
from aed.model_static import ExportedAED, empty_cache, export_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow  # the tests share one export: 7-10 s on 2 CPU cores


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A tiny model with a CTC head and its two programs, saved to .pt2 and loaded back."""
    torch.manual_seed(0)
    cfg = AEDConfig(n_mels=32, vocab_size=48, pad_id=1, enc_d_model=32, enc_layers=1, enc_heads=2,
                    subsampling_channels=8, dec_d_model=32, dec_layers=2, dec_heads=2, dec_max_len=64, ctc_loss_weight=0.3)
    model = AED(cfg).eval()
    with torch.no_grad():  # BatchNorm statistics other than the initial ones, so eval mode is exercised
        for m in model.encoder.modules():
            if hasattr(m, "running_var"):
                m.running_mean.normal_()
                m.running_var.uniform_(0.5, 2.0)
    encoder, step = export_model(model, max_len=40)
    tmp = tmp_path_factory.mktemp("export")
    torch.export.save(encoder, tmp / "encoder.pt2")
    torch.export.save(step, tmp / "step.pt2")
    return model, torch.export.load(tmp / "encoder.pt2").module(), torch.export.load(tmp / "step.pt2").module()


def test_exported_encoder_matches_eager_for_other_batch_sizes_and_lengths(exported):
    model, encoder, _ = exported
    for lens in ([200], [333, 250, 41], [57, 57]):
        feats, feat_lens = torch.randn(len(lens), max(lens), 32), torch.tensor(lens)
        cross_kv, memory_lens, ctc = encoder(feats, feat_lens)
        with torch.no_grad():
            memory, ref_lens, ref_ctc = model.encode_with_ctc(feats, feat_lens)
            cache = model.new_cache(memory, ref_lens, 8)
        assert torch.equal(memory_lens, ref_lens)
        torch.testing.assert_close(cross_kv, cache.cross_kv, rtol=1e-5, atol=1e-5)
        valid = torch.arange(ctc.size(1))[None, :] < ref_lens[:, None]  # (B, T') padded frames are not compared
        torch.testing.assert_close(ctc[valid], ref_ctc[valid], rtol=1e-5, atol=1e-5)


def test_exported_step_matches_the_eager_cached_decoder(exported):
    """Teacher forcing random tokens: every step's logits equal the eager KVCache decoder's (the
    prompt chunk included), for a batch size and encoder length the step was not traced with."""
    model, encoder, step = exported
    torch.manual_seed(1)
    feats, feat_lens = torch.randn(3, 240, 32), torch.tensor([240, 180, 100])
    tokens = torch.randint(2, 48, (3, 12))  # (R, U): a 4-token prompt, then 8 steps
    cross_kv, memory_lens = encoder(feats, feat_lens)[:2]
    self_kv = empty_cache(model, 3, 40)
    got = []
    for pos in range(tokens.size(1)):
        logits, self_kv = step(tokens[:, pos : pos + 1], torch.tensor(pos), self_kv, cross_kv, memory_lens)
        got.append(logits)
    with torch.no_grad():
        memory, lens = model.encode(feats, feat_lens)
        cache = model.new_cache(memory, lens, 40)
        ref = [model.decode_step(tokens[:, :4], cache)]
        ref += [model.decode_step(tokens[:, pos : pos + 1], cache) for pos in range(4, tokens.size(1))]
    for pos, (a, b) in enumerate(zip(got[3:], ref)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m: f"position {pos + 3}: {m}")


SEARCHES = {  # name: options; "joint" ranks by CTC and attention scores (the fixture model has a CTC head)
    "greedy": DecodingOptions(ctc_weight=0.0),
    "beam": DecodingOptions(ctc_weight=0.0, beam_size=4),
    "joint greedy": DecodingOptions(),
    "joint beam": DecodingOptions(beam_size=4),
}
LIMITS = dict(max_new_tokens=40 - 3, max_delta=40, max_repeats=0, max_tokens_per_second=None)  # U_max 40, 3-token prompt


def decoding_inputs():
    torch.manual_seed(2)
    feats, feat_lens = torch.randn(2, 300, 32), torch.tensor([300, 220])
    return feats, feat_lens, torch.tensor([[3, 5, 7]] * 2), 2  # prompt (B, P), EOS


@pytest.mark.parametrize("name", list(SEARCHES))
def test_the_searches_decode_with_the_exported_programs_as_with_the_eager_model(name, exported):
    """aed.decode_search's own loops on ExportedAED (the step fed the prompt a token at a time)."""
    model, encoder, step = exported
    feats, feat_lens, prompt, eos = decoding_inputs()
    options = dataclasses.replace(SEARCHES[name], **LIMITS)
    got = decode_features(ExportedAED(encoder, step, max_len=40), feats, feat_lens, prompt, eos, options)[0]
    ref = decode_features(model, feats, feat_lens, prompt, eos, options)[0]
    assert got == ref and len({t for row in got for t in row}) > 1, (got, ref)



@pytest.mark.slow(seconds=30)
def test_the_tool_exports_and_decodes_a_file_as_eager_decoding_does(tmp_path):
    """tools/export_torch.py as its docstring runs it, --audio included: the programs' tokens are eager's."""
    p = subprocess.run([sys.executable, "tools/export_torch.py", "--ckpt", "tests/fixtures/word_model.pt", "-o",
                        str(tmp_path / "exported"), "--max-len", "64", "--audio", "data/mini/examples/en_asr_16k.wav"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "(same as eager decoding)" in p.stdout + p.stderr
    assert (tmp_path / "exported" / "encoder.pt2").exists() and (tmp_path / "exported" / "decoder_step.pt2").exists()
