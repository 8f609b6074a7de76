"""CTC head on the encoder (Graves et al. 2006): an optional auxiliary loss and a fast greedy decoder.

Blank is the LAST id (vocab_size - 1), as in the transducer (aed/model_transducer.py): tokenizer ids pass
through unchanged, so one tokenizer serves the AED decoder, the transducer and this head.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F


def infeasible(enc_lens, targets, target_lens):
    """(B,) True where no CTC alignment fits: a path needs one frame per token plus a blank between
    each repeated pair. enc_lens (B,), targets (B, U) padded with anything, target_lens (B,)."""
    valid = torch.arange(targets.shape[1], device=targets.device) < target_lens.unsqueeze(1)  # (B, U)
    repeats = ((targets[:, 1:] == targets[:, :-1]) & valid[:, 1:]).sum(1)  # (B,)
    return enc_lens < target_lens + repeats


class CTCHead(nn.Module):
    def __init__(self, enc_dim: int, vocab_size: int):
        super().__init__()
        self.blank = vocab_size - 1  # vocab_size counts the blank
        self.proj = nn.Linear(enc_dim, vocab_size)

    def forward(self, enc):
        """enc (B, T', enc_dim) -> log-probs (B, T', V) in fp32 (CTC sums log-probs over long paths)."""
        return self.proj(enc).float().log_softmax(-1)

    def loss(self, enc, enc_lens, targets, target_lens, rows=None):
        """Summed CTC loss and the number of target tokens it covers (the caller normalises).

        enc (B, T', enc_dim), enc_lens (B,), targets (B, U) padded with anything, target_lens (B,);
        rows (B,) bool or None: only these rows count (the AED passes its transcriptions: a
        translation's words were never spoken, so no alignment to the audio exists).
        An utterance that no alignment fits (`infeasible`) is left out of both the sum and the count;
        train.py counts them from the batch lengths (aed.train_step.count_ctc_skipped) and logs the
        number with each progress line and validation.
        """
        B, U = targets.shape
        assert enc.shape[0] == B and enc_lens.shape == (B,) and target_lens.shape == (B,), \
            f"enc {tuple(enc.shape)}, enc_lens {tuple(enc_lens.shape)}, targets {tuple(targets.shape)}, " \
            f"target_lens {tuple(target_lens.shape)}"
        valid = torch.arange(U, device=targets.device) < target_lens.unsqueeze(1)  # (B, U)
        if ((targets < 0) | (targets >= self.blank))[valid].any():
            raise ValueError(f"targets must lie in [0, {self.blank}) (blank is {self.blank}), "
                             f"got values {targets[valid].unique().tolist()}")
        targets = targets.masked_fill(~valid, 0)
        feasible = ~infeasible(enc_lens, targets, target_lens)
        if rows is not None:
            feasible &= rows
        log_probs = self(enc).transpose(0, 1)  # (T', B, V), the layout F.ctc_loss wants
        nll = F.ctc_loss(log_probs, targets, enc_lens, target_lens, blank=self.blank,
                         reduction="none", zero_infinity=True)  # (B,)
        return nll.masked_fill(~feasible, 0.0).sum(), (target_lens * feasible).sum()  # no host sync

    @torch.no_grad()
    def greedy_decode(self, enc, enc_lens):
        """enc (B, T', enc_dim), enc_lens (B,) -> B token-id lists: best path, repeats merged, blanks dropped."""
        best = self.proj(enc).argmax(-1)  # (B, T'); argmax of logits == argmax of log-probs
        new = torch.ones_like(best, dtype=torch.bool)
        new[:, 1:] = best[:, 1:] != best[:, :-1]
        inside = torch.arange(best.shape[1], device=best.device) < enc_lens.unsqueeze(1)
        keep = (new & (best != self.blank) & inside).cpu()
        best = best.cpu()
        return [best[b][keep[b]].tolist() for b in range(best.shape[0])]
