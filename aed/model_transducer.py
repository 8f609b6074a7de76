"""Transducer (RNN-T) head: predictor, joint network, loss and greedy decoding.

Canary's encoder is initialised from an encoder pretrained with this loss (Zelasko et al. 2025, sec. 3).
The joint output is a (B, T', U+1, V) tensor that dwarfs everything else in memory, so the loss can be
computed sample-wise (Braun, McDermott and Hsiao 2022, arXiv 2211.16270): the joint, the loss and its
gradient are computed for one chunk of samples at a time, and only the gradients with respect to the
small joint inputs (B, T', H) and (B, U+1, H) are kept. The caller still writes a single
`loss_sum.backward()`: `_SamplewiseJointLoss` computes the gradients inside its forward and hands them
back from its backward, scaled by the incoming gradient.

Blank is the LAST id (vocab_size - 1): tokenizer ids pass through unchanged and the joint gets one extra
output, NeMo's convention. The CTC head (aed/model.py) uses the same blank id.

`TransducerASR` at the bottom is the encoder-pretraining model (`objective=rnnt` in train.py): the AED's
FastConformer encoder under this head, with the AED's parameter names (`encoder.*`), so
`train.py init_from=rnnt_ckpt.pt init_encoder_only=true` loads its encoder into an AED model.
"""
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from aed.model import AEDConfig, build_encoder, text_targets


@dataclass
class TransducerConfig:
    vocab_size: int  # tokenizer vocab + 1: blank is appended as id vocab_size - 1
    enc_dim: int = 512  # width of the encoder output the joint consumes
    pred_dim: int = 640  # predictor width; 640 in NeMo's FastConformer transducers
    joint_dim: int = 640  # joint hidden width H; sets the size of the (B, T', U+1, H) activation
    predictor: str = "lstm"  # "lstm" (one layer) or "stateless" (last `context` tokens, Ghodsi et al. 2020)
    context: int = 2  # stateless predictor: how many previous tokens it sees
    dropout: float = 0.1  # predictor only: a joint dropout mask would be (B, T', U+1, H) and break sample-wise == batched


# --- the loss -----------------------------------------------------------------------------------------

class _LogProbs(torch.autograd.Function):
    """log p(blank) and log p(next target) at every lattice node, from raw logits.

    A fused log-softmax: the (B, T', U+1, V) log-softmax is never stored, and backward allocates one
    tensor of that size (autograd through logsumexp + gather + select would allocate three).
    """

    @staticmethod
    def forward(ctx, logits, targets, blank):
        B, T, U1, V = logits.shape
        lse = logits.logsumexp(-1)  # (B, T', U+1)
        idx = targets[:, None, :, None].expand(B, T, U1 - 1, 1)
        blank_lp = logits[..., blank] - lse  # (B, T', U+1)
        emit_lp = logits[:, :, :-1].gather(-1, idx).squeeze(-1) - lse[:, :, :-1]  # (B, T', U)
        ctx.save_for_backward(logits, lse, idx)
        ctx.blank = blank
        return blank_lp, emit_lp

    @staticmethod
    def backward(ctx, g_blank, g_emit):
        logits, lse, idx = ctx.saved_tensors
        # d log p_k / d z_v = 1[v = k] - softmax_v
        grad = (logits - lse.unsqueeze(-1)).exp_()  # softmax, (B, T', U+1, V)
        grad.mul_(-(g_blank + F.pad(g_emit, (0, 1))).unsqueeze(-1))
        grad[..., ctx.blank] += g_blank
        grad[:, :, :-1].scatter_add_(-1, idx, g_emit.unsqueeze(-1))
        return grad, None, None


def rnnt_nll(logits, targets, logit_lens, target_lens, blank):
    """Per-sample transducer negative log-likelihood (Graves 2012), differentiable w.r.t. logits.

    logits (B, T', U+1, V) raw joint outputs; targets (B, U) with valid ids < V; returns (B,).
    Pure PyTorch so it runs in fp64 (torchaudio's rnnt_loss takes fp32/fp16 only), which the
    exactness tests need; the tests check it against torchaudio in fp32.
    """
    if logits.dtype != torch.float64:
        logits = logits.float()  # bf16 log-probs summed over hundreds of nodes lose too much
    blank_lp, emit_lp = _LogProbs.apply(logits, targets, blank)
    # alpha[t, u] = log p(first u tokens emitted, now at frame t). Reaching (t, u) means emitting token
    # u at some frame k <= t, then blanks at row u for frames k..t-1. With blank_cum[t] = sum of blank
    # log-probs over frames < t, that is one logcumsumexp over t per row u, so the Python loop runs over
    # U+1 (short) rather than T' + U diagonals. In fp32 the subtraction costs ~|blank_cum| * 6e-8,
    # 2e-4 nats at 3500 (500 frames of an untrained model); torchaudio's fp32 kernel errs more there.
    B, T, U1 = blank_lp.shape
    blank_cum = F.pad(blank_lp[:, :-1].cumsum(1), (0, 0, 1, 0))  # (B, T', U+1)
    alpha = blank_cum[:, :, 0]  # (B, T'): row 0 is blanks only
    alphas = [alpha]
    for u in range(1, U1):
        arrive = alpha + emit_lp[:, :, u - 1]  # (B, T'): emit token u at frame k
        alpha = blank_cum[:, :, u] + torch.logcumsumexp(arrive - blank_cum[:, :, u], dim=1)
        alphas.append(alpha)
    alpha = torch.stack(alphas, -1)  # (B, T', U+1)
    b, t = torch.arange(B, device=logits.device), logit_lens - 1
    return -(alpha[b, t, target_lens] + blank_lp[b, t, target_lens])  # the final blank ends the utterance


def _joint(enc_h, pred_h, weight, bias):
    """(B, T', H) x (B, U+1, H) -> (B, T', U+1, V); weight/bias are the output layer's, passed in so
    the sample-wise path can use detached copies."""
    return F.linear(torch.tanh(enc_h.unsqueeze(2) + pred_h.unsqueeze(1)), weight, bias)


def _chunks(enc_lens, target_lens, chunk_size):
    """[(sample indices, their max T', their max U)] with `chunk_size` samples each, grouped by
    lattice size so a chunk pads little. One host transfer for the whole batch."""
    T, U = enc_lens.tolist(), target_lens.tolist()
    order = sorted(range(len(T)), key=lambda b: T[b] * (U[b] + 1), reverse=True)
    chunks = [order[i:i + chunk_size] for i in range(0, len(order), chunk_size)]
    return [(idx, max(T[b] for b in idx), max(U[b] for b in idx)) for idx in chunks]


def _trim(enc_h, pred_h, targets, enc_lens, target_lens, chunk):
    """The chunk's samples cut to its longest: (k, T', H), (k, U+1, H), (k, U), (k,), (k,)."""
    idx, T, U = chunk
    return enc_h[idx, :T], pred_h[idx, :U + 1], targets[idx, :U], enc_lens[idx], target_lens[idx]


class _SamplewiseJointLoss(torch.autograd.Function):
    """Sum of the transducer loss over the batch, one chunk at a time; grads computed in forward.

    Each chunk's joint tensor is freed before the next one is built, so peak memory is one chunk's
    joint instead of the batch's. Gradients w.r.t. the joint inputs and the output layer are
    accumulated here; backward scales them by the incoming gradient, and autograd carries them on
    through the projections, predictor and encoder in one ordinary backward pass.
    """

    @staticmethod
    def forward(ctx, enc_h, pred_h, weight, bias, targets, enc_lens, target_lens, chunk_size, blank):
        grads = [torch.zeros_like(x) for x in (enc_h, pred_h, weight, bias)]
        # Detached copies: the graph built per chunk must end here, not reach the real parameters.
        w, b = weight.detach().requires_grad_(), bias.detach().requires_grad_()
        losses = []
        for chunk in _chunks(enc_lens, target_lens, chunk_size):
            e, p, y, e_lens, y_lens = _trim(enc_h, pred_h, targets, enc_lens, target_lens, chunk)
            idx = chunk[0]
            with torch.enable_grad():
                e, p = e.detach().requires_grad_(), p.detach().requires_grad_()
                nll = rnnt_nll(_joint(e, p, w, b), y, e_lens, y_lens, blank).sum()
                g_e, g_p, g_w, g_b = torch.autograd.grad(nll, (e, p, w, b))
            # Chunks are disjoint, so assignment (not +=) is exact for the per-sample inputs.
            grads[0][idx, :e.shape[1]] = g_e
            grads[1][idx, :p.shape[1]] = g_p
            grads[2] += g_w
            grads[3] += g_b
            losses.append(nll.detach())
        ctx.save_for_backward(*grads)
        return torch.stack(losses).sum()

    @staticmethod
    def backward(ctx, g):
        g_e, g_p, g_w, g_b = (g * x for x in ctx.saved_tensors)
        return g_e, g_p, g_w, g_b, None, None, None, None, None


# --- predictors -----------------------------------------------------------------------------------------
# Both expose forward(y) -> (B, U+1, pred_dim) over [blank] + y for training, and
# init_state(B) / step(token, state) -> (out (B, pred_dim), state) for decoding. States are tuples of
# tensors with batch first, so decoding can keep or replace rows with one torch.where.

class LSTMPredictor(nn.Module):
    def __init__(self, cfg: TransducerConfig):
        super().__init__()
        self.blank = cfg.vocab_size - 1
        self.embed = nn.Embedding(cfg.vocab_size, cfg.pred_dim)
        self.lstm = nn.LSTM(cfg.pred_dim, cfg.pred_dim, batch_first=True)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, y):
        y = F.pad(y, (1, 0), value=self.blank)  # (B, U+1): blank doubles as start-of-sequence
        out, _ = self.lstm(self.dropout(self.embed(y)))
        return self.dropout(out)

    def init_state(self, batch_size):
        h = self.embed.weight.new_zeros(batch_size, self.lstm.hidden_size)  # model's device and dtype
        return h, h.clone()

    def step(self, token, state):
        h, c = state  # (B, pred_dim) each
        out, (h, c) = self.lstm(self.embed(token).unsqueeze(1), (h.unsqueeze(0), c.unsqueeze(0)))
        return out.squeeze(1), (h.squeeze(0), c.squeeze(0))


class StatelessPredictor(nn.Module):
    """Sees only the last `context` tokens (Ghodsi et al. 2020): no recurrence, and nearly as good."""

    def __init__(self, cfg: TransducerConfig):
        super().__init__()
        self.blank, self.context = cfg.vocab_size - 1, cfg.context
        self.embed = nn.Embedding(cfg.vocab_size, cfg.pred_dim)
        self.mix = nn.Linear(cfg.context * cfg.pred_dim, cfg.pred_dim)
        self.dropout = nn.Dropout(cfg.dropout)

    def _window(self, tokens):
        """(B, N, context) token windows -> (B, N, pred_dim)."""
        x = self.dropout(self.embed(tokens)).flatten(2)  # (B, N, context * pred_dim)
        return self.dropout(torch.relu(self.mix(x)))

    def forward(self, y):
        y = F.pad(y, (self.context, 0), value=self.blank)  # (B, U+context); blanks before the start
        return self._window(y.unfold(1, self.context, 1))  # windows (B, U+1, context)

    def init_state(self, batch_size):
        # One step consumes a token, so the first step (fed blank) sees context-many blanks.
        return (torch.full((batch_size, self.context), self.blank, device=self.embed.weight.device),)

    def step(self, token, state):
        window = torch.cat([state[0][:, 1:], token.unsqueeze(1)], 1)  # (B, context)
        return self._window(window.unsqueeze(1)).squeeze(1), (window,)


# --- the transducer -------------------------------------------------------------------------------------

class Transducer(nn.Module):
    """Predictor + joint over encoder outputs (B, T', enc_dim) with lengths enc_lens (B,)."""

    def __init__(self, cfg: TransducerConfig):
        super().__init__()
        if cfg.predictor not in ("lstm", "stateless"):
            raise ValueError(f"TransducerConfig.predictor must be 'lstm' or 'stateless', got {cfg.predictor!r}")
        self.cfg, self.blank = cfg, cfg.vocab_size - 1
        self.predictor = LSTMPredictor(cfg) if cfg.predictor == "lstm" else StatelessPredictor(cfg)
        self.enc_proj = nn.Linear(cfg.enc_dim, cfg.joint_dim)
        self.pred_proj = nn.Linear(cfg.pred_dim, cfg.joint_dim)
        self.out = nn.Linear(cfg.joint_dim, cfg.vocab_size)

    def loss(self, enc, enc_lens, targets, target_lens, mode="samplewise", chunk_size=1):
        """Summed transducer loss and the number of target tokens it covers (the caller normalises).

        enc (B, T', enc_dim), enc_lens (B,), targets (B, U) padded with anything, target_lens (B,).
        mode "batched" builds the whole (B, T', U+1, V) joint; "samplewise" builds `chunk_size`
        samples' joint at a time (same value and gradients, far less memory). Either way the caller
        runs `loss_sum.backward()` once.
        """
        if mode not in ("batched", "samplewise"):
            raise ValueError(f"mode must be 'batched' or 'samplewise', got {mode!r}")
        B, T, _ = enc.shape
        assert enc_lens.shape == (B,) and targets.shape[0] == B and target_lens.shape == (B,), \
            f"enc {tuple(enc.shape)}, enc_lens {tuple(enc_lens.shape)}, targets {tuple(targets.shape)}, " \
            f"target_lens {tuple(target_lens.shape)}"
        valid = torch.arange(targets.shape[1], device=targets.device) < target_lens.unsqueeze(1)
        if ((targets < 0) | (targets >= self.blank))[valid].any():
            raise ValueError(f"targets must lie in [0, {self.blank}) (blank is {self.blank}), "
                             f"got values {targets[valid].unique().tolist()}")
        targets = targets.masked_fill(~valid, 0)  # padding must still index the joint output
        enc_h = self.enc_proj(enc)  # (B, T', H)
        pred_h = self.pred_proj(self.predictor(targets))  # (B, U+1, H)
        num_tokens = target_lens.sum()
        if mode == "batched":
            logits = _joint(enc_h, pred_h, self.out.weight, self.out.bias)  # (B, T', U+1, V)
            return rnnt_nll(logits, targets, enc_lens, target_lens, self.blank).sum(), num_tokens
        if not torch.is_grad_enabled():  # validation: no gradients to accumulate
            loss = 0
            for chunk in _chunks(enc_lens, target_lens, chunk_size):
                e, p, y, e_lens, y_lens = _trim(enc_h, pred_h, targets, enc_lens, target_lens, chunk)
                logits = _joint(e, p, self.out.weight, self.out.bias)  # (k, T', U+1, V)
                loss = loss + rnnt_nll(logits, y, e_lens, y_lens, self.blank).sum()
            return loss, num_tokens
        loss = _SamplewiseJointLoss.apply(enc_h, pred_h, self.out.weight, self.out.bias, targets,
                                          enc_lens, target_lens, chunk_size, self.blank)
        return loss, num_tokens

    @torch.no_grad()
    def greedy_decode(self, enc, enc_lens, max_symbols_per_frame=10):
        """Batched greedy search: enc (B, T', enc_dim), enc_lens (B,) -> B token-id lists (no blanks).

        At each frame a row emits its argmax and stays on the frame until it picks blank or has
        emitted max_symbols_per_frame tokens; rows past their length emit nothing. Call .eval() first:
        the predictor's dropout is active in training mode.
        """
        B, T, _ = enc.shape
        enc_h = self.enc_proj(enc)  # (B, T', H)
        token = torch.full((B,), self.blank, device=enc.device)
        out, state = self.predictor.step(token, self.predictor.init_state(B))
        pred_h = self.pred_proj(out)  # (B, H)
        tokens, emitted = [], []
        for t in range(T):
            active = t < enc_lens  # (B,)
            for _ in range(max_symbols_per_frame):
                token = self.out(torch.tanh(enc_h[:, t] + pred_h)).argmax(-1)  # (B,)
                emit = active & (token != self.blank)
                # One host sync per symbol step: a frame usually needs one or two steps, not the max.
                if not emit.any():
                    break
                tokens.append(token)
                emitted.append(emit)
                out, new_state = self.predictor.step(token, state)
                pred_h = torch.where(emit.unsqueeze(1), self.pred_proj(out), pred_h)
                state = tuple(torch.where(emit.view(-1, *[1] * (n.dim() - 1)), n, s)
                              for n, s in zip(new_state, state))
                active = emit
        if not tokens:
            return [[] for _ in range(B)]
        tokens, emitted = torch.stack(tokens, 1).cpu(), torch.stack(emitted, 1).cpu()  # (B, steps)
        return [tokens[b][emitted[b]].tolist() for b in range(B)]


# --- the encoder-pretraining model ----------------------------------------------------------------------

class TransducerASR(nn.Module):
    """The AED's encoder with a transducer head. Takes the AED's batch (prompt + text + EOS tokens) and
    trains on the text only."""

    def __init__(self, cfg: AEDConfig, text_vocab_size: int, chunk_size: int = 1,
                 predictor: str = "lstm", pred_dim: int = 640, joint_dim: int = 640):
        super().__init__()
        self.cfg, self.chunk_size = cfg, chunk_size
        self.encoder = build_encoder(cfg)
        # Blank is appended after the tokenizer's ids. pred_dim and joint_dim default to NeMo's 640;
        # a tiny model wants less, as the (B, T', U+1, joint_dim) joint dominates its step.
        self.transducer = Transducer(TransducerConfig(
            vocab_size=text_vocab_size + 1, enc_dim=cfg.enc_d_model, pred_dim=pred_dim, joint_dim=joint_dim,
            predictor=predictor))

    def count_targets(self, batch):
        """Per-row number of scored tokens: the text, without prompt and EOS."""
        return batch.token_lens - batch.prompt_lens - 1

    def forward(self, feats, feat_lens, tokens, token_lens, prompt_lens, transcribed=None):
        """Summed sample-wise transducer loss over the text tokens, and their count. Every row counts,
        `transcribed` or not: encoder pretraining reads transcription manifests."""
        enc, enc_lens = self.encoder(feats, feat_lens)  # (B, T', D)
        targets, target_lens = text_targets(tokens, token_lens, prompt_lens)
        return self.transducer.loss(enc, enc_lens, targets, target_lens, mode="samplewise",
                                    chunk_size=self.chunk_size)

    @torch.no_grad()
    def transcribe(self, feats, feat_lens) -> list[list[int]]:
        enc, enc_lens = self.encoder(feats, feat_lens)
        return self.transducer.greedy_decode(enc, enc_lens)
