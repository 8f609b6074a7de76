"""BEST-RQ self-supervised pretraining of the FastConformer encoder (`objective=ssl` in train.py).

Chiu et al. 2022, "Self-supervised learning with random-projection quantizer for speech
recognition" (BEST-RQ), as NeMo's NEST recipe runs it on a FastConformer:

    feats (B, T, F) -> stack 8 frames -> frozen random projection -> nearest of a frozen random
        codebook = targets (B, K, T')            (one target per encoder frame and codebook)
    feats -> spans of frames replaced by noise -> encoder -> (B, T', D) -> K linear heads
        -> cross-entropy at the masked encoder frames

Nothing but the encoder and the heads learns: the quantizer is a fixed random function of the
features, so targets need no teacher model and no clustering. The stack is the encoder's
subsampling factor, so one target lines up with one encoder frame. The encoder keeps the AED's
parameter names (`encoder.*`): `init_from` loads a pretrained encoder into an AED or a
transducer and drops the heads (aed/train_checkpoint.py).

Loss normalisation. train.py divides each micro-batch's summed loss by a target count it knows
on the host before the step. The masks are drawn inside `forward` (from torch's global RNG, whose
state checkpoints keep, so a resumed run draws the same ones), so their number is not known then.
So the count is the batch's valid encoder frames, and `forward` returns its mean cross-entropy
over masked frames times that count: a step's loss is the frame-weighted mean of its
micro-batches' masked-frame means.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from aed.model import build_encoder
from aed.model_encoder import subsampled_length

MASK_THRESHOLD = 0.8  # an encoder frame is a target when >= 80% of its stacked frames are masked (NeMo's MultiMLMLoss)


@dataclass
class SSLConfig:
    mask_prob: float = 0.01  # probability that a feature frame starts a masked span (BEST-RQ, NeMo NEST: 0.01)
    mask_span: int = 40  # frames per masked span: 400 ms at a 10 ms hop (BEST-RQ, NeMo NEST: 40)
    noise_std: float = 0.1  # masked frames are replaced by N(0, noise_std^2) noise (BEST-RQ: 0.1)
    codebooks: int = 1  # independent quantizers, one head and one target each (BEST-RQ, NeMo NEST: 1)
    codebook_size: int = 8192  # codewords per codebook = classes of each head (BEST-RQ, NeMo NEST: 8192)
    codebook_dim: int = 16  # width of the random projection and the codewords (BEST-RQ, NeMo NEST: 16)

    def __post_init__(self):
        assert 0 < self.mask_prob <= 1, f"mask_prob must be in (0, 1], got {self.mask_prob}"
        assert self.mask_span >= 1, f"mask_span must be >= 1, got {self.mask_span}"
        assert self.codebooks >= 1 and self.codebook_size >= 2 and self.codebook_dim >= 1, (
            f"need codebooks >= 1, codebook_size >= 2, codebook_dim >= 1, got {self.codebooks}, "
            f"{self.codebook_size}, {self.codebook_dim}")


def stack_frames(feats, factor: int):
    """(B, T, F) -> (B, T', factor * F): encoder frame t' gets feature frames factor*t' .. factor*t'+factor-1,
    zero padded past T (features are zero past an utterance's end anyway), T' = subsampled_length(T, factor)."""
    b, t, f = feats.shape
    groups = subsampled_length(t, factor)
    x = F.pad(feats, (0, 0, 0, groups * factor - t))  # (B, T'*factor, F)
    return x.reshape(b, groups, factor * f)  # (B, T'*factor, F) -> (B, T', factor*F)


class RandomProjectionQuantizer(nn.Module):
    """Frozen random projection + random codebooks: stacked features -> codeword ids.

    Drawn from `seed` alone (not the global RNG), so every rank and every resumed run quantises
    alike; kept as buffers, so checkpoints carry them. Projection: Xavier-normal; codewords:
    standard normal, l2-normalised, and the projected vector too, so the nearest codeword is the
    one of largest cosine (BEST-RQ)."""

    def __init__(self, n_mels: int, factor: int, codebook_dim: int, codebook_size: int, codebooks: int, seed: int):
        """Quantises `factor` stacked frames of `n_mels` bins: one target per encoder frame."""
        super().__init__()
        self.factor = factor
        in_dim = factor * n_mels
        g = torch.Generator().manual_seed(seed)
        std = math.sqrt(2.0 / (in_dim + codebook_dim))
        self.register_buffer("projection", torch.randn(codebooks, in_dim, codebook_dim, generator=g) * std)
        codes = torch.randn(codebooks, codebook_size, codebook_dim, generator=g)
        self.register_buffer("codebook", F.normalize(codes, dim=-1))

    @torch.no_grad()
    def forward(self, feats):
        """feats (B, T, F) -> targets (B, K, T') long, K codebooks."""
        with torch.autocast(feats.device.type, enabled=False):  # targets must not depend on the precision
            x = stack_frames(feats.float(), self.factor)  # (B, T', factor*F)
            z = F.normalize(torch.einsum("btd,kde->bkte", x, self.projection), dim=-1)  # (B, K, T', E)
            return torch.einsum("bkte,kce->bktc", z, self.codebook).argmax(-1)  # (B, K, T', C) -> (B, K, T')


def span_mask(lengths, max_len: int, prob: float, span: int, generator=None):
    """(B,) lengths -> (B, max_len) bool, True on masked frames; never at or past a row's length.

    Each frame starts a span with probability `prob` (BEST-RQ); spans are min(span, length) frames
    and lie inside the utterance, and may overlap. A row that draws no start gets one at a uniform
    position, so every utterance has targets (at prob 0.01, a 1 s utterance has 61 possible
    starts and draws none 54% of the time)."""
    device = lengths.device
    b = lengths.shape[0]
    width = lengths.clamp(max=span)  # (B,)
    starts_allowed = (lengths - width + 1).clamp(min=1)  # (B,) start positions keeping the span inside
    pos = torch.arange(max_len, device=device)
    rng_device = generator.device if generator is not None else device
    u = torch.rand(b, max_len, generator=generator, device=rng_device).to(device)
    starts = (u < prob) & (pos[None, :] < starts_allowed[:, None])  # (B, T)
    forced = (torch.rand(b, generator=generator, device=rng_device).to(device) * starts_allowed).long()
    starts |= ~starts.any(1, keepdim=True) & (pos[None, :] == forced[:, None])
    # Frame t is masked iff a span starts in (t - width, t]: a difference of running start counts.
    count = starts.long().cumsum(1)  # (B, T)
    before = pos[None, :] - width[:, None]  # (B, T)
    prev = torch.where(before >= 0, count.gather(1, before.clamp(min=0)), 0)
    return (count - prev > 0) & (pos[None, :] < lengths[:, None])


def target_mask(frame_mask, lengths, factor: int):
    """Encoder frames that are targets: (B, T) masked feature frames, (B,) lengths -> (B, T'), `factor`
    feature frames per encoder frame. A frame is a target when at least MASK_THRESHOLD of its
    stacked valid feature frames are masked."""
    masked = stack_frames(frame_mask[:, :, None].float(), factor).sum(-1)  # (B, T')
    first = torch.arange(masked.shape[1], device=lengths.device)[None, :] * factor  # (1, T')
    valid = (lengths[:, None] - first).clamp(0, factor)  # (B, T') valid feature frames per encoder frame
    return (valid > 0) & (masked >= MASK_THRESHOLD * valid)


class BestRQ(nn.Module):
    """The AED's encoder under BEST-RQ's heads. Takes the AED's batch and ignores its tokens, so
    audio-only manifests train it."""

    def __init__(self, cfg, ssl: SSLConfig, seed: int = 0):
        """cfg: the AEDConfig whose encoder fields build the encoder (the decoder fields go unused)."""
        super().__init__()
        self.cfg, self.ssl = cfg, ssl
        self.encoder = build_encoder(cfg)
        self.quantizer = RandomProjectionQuantizer(cfg.n_mels, cfg.subsampling_factor, ssl.codebook_dim,
                                                   ssl.codebook_size, ssl.codebooks, seed)
        self.heads = nn.ModuleList(nn.Linear(cfg.enc_d_model, ssl.codebook_size) for _ in range(ssl.codebooks))

    def count_targets(self, batch):
        """Per-row valid encoder frames: the count train.py normalises by (module docstring)."""
        return subsampled_length(batch.feat_lens, self.cfg.subsampling_factor)

    def forward(self, feats, feat_lens, tokens=None, token_lens=None, prompt_lens=None, transcribed=None):
        """feats (B, T, F), feat_lens (B,) -> (masked-frame mean cross-entropy x valid encoder frames,
        valid encoder frames). The cross-entropy is averaged over the codebooks."""
        targets = self.quantizer(feats)  # (B, K, T') from the clean features
        frame_mask = span_mask(feat_lens, feats.shape[1], self.ssl.mask_prob, self.ssl.mask_span)  # (B, T)
        noise = self.ssl.noise_std * torch.randn_like(feats)
        enc, enc_lens = self.encoder(torch.where(frame_mask[:, :, None], noise, feats), feat_lens)  # (B, T', D)
        is_target = target_mask(frame_mask, feat_lens, self.cfg.subsampling_factor)  # (B, T')
        hidden = enc[is_target]  # (N, D)
        loss = sum(F.cross_entropy(head(hidden).float(), targets[:, k][is_target], reduction="sum")
                   for k, head in enumerate(self.heads)) / len(self.heads)
        frames = enc_lens.sum()
        return loss / is_target.sum().clamp(min=1) * frames, frames
