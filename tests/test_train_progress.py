"""FLOP accounting (aed/train_progress.py): torch's counter against hand formulas for the encoder's own
modules, counted once per batch shape, and a measured matmul peak."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from aed.model import AED, AEDConfig
from aed.model_encoder import ConformerFeedForward, RelPositionMultiHeadAttention, rel_positional_encoding
from aed.train_progress import CPU_ATTENTION, CountFlops, StepFlops, matmul_peak


class Shaped:
    """The two fields of a batch that `shape_key` reads."""

    def __init__(self, feats, tokens=torch.zeros(0, 0)):
        self.feats, self.tokens = feats, tokens


def test_feed_forward_step_flops_equal_the_hand_formula():
    """N frames through D -> F -> D, forward and backward, input without gradient: forward 2NDF per
    Linear; backward 2NDF for each weight gradient and for the input gradient of the second Linear
    (the first one's input needs none): 10 N D F in all. Biases are not matmul FLOPs."""
    n, d, f = 37, 24, 96
    ff = ConformerFeedForward(d, f, dropout=0.0)
    x = torch.randn(n, d)
    counter = StepFlops()
    _, flops = counter.run(lambda: ff(x).sum().backward(), [Shaped(x)])
    assert flops == 10 * n * d * f


def test_relative_position_attention_flops_equal_the_hand_formula():
    """Forward only: q, k, v, out projections 4 x 2BTD^2; the position table's projection
    2(2T-1)D^2; position scores (q+v) p^T 2BT(2T-1)D; SDPA's q k^T and weights x v 2 x 2BT^2D."""
    b, t, d, h = 3, 11, 32, 4
    att = RelPositionMultiHeadAttention(d, h, dropout_att=0.0).eval()
    x = torch.randn(b, t, d)
    pos = rel_positional_encoding(t, d, x.device, x.dtype)
    with torch.no_grad():
        _, flops = StepFlops().run(lambda: att(x, pos, torch.zeros(b, t, dtype=torch.bool)), [Shaped(x)])
    assert flops == 8 * b * t * d * d + 2 * (2 * t - 1) * d * d + 2 * b * t * (2 * t - 1) * d + 4 * b * t * t * d


def test_a_shape_is_counted_once_and_looked_up_after():
    ff = ConformerFeedForward(8, 16, dropout=0.0)
    counter, runs = StepFlops(), []

    def step(x):
        runs.append(x.shape)
        ff(x).sum().backward()

    a, b = torch.randn(5, 8), torch.randn(7, 8)
    first = counter.run(lambda: step(a), [Shaped(a)])[1]
    again = counter.run(lambda: step(a), [Shaped(a)])[1]
    other = counter.run(lambda: step(b), [Shaped(b)])[1]
    assert first == again == 10 * 5 * 8 * 16 and other == 10 * 7 * 8 * 16
    assert len(runs) == 3 and len(counter.cache) == 2  # every step ran; two shapes were counted


def test_a_fit_of_counted_shapes_predicts_new_ones_only_when_it_checks_out():
    ff = ConformerFeedForward(8, 16, dropout=0.0)
    counter = StepFlops(exact=8)
    for b, t in [(b, t) for b in (1, 2, 3) for t in range(3, 9)]:  # 18 shapes
        x = torch.randn(b, t, 8)
        _, flops = counter.run(lambda: ff(x).sum().backward(), [Shaped(x)])
        assert flops == pytest.approx(10 * b * t * 8 * 16, rel=1e-9)
    assert len(counter.cache) == 8 and counter.coef is not None  # 8 counted, 10 predicted

    cubic = StepFlops(exact=8)  # 2 n^3 FLOPs: not a sum of the shape terms, so it never takes over
    for n in range(2, 20):
        a = torch.randn(n, n)
        _, flops = cubic.run(lambda: a @ a, [Shaped(a[None])])
        assert flops == 2 * n**3
    assert cubic.coef is None and len(cubic.cache) == 18


def test_matmul_peak_is_a_plausible_rate():
    peak = matmul_peak("cpu", "fp32", seconds=0.05)
    assert 1e8 < peak < 1e13  # any CPU from a slow core to a big socket


def test_attention_backward_is_counted_on_the_cpu_too():
    """SDPA backward recomputes q k^T and takes four more (B, H, T, T) x d products: 5 x 2BHT^2d."""
    b, h, t, d = 2, 3, 9, 8
    q, k, v = (torch.randn(b, h, t, d, requires_grad=True) for _ in range(3))
    _, flops = StepFlops().run(
        lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=torch.zeros(t, t)).sum().backward(),
        [Shaped(q)])
    assert flops == 2 * 2 * b * h * t * t * d + 5 * 2 * b * h * t * t * d


def small_step():
    """(model, step, feats, tokens): one training step of a small AED with every kind of layer
    (convolutions, relative-position and cross attention, CTC head), run again by each step() call."""
    torch.manual_seed(0)
    model = AED(AEDConfig(n_mels=24, vocab_size=40, pad_id=1, enc_d_model=32, enc_layers=2, enc_heads=4,
                          subsampling_channels=8, dec_d_model=48, dec_layers=2, dec_heads=4, dec_max_len=64,
                          ctc_loss_weight=0.3))
    feats, feat_lens = torch.randn(3, 90, 24), torch.tensor([90, 71, 40])
    tokens, token_lens, prompt_lens = torch.randint(2, 40, (3, 12)), torch.tensor([12, 9, 7]), torch.tensor([4, 4, 4])

    def step():
        loss = model(feats, feat_lens, tokens, token_lens, prompt_lens)[0]
        loss.backward()

    return model, step, feats, tokens


def test_the_count_of_a_whole_model_step_is_torchs_own():
    """CountFlops leaves out FlopCounterMode's module tables and decompositions: on a training step of
    the AED (convolutions, relative-position and cross attention, CTC head) both give the same sum."""
    _, step, _, _ = small_step()

    with CountFlops() as ours:
        step()
    with FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION) as torchs:
        step()
    assert ours.flops == torchs.get_total_flops() > 0


def test_an_op_autograd_would_decompose_is_counted_where_autograd_is_off():
    linear = torch.nn.Linear(8, 4)
    with torch.inference_mode(), CountFlops() as counted:
        linear(torch.randn(3, 8))
    assert counted.flops == 2 * 3 * 8 * 4


def test_activation_checkpointing_recompute_is_left_out_of_model_flops():
    """The same step with every layer checkpointed runs more FLOPs (forward ops again in backward):
    CountFlops sets them apart, and StepFlops, which the progress line's FLOPs and MFU come from,
    counts the model's alone, equal to the step without checkpointing."""
    model, step, feats, tokens = small_step()

    counts = {}
    for checkpointed in (False, True):
        model.encoder.checkpoint_activations = model.decoder.checkpoint_activations = checkpointed
        with CountFlops() as counted:
            step()
        counts[checkpointed] = counted
    assert counts[False].recomputed == 0
    assert counts[True].flops > counts[False].flops * 1.2  # the layers' forward ran twice
    assert counts[True].flops - counts[True].recomputed == counts[False].flops
    batch = [type("Batch", (), {"feats": feats, "tokens": tokens})()]
    _, model_flops = StepFlops().run(step, batch)  # still checkpointed
    assert model_flops == counts[False].flops
