"""FastConformer encoder, laid out like NeMo's `ConformerEncoder` so Canary weights convert 1:1.

Submodule and parameter names equal NeMo's (`pre_encode.conv.0`, `layers.N.self_attn.linear_q`, ...):
a NeMo state_dict entry `encoder.X` is our `encoder.X`. NeMo's `pos_enc` holds no parameters; we
compute the relative position table on the fly instead.

Differences from NeMo that change outputs only for padded batches (never for an utterance alone):
padded time steps are zeroed before every subsampling conv, and the conv module's BatchNorm ignores
padded frames when computing batch statistics in training.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

SUBSAMPLING_FACTORS = (4, 8)  # stride-2 conv stages: 2 (40 ms per encoder frame at 10 ms hop) or 3 (Canary's 80 ms)
# Without autograd the subsampling takes the batch in groups of rows whose first conv output stays
# under this many elements (one 30 s row at Canary's 256 channels: 25 M): that output is the largest
# tensor of the whole encoder, 1.6 GB for 16 rows of 30 s. A CPU is fastest at one row at a time; a
# GPU needs a few rows per group to stay busy, and the groups still bound its peak memory (measured:
# docs/REPORT.md, "Memory per system, and the encoder's subsampling without autograd").
CPU_SUBSAMPLING_ELEMENTS = 2**25
GPU_SUBSAMPLING_ELEMENTS = 2**27


def conv_stage_length(lengths):
    """Output length of one kernel-3, stride-2, padding-1 conv: floor((L + 2*1 - 3) / 2 + 1).

    Works on ints and integer tensors (floor division), so masks, data filters and tests share it.
    """
    return (lengths + 2 * 1 - 3) // 2 + 1


def subsampling_stages(factor: int) -> int:
    """Stride-2 conv stages of a subsampling `factor` (one of SUBSAMPLING_FACTORS)."""
    if factor not in SUBSAMPLING_FACTORS:
        raise ValueError(f"subsampling factor must be one of {SUBSAMPLING_FACTORS}, got {factor}")
    return factor.bit_length() - 1


def subsampled_length(lengths, factor: int = 8):
    """Encoder output frames T' for T input frames (or F' for F mel bins): one conv stage per factor of 2."""
    for _ in range(subsampling_stages(factor)):
        lengths = conv_stage_length(lengths)
    return lengths


def padding_mask(lengths, max_len):
    """(B, max_len) bool, True at padded positions."""
    return torch.arange(max_len, device=lengths.device)[None, :] >= lengths[:, None]


class ConvSubsampling(nn.Module):
    """NeMo `ConvSubsampling(subsampling="dw_striding")`: (B, T, F) -> (B, T', D), `factor`x in time
    and frequency.

    `conv` keeps NeMo's nn.Sequential indices: 0 conv, 1 relu, then [2 depthwise, 3 pointwise, 4 relu]
    and, at factor 8, [5 depthwise, 6 pointwise, 7 relu].
    """

    def __init__(self, n_mels: int, channels: int, d_model: int, factor: int = 8):
        super().__init__()
        layers = [nn.Conv2d(1, channels, kernel_size=3, stride=2, padding=1), nn.ReLU()]
        for _ in range(subsampling_stages(factor) - 1):
            layers += [
                nn.Conv2d(channels, channels, kernel_size=3, stride=2, padding=1, groups=channels),
                nn.Conv2d(channels, channels, kernel_size=1),
                nn.ReLU(),
            ]
        self.conv = nn.Sequential(*layers)
        self.out = nn.Linear(channels * subsampled_length(n_mels, factor), d_model)

    def forward(self, x, x_lens):
        """x (B, T, F), x_lens (B,) -> (B, T', D), (B,). Without autograd (inference, validation) the
        rows go through in groups, each in place and, on the CPU, channels last, where oneDNN's
        convolutions run faster and need far less memory (docs/REPORT.md has the figures). Traced for torch.compile or torch.export, the plain path: the
        groups would fix the batch size and length, and a compiler plans layouts and memory itself."""
        if torch.is_grad_enabled() or torch.compiler.is_compiling():
            return self._subsample(x, x_lens, inference=False)
        per_row = self.conv[0].out_channels * conv_stage_length(x.size(1)) * conv_stage_length(x.size(2))
        budget = CPU_SUBSAMPLING_ELEMENTS if x.device.type == "cpu" else GPU_SUBSAMPLING_ELEMENTS
        rows = max(1, budget // per_row)
        if rows >= len(x):
            return self._subsample(x, x_lens, inference=True)
        parts = [self._subsample(x[i : i + rows], x_lens[i : i + rows], inference=True) for i in range(0, len(x), rows)]
        return torch.cat([y for y, _ in parts]), torch.cat([y_lens for _, y_lens in parts])

    def _subsample(self, x, x_lens, inference: bool):
        x = x.unsqueeze(1)  # (B, 1, T, F): time and mel bins are the conv's two spatial axes
        channels_last = inference and x.device.type == "cpu"
        if channels_last:  # to(), not contiguous(): with one channel both layouts hold, and only to() restrides
            x = x.to(memory_format=torch.channels_last)
        for i, layer in enumerate(self.conv):
            if isinstance(layer, nn.Conv2d) and layer.stride[0] == 2:
                # Zero padded frames so the 3-wide kernel sees zeros past the end, exactly as it
                # does for an utterance alone (1x1 convs and ReLUs never mix frames). In place
                # except on the first layer's input, the caller's features.
                pad = padding_mask(x_lens, x.size(2))[:, None, :, None]
                x = x.masked_fill_(pad, 0.0) if inference and i > 0 else x.masked_fill(pad, 0.0)
                x_lens = conv_stage_length(x_lens)
            if isinstance(layer, nn.ReLU) and inference:
                x = x.relu_()
            elif channels_last:  # the weights channels last too, or oneDNN falls back to the slow layout
                weight = layer.weight.to(memory_format=torch.channels_last)
                x = F.conv2d(x, weight, layer.bias, layer.stride, layer.padding, groups=layer.groups)
            else:
                x = layer(x)
        b, c, t, f = x.shape
        x = self.out(x.transpose(1, 2).reshape(b, t, c * f))  # (B, C, T', F') -> (B, T', C*F') -> (B, T', D)
        return x, x_lens


def rel_positional_encoding(length: int, d_model: int, device, dtype):
    """Sinusoidal table for relative positions length-1, ..., 0, ..., -(length-1): (2T'-1, D).

    NeMo's `RelPositionalEncoding`: even channels sin(pos * w_i), odd channels cos(pos * w_i),
    w_i = 10000^(-2i/D); no sqrt(D) scaling of the input (xscaling: false in Canary).
    """
    positions = torch.arange(length - 1, -length, -1, device=device, dtype=torch.float32)
    freqs = torch.exp(torch.arange(0, d_model, 2, device=device, dtype=torch.float32) * (-math.log(10000.0) / d_model))
    angles = positions[:, None] * freqs[None, :]  # (2T'-1, D/2)
    pe = torch.stack([angles.sin(), angles.cos()], dim=-1).flatten(1)  # interleave: (2T'-1, D)
    return pe.to(dtype)


def rel_shift(x):
    """Turn scores against absolute table rows into scores against relative distance.

    x: (B, H, T', 2T'-1), column m = relative position T'-1-m. Returns (B, H, T', T') with
    out[i, j] = x[i, j + T'-1 - i], i.e. the score for distance i - j: the values Transformer-XL's
    pad-and-reshape picks. Element (i, j) sits at offset i (2T'-1) + j + T'-1 - i of row-major x, so
    the result is a strided view: no copy, nothing saved for backward (a gather would keep all of x
    alive per layer: +4 GiB in a 40 s Canary-1B batch), and shapes that torch.export can trace for
    a dynamic T' (the reshape's split of (2T'-1) x T' as T' x (2T'-1) is a guard it cannot prove).
    """
    b, h, t, p = x.shape
    x = x.contiguous()
    # torch.compile cannot trace storage_offset(); there x is the graph's own fresh product, at offset 0.
    offset = 0 if torch.compiler.is_dynamo_compiling() else x.storage_offset()
    return x.as_strided((b, h, t, t), (h * t * p, t * p, p - 1, 1), offset + t - 1)


class RelPositionMultiHeadAttention(nn.Module):
    """Transformer-XL attention: scores = ((q+u) k^T + rel_shift((q+v) p^T)) / sqrt(d_k)."""

    def __init__(self, d_model: int, n_heads: int, dropout_att: float):
        super().__init__()
        assert d_model % n_heads == 0, f"d_model {d_model} not divisible by n_heads {n_heads}"
        self.h, self.d_k = n_heads, d_model // n_heads
        self.linear_q = nn.Linear(d_model, d_model)
        self.linear_k = nn.Linear(d_model, d_model)
        self.linear_v = nn.Linear(d_model, d_model)
        self.linear_out = nn.Linear(d_model, d_model)
        self.linear_pos = nn.Linear(d_model, d_model, bias=False)
        # Per-layer biases (Canary: untie_biases: true); zero init as in NeMo.
        self.pos_bias_u = nn.Parameter(torch.zeros(n_heads, self.d_k))
        self.pos_bias_v = nn.Parameter(torch.zeros(n_heads, self.d_k))
        self.dropout_att = dropout_att

    def _heads(self, x):
        return x.view(x.size(0), -1, self.h, self.d_k).transpose(1, 2)  # (B, T', D) -> (B, H, T', d_k)

    def forward(self, x, pos_emb, pad_mask):
        """x (B, T', D), pos_emb (2T'-1, D), pad_mask (B, T') True at padding -> (B, T', D)."""
        q = self._heads(self.linear_q(x))
        k = self._heads(self.linear_k(x))
        v = self._heads(self.linear_v(x))
        p = self.linear_pos(pos_emb).view(-1, self.h, self.d_k).transpose(0, 1)  # (H, 2T'-1, d_k)
        # The position term enters SDPA as an additive bias; SDPA applies the 1/sqrt(d_k) to the content term.
        bias = rel_shift((q + self.pos_bias_v[:, None, :]) @ p.transpose(1, 2)) / math.sqrt(self.d_k)
        bias = bias.masked_fill(pad_mask[:, None, None, :], float("-inf"))  # padded keys get no weight
        out = F.scaled_dot_product_attention(
            q + self.pos_bias_u[:, None, :], k, v, attn_mask=bias, dropout_p=self.dropout_att if self.training else 0.0
        )
        return self.linear_out(out.transpose(1, 2).reshape(x.shape))  # (B, H, T', d_k) -> (B, T', D)


class ConformerFeedForward(nn.Module):
    def __init__(self, d_model: int, d_ff: int, dropout: float):
        super().__init__()
        self.linear1 = nn.Linear(d_model, d_ff)
        self.dropout = nn.Dropout(dropout)
        self.linear2 = nn.Linear(d_ff, d_model)

    def forward(self, x):
        return self.linear2(self.dropout(F.silu(self.linear1(x))))


class MaskedBatchNorm1d(nn.Module):
    """BatchNorm1d over (B, C, T) whose batch statistics ignore padded frames.

    Same parameters and buffers as nn.BatchNorm1d (NeMo checkpoints load as is). Deliberately not a
    _BatchNorm subclass: `convert_sync_batchnorm` would silently swap it for an unmasked SyncBatchNorm.
    Statistics are per rank, as with a plain BatchNorm under DDP.
    """

    def __init__(self, channels: int, eps: float = 1e-5, momentum: float = 0.1):
        super().__init__()
        self.eps, self.momentum = eps, momentum
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels))
        self.register_buffer("running_mean", torch.zeros(channels))
        self.register_buffer("running_var", torch.ones(channels))
        self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long))

    def forward(self, x, pad_mask):
        """x (B, C, T), pad_mask (B, T) True at padding."""
        if not self.training:
            return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps)
        xf = x.float()  # statistics in fp32 even under bf16 autocast
        valid = (~pad_mask)[:, None, :].float()  # (B, 1, T)
        n = valid.sum()
        mean = (xf * valid).sum(dim=(0, 2)) / n  # (C,)
        var = (((xf - mean[None, :, None]) * valid) ** 2).sum(dim=(0, 2)) / n  # biased, for normalising
        with torch.no_grad():
            unbiased = var * (n / (n - 1).clamp(min=1))  # running_var is unbiased, as in nn.BatchNorm1d
            self.running_mean.lerp_(mean, self.momentum)
            self.running_var.lerp_(unbiased, self.momentum)
            self.num_batches_tracked += 1
        xf = (xf - mean[None, :, None]) * torch.rsqrt(var[None, :, None] + self.eps)
        return (xf * self.weight[None, :, None] + self.bias[None, :, None]).to(x.dtype)


def depthwise_by_shifts(x, conv: nn.Conv1d):
    """`conv` (depthwise, odd kernel k, same padding) of x (B, D, T) as a sum of k shifted copies of x
    scaled per channel: what torch.compile (train.compile) runs. Inductor's lowering of a
    convolution's backward fixes the sequence length (torch 2.14: a recompile per batch shape);
    these elementwise products fuse into one kernel and stay dynamic."""
    k, t = conv.kernel_size[0], x.size(2)
    padded = F.pad(x, (k // 2, k // 2))  # (B, D, T + k - 1)
    w = conv.weight[:, 0, :, None]  # (D, 1, k) -> (D, k, 1)
    out = conv.bias[:, None] + padded[:, :, :t] * w[:, 0]
    for i in range(1, k):
        out = out + padded[:, :, i:i + t] * w[:, i]
    return out


class ConformerConvolution(nn.Module):
    """Pointwise conv + GLU, depthwise conv (same padding), norm, Swish, pointwise conv: (B, T', D) -> same."""

    def __init__(self, d_model: int, kernel_size: int, norm_type: str):
        super().__init__()
        assert kernel_size % 2 == 1, f"conv kernel size must be odd for same padding, got {kernel_size}"
        self.pointwise_conv1 = nn.Conv1d(d_model, 2 * d_model, kernel_size=1)
        self.depthwise_conv = nn.Conv1d(d_model, d_model, kernel_size, padding=kernel_size // 2, groups=d_model)
        # NeMo calls the norm `batch_norm` whatever its type; we keep the name so checkpoints map 1:1.
        if norm_type == "batch_norm":
            self.batch_norm = MaskedBatchNorm1d(d_model)
        elif norm_type == "layer_norm":
            self.batch_norm = nn.LayerNorm(d_model)
        else:
            raise ValueError(f"conv_norm_type must be batch_norm or layer_norm, got {norm_type!r}")
        self.pointwise_conv2 = nn.Conv1d(d_model, d_model, kernel_size=1)

    def forward(self, x, pad_mask):
        # The 1x1 convolutions run as matrix products over the (B, T', D) rows, on weights kept in NeMo's
        # (out, in, 1) Conv1d shape (checkpoints map 1:1): the GEMM library's kernels instead of the
        # convolution library's, no transposes around them, and no convolution in a compiled block, where
        # one turns on inductor's layout optimisation and fixes the sequence length (docs/REPORT.md,
        # "Training step speed"). SiLU runs before the transpose back: on the transposed view
        # torch.export guards T' != 1.
        w1, w2 = self.pointwise_conv1, self.pointwise_conv2
        x = F.glu(F.linear(x, w1.weight[..., 0], w1.bias), dim=-1)  # (B, T', D) -> (B, T', 2D) -> (B, T', D)
        x = x.masked_fill(pad_mask[:, :, None], 0.0)  # padded frames must not reach valid ones through the kernel
        x = x.transpose(1, 2)  # (B, D, T'): the depthwise kernel runs along time
        x = depthwise_by_shifts(x, self.depthwise_conv) if torch.compiler.is_dynamo_compiling() else self.depthwise_conv(x)
        if isinstance(self.batch_norm, nn.LayerNorm):
            x = F.silu(self.batch_norm(x.transpose(1, 2)))  # normalise over D: (B, T', D)
        else:
            x = F.silu(self.batch_norm(x, pad_mask)).transpose(1, 2)  # (B, D, T') -> (B, T', D)
        return F.linear(x, w2.weight[..., 0], w2.bias)


class ConformerLayer(nn.Module):
    """Macaron pre-norm block: half FF, self-attention, conv, half FF, final LayerNorm."""

    def __init__(self, d_model, n_heads, ff_mult, conv_kernel, conv_norm, dropout, dropout_att):
        super().__init__()
        self.norm_feed_forward1 = nn.LayerNorm(d_model)
        self.feed_forward1 = ConformerFeedForward(d_model, ff_mult * d_model, dropout)
        self.norm_self_att = nn.LayerNorm(d_model)
        self.self_attn = RelPositionMultiHeadAttention(d_model, n_heads, dropout_att)
        self.norm_conv = nn.LayerNorm(d_model)
        self.conv = ConformerConvolution(d_model, conv_kernel, conv_norm)
        self.norm_feed_forward2 = nn.LayerNorm(d_model)
        self.feed_forward2 = ConformerFeedForward(d_model, ff_mult * d_model, dropout)
        self.dropout = nn.Dropout(dropout)
        self.norm_out = nn.LayerNorm(d_model)

    def forward(self, x, pos_emb, pad_mask):
        x = x + 0.5 * self.dropout(self.feed_forward1(self.norm_feed_forward1(x)))
        x = x + self.dropout(self.self_attn(self.norm_self_att(x), pos_emb, pad_mask))
        x = x + self.dropout(self.conv(self.norm_conv(x), pad_mask))
        x = x + 0.5 * self.dropout(self.feed_forward2(self.norm_feed_forward2(x)))
        return self.norm_out(x)


class ConformerEncoder(nn.Module):
    def __init__(self, n_mels, d_model, n_layers, n_heads, ff_mult, conv_kernel, conv_norm,
                 subsampling_channels, dropout, dropout_pre_encoder, dropout_att, xscaling=False,
                 subsampling_factor=8):
        super().__init__()
        self.n_mels, self.d_model = n_mels, d_model
        # NeMo's xscaling: the subsampled input is multiplied by sqrt(d_model) before the layers.
        self.xscale = math.sqrt(d_model) if xscaling else 1.0
        self.pre_encode = ConvSubsampling(n_mels, subsampling_channels, d_model, subsampling_factor)
        self.pre_dropout = nn.Dropout(dropout_pre_encoder)  # NeMo: pos_enc.dropout
        self.layers = nn.ModuleList(
            ConformerLayer(d_model, n_heads, ff_mult, conv_kernel, conv_norm, dropout, dropout_att)
            for _ in range(n_layers)
        )
        # Set by train.py (activation_checkpointing): recompute each layer in backward instead of storing
        # its activations. The recomputation updates BatchNorm running statistics a second time with the
        # same batch statistics.
        self.checkpoint_activations = False

    def forward(self, x, x_lens):
        """x (B, T, F) log-mel features (padded frames may hold anything), x_lens (B,) -> (B, T', D), (B,)."""
        assert x.dim() == 3 and x.size(2) == self.n_mels, f"expected feats (B, T, {self.n_mels}), got {tuple(x.shape)}"
        assert x_lens.shape == (x.size(0),), f"feat_lens {tuple(x_lens.shape)} does not match batch {x.size(0)}"
        x, x_lens = self.pre_encode(x, x_lens)
        pad_mask = padding_mask(x_lens, x.size(1))
        pos_emb = rel_positional_encoding(x.size(1), self.d_model, x.device, x.dtype)
        x = self.pre_dropout(x * self.xscale)
        recompute = self.checkpoint_activations and self.training and torch.is_grad_enabled()
        for layer in self.layers:
            if recompute:
                x = checkpoint(layer, x, pos_emb, pad_mask, use_reentrant=False)
            else:
                x = layer(x, pos_emb, pad_mask)
        return x, x_lens
