import dataclasses
import math
from pathlib import Path

import pytest
import torch

from aed.data_tokenizer import Tokenizer
from aed.model import AED, AEDConfig, count_parameters, text_targets
from aed.model_encoder import (ConvSubsampling, MaskedBatchNorm1d, RelPositionMultiHeadAttention, conv_stage_length,
                               rel_positional_encoding, rel_shift, subsampled_length)
from aed.train_config import load_train_config, resolve_model

CONFIGS = Path(__file__).resolve().parents[1] / "configs"



def tiny_config(**overrides):
    d = dict(n_mels=24, vocab_size=40, pad_id=1, enc_d_model=32, enc_layers=2, enc_heads=4, subsampling_channels=8,
             dec_d_model=48, dec_layers=2, dec_heads=4, dec_max_len=64)
    d.update(overrides)
    return AEDConfig(**d)


@pytest.mark.parametrize("factor", [8, 4])
def test_subsampled_length_matches_the_convolutions(factor):
    sub = ConvSubsampling(n_mels=20, channels=4, d_model=8, factor=factor)
    for t in list(range(1, 70)) + [97, 128, 1001, 3000]:
        y, y_lens = sub(torch.randn(1, t, 20), torch.tensor([t]))
        assert y.shape == (1, subsampled_length(t, factor), 8), t
        assert y_lens.tolist() == [subsampled_length(t, factor)]
        assert subsampled_length(torch.tensor([t]), factor).item() == subsampled_length(t, factor) == -(-t // factor)
        assert conv_stage_length(t) == math.floor((t + 2 * 1 - 3) / 2 + 1)
    assert subsampled_length(128) == 16  # the F' of the Canary subsampling Linear (256 * 16 -> 1024)
    assert len(sub.conv) == (8 if factor == 8 else 5)  # NeMo's Sequential: conv, relu, then 3 modules per extra stage


@pytest.mark.parametrize("factor", [8, 4])
def test_subsampling_without_autograd_computes_what_training_does_in_groups_of_rows(factor, monkeypatch):
    """Inference's path (groups of rows, in place, channels last on the CPU) against training's, on a
    padded batch split into groups of two rows; the caller's features stay as they were."""
    torch.manual_seed(0)
    sub = ConvSubsampling(n_mels=20, channels=4, d_model=8, factor=factor)
    feats, lens = torch.randn(5, 90, 20), torch.tensor([90, 37, 61, 90, 12])
    before = feats.clone()
    reference, reference_lens = sub(feats, lens)
    with torch.no_grad():
        whole, whole_lens = sub(feats, lens)  # one group: the batch fits the budget
    monkeypatch.setattr("aed.model_encoder.CPU_SUBSAMPLING_ELEMENTS", 2 * 4 * 45 * 10)  # 2 rows' first conv output
    with torch.no_grad():
        y, y_lens = sub(feats, lens)
    for out, out_lens in ((whole, whole_lens), (y, y_lens)):
        torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)
        assert torch.equal(out_lens, reference_lens)
    assert torch.equal(feats, before)


def test_a_subsampling_factor_other_than_4_or_8_is_rejected():
    with pytest.raises(AssertionError, match="subsampling_factor must be one of"):
        tiny_config(subsampling_factor=2)


@pytest.mark.parametrize(
    "name, expected",
    [
        ("canary-1b", 1_017_825_408),
        ("canary-1b-flash", 883_554_432),
        ("canary-1b-smalldec", 681_891_968),
        ("canary-180m-flash", 182_643_840),
    ],
)
def test_parameter_counts_equal_nemo(name, expected):
    with torch.device("meta"):
        model = AED(AEDConfig.from_yaml(CONFIGS / f"{name}.yaml"))
    assert count_parameters(model) == expected


def test_tiny_preset_is_cpu_sized():
    """The model train.py builds from configs/tiny.yaml: its vocabulary comes from the tokenizer."""
    cfg = load_train_config(CONFIGS / "tiny.yaml")
    cfg = resolve_model(cfg, Tokenizer.load(CONFIGS.parent / cfg.train.tokenizer))
    assert (cfg.model.n_mels, cfg.model.vocab_size) == (80, 536)
    with torch.device("meta"):
        model = AED(cfg.model)
    assert 1_000_000 <= count_parameters(model) <= 3_000_000


def test_config_rejects_unknown_keys_and_wrong_types(tmp_path):
    with pytest.raises(ValueError, match="enc_layer"):
        AEDConfig.from_dict({"enc_layer": 3})
    with pytest.raises(ValueError, match="model.enc_layers"):
        AEDConfig.from_dict({"enc_layers": "3"})
    with pytest.raises(ValueError, match="model.loss_on_prompt"):
        AEDConfig.from_dict({"loss_on_prompt": 1})
    assert AEDConfig.from_dict({"label_smoothing": 0}).label_smoothing == 0
    path = tmp_path / "c.yaml"
    path.write_text("training:\n  lr: 1.0\nmodel:\n  dec_layers: 4\n")  # other sections are ignored
    assert AEDConfig.from_yaml(path).dec_layers == 4
    assert AEDConfig.from_dict(AEDConfig().to_dict()) == AEDConfig()


def test_rel_shift_indexes_relative_distance():
    b, h, t = 2, 3, 5
    x = torch.randn(b, h, t, 2 * t - 1)
    out = rel_shift(x)
    for i in range(t):
        for j in range(t):
            assert torch.equal(out[:, :, i, j], x[:, :, i, j + t - 1 - i])


def test_rel_pos_attention_matches_transformer_xl_formula():
    torch.manual_seed(0)
    d, h, t = 16, 2, 6
    att = RelPositionMultiHeadAttention(d, h, dropout_att=0.0).eval()
    with torch.no_grad():
        att.pos_bias_u.normal_()
        att.pos_bias_v.normal_()
    x = torch.randn(1, t, d)
    pos_emb = rel_positional_encoding(t, d, x.device, x.dtype)
    pad_mask = torch.tensor([[False] * (t - 1) + [True]])
    got = att(x, pos_emb, pad_mask)

    # Naive reference: score(i, j) = ((q_i + u) . k_j + (q_i + v) . W_pos pe(i - j)) / sqrt(d_k).
    dk = d // h
    q = att.linear_q(x).view(t, h, dk)
    k = att.linear_k(x).view(t, h, dk)
    v = att.linear_v(x).view(t, h, dk)
    freqs = torch.exp(torch.arange(0, d, 2).float() * (-math.log(10000.0) / d))
    scores = torch.empty(h, t, t)
    for i in range(t):
        for j in range(t):
            angles = (i - j) * freqs
            pe = torch.stack([angles.sin(), angles.cos()], -1).flatten()
            p = att.linear_pos(pe).view(h, dk)
            scores[:, i, j] = ((q[i] + att.pos_bias_u) * k[j]).sum(-1) + ((q[i] + att.pos_bias_v) * p).sum(-1)
    scores = (scores / math.sqrt(dk)).masked_fill(pad_mask[0], float("-inf"))
    ref = torch.einsum("hij,jhd->ihd", scores.softmax(-1), v).reshape(1, t, d)
    torch.testing.assert_close(got, att.linear_out(ref), atol=1e-5, rtol=1e-5)


def test_masked_batch_norm_ignores_padding():
    torch.manual_seed(0)
    lens = torch.tensor([7, 3, 5])
    x = torch.randn(3, 4, 7)
    pad_mask = torch.arange(7)[None, :] >= lens[:, None]
    x = x.masked_fill(pad_mask[:, None, :], 1e3)  # garbage in padding must not matter
    ours = MaskedBatchNorm1d(4).train()
    ref = torch.nn.BatchNorm1d(4).train()
    y = ours(x, pad_mask)
    packed = torch.cat([x[i, :, : lens[i]] for i in range(3)], dim=1)[None]  # (1, C, sum(lens))
    y_ref = ref(packed)[0]
    torch.testing.assert_close(torch.cat([y[i, :, : lens[i]] for i in range(3)], dim=1), y_ref)
    torch.testing.assert_close(ours.running_mean, ref.running_mean)
    torch.testing.assert_close(ours.running_var, ref.running_var)
    assert set(dict(ours.named_buffers())) == set(dict(ref.named_buffers()))  # NeMo BatchNorm checkpoints load as is


@pytest.mark.parametrize("conv_norm,factor", [("batch_norm", 8), ("layer_norm", 8), ("batch_norm", 4)])
def test_utterance_alone_equals_inside_padded_batch(conv_norm, factor):
    torch.manual_seed(0)
    model = AED(tiny_config(conv_norm=conv_norm, subsampling_factor=factor, ctc_loss_weight=0.5)).eval()
    with torch.no_grad():  # non-trivial running statistics, so eval-mode BatchNorm does something
        for m in model.modules():
            if isinstance(m, MaskedBatchNorm1d):
                m.running_mean.normal_()
                m.running_var.uniform_(0.5, 2.0)
    lens = torch.tensor([37, 90, 61])
    feats = torch.randn(3, 90, 24)
    feats[0, 37:] = 5.0  # padding content must not matter
    feats[2, 61:] = -3.0
    tokens = torch.randint(2, 40, (3, 9))
    token_lens, prompt_lens = torch.tensor([6, 9, 8]), torch.tensor([3, 3, 3])
    with torch.no_grad():
        memory, memory_lens = model.encode(feats, lens)
        loss, count = model(feats, lens, tokens, token_lens, prompt_lens)
        total, total_count = 0.0, 0
        for i in range(3):
            t = int(lens[i])
            alone, alone_lens = model.encode(feats[i : i + 1, :t], lens[i : i + 1])
            assert alone_lens.item() == memory_lens[i].item() == alone.size(1)
            torch.testing.assert_close(memory[i : i + 1, : alone.size(1)], alone, atol=1e-5, rtol=1e-5)
            u = int(token_lens[i])
            l_i, c_i = model(feats[i : i + 1, :t], lens[i : i + 1], tokens[i : i + 1, :u], token_lens[i : i + 1], prompt_lens[i : i + 1])
            total, total_count = total + l_i, total_count + int(c_i)
    torch.testing.assert_close(loss, total, atol=1e-4, rtol=1e-5)
    assert int(count) == total_count == int((token_lens - 1).sum())


def test_loss_can_exclude_the_prompt():
    torch.manual_seed(0)
    feats, lens = torch.randn(2, 50, 24), torch.tensor([50, 40])
    tokens = torch.randint(2, 40, (2, 10))
    token_lens, prompt_lens = torch.tensor([10, 7]), torch.tensor([5, 5])
    with torch.no_grad():
        full = AED(tiny_config()).eval()
        text_only = AED(tiny_config(loss_on_prompt=False)).eval()
        text_only.load_state_dict(full.state_dict())
        loss_all, n_all = full(feats, lens, tokens, token_lens, prompt_lens)
        loss_text, n_text = text_only(feats, lens, tokens, token_lens, prompt_lens)
        # Scoring 1 - smoothing on the target plus smoothing spread over the vocab: a larger loss.
        smooth = AED(tiny_config(label_smoothing=0.1)).eval()
        smooth.load_state_dict(full.state_dict())
        loss_smooth, _ = smooth(feats, lens, tokens, token_lens, prompt_lens)
    assert int(n_all) == 9 + 6
    assert int(n_text) == (10 - 5) + (7 - 5)  # text tokens + eos
    assert 0 < loss_text < loss_all
    assert loss_smooth != loss_all


def test_gradients_reach_every_parameter():
    torch.manual_seed(0)
    model = AED(tiny_config()).train()
    feats, lens = torch.randn(2, 60, 24), torch.tensor([60, 33])
    tokens = torch.randint(2, 40, (2, 8))
    loss, count = model(feats, lens, tokens, torch.tensor([8, 6]), torch.tensor([3, 3]))
    (loss / count).backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing, f"no gradient for {missing}"
    assert model.decoder.output_proj.weight is model.decoder.embedding.token_embedding.weight


@pytest.mark.parametrize("where", ["encoder", "decoder", "both"])
def test_activation_checkpointing_gives_the_same_gradients(where):
    """Recomputed layers replay the same dropout masks (checkpoint restores the RNG state), so the
    gradients equal the plain step's, while fewer activations are kept for backward."""
    torch.manual_seed(0)
    model = AED(tiny_config()).train()
    feats, lens = torch.randn(2, 60, 24), torch.tensor([60, 33])
    tokens = torch.randint(2, 40, (2, 8))
    grads, saved = [], []
    for ckpt in (False, True):
        model.encoder.checkpoint_activations = ckpt and where in ("encoder", "both")
        model.decoder.checkpoint_activations = ckpt and where in ("decoder", "both")
        model.zero_grad()
        torch.manual_seed(1)  # same dropout masks in both runs
        n_saved = [0]

        def pack(t):
            n_saved[0] += t.numel()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss, _ = model(feats, lens, tokens, torch.tensor([8, 6]), torch.tensor([3, 3]))
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        saved.append(n_saved[0])
    assert saved[1] < 0.8 * saved[0], f"checkpointing should store fewer activations: {saved}"
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, atol=1e-5, rtol=1e-4, msg=name)


def test_separate_encoder_and_decoder_widths_get_a_projection():
    model = AED(tiny_config(enc_d_model=32, dec_d_model=48))
    assert model.encoder_decoder_proj.weight.shape == (48, 32)
    memory, _ = model.encode(torch.randn(1, 40, 24), torch.tensor([40]))
    assert memory.shape == (1, subsampled_length(40), 48)
    same = AED(tiny_config(enc_d_model=48, dec_d_model=48))
    assert not any("encoder_decoder_proj" in n for n, _ in same.named_parameters())


def test_bad_feature_shape_is_a_clear_error():
    model = AED(tiny_config())
    with pytest.raises(AssertionError, match="expected feats"):
        model.encode(torch.randn(1, 40, 80), torch.tensor([40]))


def test_ctc_auxiliary_loss_adds_a_head_and_a_term():
    torch.manual_seed(0)
    cfg = AEDConfig(n_mels=16, vocab_size=48, pad_id=1, enc_d_model=32, enc_layers=1, enc_heads=2,
                    subsampling_channels=8, dec_d_model=32, dec_layers=1, dec_heads=2, dec_max_len=64)
    feats, feat_lens = torch.randn(2, 160, 16), torch.tensor([160, 120])  # 20 / 15 encoder frames
    tokens = torch.randint(2, 40, (2, 12))
    token_lens, prompt_lens = torch.tensor([12, 9]), torch.tensor([5, 5])
    plain = AED(cfg).eval()
    with_ctc = AED(dataclasses.replace(cfg, ctc_loss_weight=0.3)).eval()
    with_ctc.load_state_dict(plain.state_dict(), strict=False)
    ce, n = plain(feats, feat_lens, tokens, token_lens, prompt_lens)
    total, n2 = with_ctc(feats, feat_lens, tokens, token_lens, prompt_lens)
    enc, enc_lens = with_ctc.encoder(feats, feat_lens)
    ctc, count = with_ctc.ctc.loss(enc, enc_lens, *text_targets(tokens, token_lens, prompt_lens))
    assert count == 6 + 3 and n == n2  # text tokens only: no prompt, no EOS
    torch.testing.assert_close(total, ce + 0.3 * ctc)
    total.backward()
    assert with_ctc.ctc.proj.weight.grad.abs().sum() > 0
    # A translation row trains the decoder but not the CTC head: its words were never spoken.
    only_first, _ = with_ctc(feats, feat_lens, tokens, token_lens, prompt_lens, torch.tensor([True, False]))
    first_targets = text_targets(tokens[:1], token_lens[:1], prompt_lens[:1])
    ctc_first, count_first = with_ctc.ctc.loss(enc[:1], enc_lens[:1], *first_targets)
    assert count_first == 6 and ctc_first < ctc
    torch.testing.assert_close(only_first, ce + 0.3 * ctc_first)


# --- guided attention ------------------------------------------------------------------------------


def band(u: int, t: int, prompt: int, shift: float = 0.0) -> torch.Tensor:
    """Cross-attention weights (1, 1, U-1, T) that put each text position's whole weight on the frame
    at its own place in the utterance (shifted by `shift` of it); prompt positions attend to frame 0."""
    w = torch.zeros(1, 1, u - 1, t)
    for i in range(u - 1):
        frac = (i - (prompt - 1) + 0.5) / (u - prompt)
        w[0, 0, i, min(t - 1, max(0, int(((frac + shift) % 1.0) * t)))] = 1.0
    return w


@pytest.mark.parametrize("frames", [40, 400])
def test_off_diagonal_attention_is_zero_on_the_diagonal_and_grows_away_from_it(frames):
    from aed.model import off_diagonal_attention

    u, prompt = 13, 3  # 10 text tokens + eos after a 3-token prompt
    scored = torch.arange(u - 1)[None, :] >= prompt - 1
    args = (scored, torch.tensor([u]), torch.tensor([prompt]), torch.tensor([frames]))
    per_token = [off_diagonal_attention([band(u, frames, prompt, s)], *args).item() / 10 for s in (0.0, 0.1, 0.5)]
    uniform = off_diagonal_attention([torch.full((1, 1, u - 1, frames), 1 / frames)], *args).item() / 10
    assert per_token[0] < 0.02 < per_token[1] < uniform < per_token[2] <= 1.0, (per_token, uniform)
    # the same at 40 and 400 frames: the band is a fraction of the utterance, whatever its length
    assert uniform == pytest.approx(0.5, abs=0.1)
    # prompt positions and rows that are not transcriptions add nothing
    off = band(u, frames, prompt, 0.5)
    assert off_diagonal_attention([off], *args, rows=torch.tensor([False])).item() == 0.0
    assert off_diagonal_attention([off], torch.ones(1, u - 1, dtype=torch.bool), *args[1:]).item() == pytest.approx(
        off_diagonal_attention([off], *args).item())


@pytest.mark.parametrize("frames", [40, 400])
def test_off_alignment_attention_follows_the_ctc_path_with_a_band_of_frames(frames):
    """Log-probs whose best path emits text token k at frame 3k + 1 (blank elsewhere): attention on
    those frames costs almost nothing, attention two tokens off costs nearly all of it, at any
    utterance length; rows no CTC path fits, and translations, are left out."""
    from aed.model import off_alignment_attention

    vocab, blank, prompt, n = 12, 11, 3, 8  # 8 text tokens after a 3-token prompt, then EOS
    text = torch.arange(n) % 4 + 2  # repeats need a blank between them
    tokens = torch.cat([torch.tensor([5, 6, 7]), text, torch.tensor([9])])[None]  # (1, U)
    u, token_lens, prompt_lens = tokens.size(1), torch.tensor([tokens.size(1)]), torch.tensor([prompt])
    log_probs = torch.full((1, frames, vocab), -10.0)
    log_probs[0, :, blank] = 0.0
    peaks = [3 * k + 1 for k in range(n)]
    for k, f in enumerate(peaks):
        log_probs[0, f, blank], log_probs[0, f, int(text[k])] = -10.0, 0.0

    def attention(shift):  # each text position on its token's frame + shift; the others uniform
        w = torch.full((1, 1, u - 1, frames), 1 / frames)
        for k, f in enumerate(peaks):
            w[0, 0, prompt - 1 + k] = 0.0
            w[0, 0, prompt - 1 + k, f + shift] = 1.0
        return [w]

    args = (log_probs, blank, tokens, token_lens, prompt_lens, torch.tensor([frames]))
    on, off = (off_alignment_attention(attention(s), *args).item() / n for s in (0, 6))
    assert on < 0.12 and off > 0.98, (on, off)
    assert off_alignment_attention(attention(6), *args, rows=torch.tensor([False])).item() == 0.0
    too_short = (log_probs, blank, tokens, token_lens, prompt_lens, torch.tensor([n - 1]))
    assert off_alignment_attention(attention(6), *too_short).item() == 0.0


def test_attention_guide_adds_its_term_in_training_only_and_the_open_attention_equals_sdpa():
    torch.manual_seed(0)
    no_dropout = {k: 0.0 for k in ("enc_dropout", "enc_dropout_pre_encoder", "enc_dropout_att", "dec_dropout",
                                   "dec_dropout_att")}
    model = AED(tiny_config(ctc_loss_weight=0.0, **no_dropout)).train()  # train mode without randomness
    b, t = 2, 160
    feats, feat_lens = torch.randn(b, t, 24), torch.tensor([160, 120])
    tokens, token_lens, prompt_lens = torch.randint(2, 38, (b, 9)), torch.tensor([9, 7]), torch.tensor([3, 3])
    memory, memory_lens = model.encode(feats, feat_lens)
    weights = []
    opened = model.decoder(tokens[:, :-1], memory, memory_lens, weights)
    assert torch.allclose(opened, model.decoder(tokens[:, :-1], memory, memory_lens), atol=1e-5)
    assert len(weights) == 2 and weights[0].shape == (b, 4, 8, memory.size(1))
    assert torch.allclose(weights[0].sum(-1), torch.ones(b, 4, 8))
    assert weights[0][1, :, :, int(memory_lens[1]):].abs().max() == 0  # padding frames get no weight

    plain, n = model(feats, feat_lens, tokens, token_lens, prompt_lens)
    model.attention_guide = 2.0
    guided, n_guided = model(feats, feat_lens, tokens, token_lens, prompt_lens)
    assert n == n_guided and guided > plain
    guided.backward()
    assert model.decoder.layers[0].cross_attn.query_net.weight.grad.abs().sum() > 0
    only_translations, _ = model(feats, feat_lens, tokens, token_lens, prompt_lens, torch.tensor([False, False]))
    assert torch.allclose(only_translations, plain)
    model.eval()  # validation: the cross-entropy alone
    evaluated = model(feats, feat_lens, tokens, token_lens, prompt_lens)[0]
    model.attention_guide = 0.0
    assert torch.equal(evaluated, model(feats, feat_lens, tokens, token_lens, prompt_lens)[0])


def test_the_guide_toward_the_ctc_alignment_adds_a_term_that_trains_the_cross_attention():
    torch.manual_seed(0)
    model = AED(tiny_config(ctc_loss_weight=0.5)).train()
    feats, feat_lens = torch.randn(2, 160, 24), torch.tensor([160, 120])
    tokens, token_lens, prompt_lens = torch.randint(2, 38, (2, 9)), torch.tensor([9, 7]), torch.tensor([3, 3])
    torch.manual_seed(1)
    plain, _ = model(feats, feat_lens, tokens, token_lens, prompt_lens)
    model.attention_guide, model.guide_to = 2.0, "ctc"
    torch.manual_seed(1)  # the same dropout draws
    guided, _ = model(feats, feat_lens, tokens, token_lens, prompt_lens)
    assert guided > plain
    guided.backward()
    assert model.decoder.layers[0].cross_attn.query_net.weight.grad.abs().sum() > 0


def test_a_guide_on_one_head_trains_that_head_alone():
    """guide_heads=1: the guide's term (the guided loss less the plain one) reaches the query
    projection of each layer's first cross-attention head only; the other heads look where they like."""
    torch.manual_seed(0)
    no_dropout = {k: 0.0 for k in ("enc_dropout", "enc_dropout_pre_encoder", "enc_dropout_att", "dec_dropout",
                                   "dec_dropout_att")}
    model = AED(tiny_config(ctc_loss_weight=0.0, **no_dropout)).train()
    feats, feat_lens = torch.randn(2, 160, 24), torch.tensor([160, 120])
    tokens, token_lens, prompt_lens = torch.randint(2, 38, (2, 9)), torch.tensor([9, 7]), torch.tensor([3, 3])
    plain, _ = model(feats, feat_lens, tokens, token_lens, prompt_lens)
    model.attention_guide, model.guide_heads = 2.0, 1
    guided, _ = model(feats, feat_lens, tokens, token_lens, prompt_lens)
    (guided - plain).backward()
    for layer in model.decoder.layers:
        grad = layer.cross_attn.query_net.weight.grad.abs().reshape(model.cfg.dec_heads, -1).amax(dim=1)  # (D, D) -> per head
        assert grad[0] > 0 and grad[1:].max() <= 1e-4 * grad[0], grad  # float noise of two graphs
