"""CTC prefix scores of growing hypotheses, for joint CTC/attention decoding (aed/decoding.py).

The attention decoder alone can loop ("que que que ...") or stop early: nothing ties its output to
the audio. The encoder's CTC head can: the CTC prefix probability of a hypothesis h,

    psi(h) = sum over every label sequence that starts with h of P_ctc(sequence | x),

falls as soon as h says something the frames do not support, and P_ctc(h | x), the score of ending
h with EOS, is small until h covers everything that was said. Joint decoding (Watanabe et al. 2017,
"Hybrid CTC/attention architecture for end-to-end speech recognition", sec. III-B; ESPnet's
CTCPrefixScore) ranks each extension h = g + c by (1 - lambda) log P_att(c | g) + lambda (psi(h) - psi(g)).

psi comes from the CTC forward variables of the prefix, over frames t < T' (n: h's last label is
emitted at frame t, b: a blank is):

    r_n(h)[t] = x_t(c) * (r_n(h)[t-1] + phi[t-1])       phi[t-1] = r_b(g)[t-1] + (r_n(g)[t-1] unless c == last(g))
    r_b(h)[t] = x_t(blank) * (r_n(h)[t-1] + r_b(h)[t-1])
    psi(h)    = sum_t phi[t-1] x_t(c)

with x_t the CTC probabilities, and a virtual frame -1 at which the empty prefix has r_b = 1. Each
recursion is linear, so it unrolls into cumulative sums over frames: with X[t] = sum_{k<=t} log x_k(c),

    log r_n(h)[t] = X[t] + logcumsumexp_s(log phi[s-1] - X[s-1])[t]

(likewise r_b with the blank's cumulative sum). That scores every candidate token of every
hypothesis at once, with no Python loop over frames. Only a few candidates are scored per
hypothesis (the attention decoder's top ones, ESPnet's pre-beam): O(T' x candidates) per step,
not O(T' x vocabulary).
"""

import torch
import torch.nn.functional as F

NEG_INF = float("-inf")


class CTCPrefixScorer:
    """Forward variables of R = B * K hypotheses (row r belongs to utterance r // K), grown one token per step.

        scorer = CTCPrefixScorer(ctc_log_probs, enc_lens, rows_per_utterance=K)
        psi = scorer.score(cand)         # (R, C) log psi(g + c) for candidate tokens cand (R, C)
        end = scorer.end_score()         # (R,) log P_ctc(g | x): g followed by EOS
        scorer.select(origin, choice)    # row r now holds hypothesis origin[r] + cand[origin[r], choice[r]]

    ctc_log_probs (B, T', V + 1) from `model.ctc` (blank = the last id), enc_lens (B,). The log-probs
    are read where they are, per step only those of the candidates; the sums over frames run in
    float64: cumulative log-probabilities reach -1e4 over a few hundred frames, where float32 keeps
    only about three decimals of their differences.
    """

    def __init__(self, ctc_log_probs, enc_lens, rows_per_utterance: int = 1):
        b, t, _ = ctc_log_probs.shape
        assert enc_lens.shape == (b,), f"enc_lens {tuple(enc_lens.shape)} != ({b},)"
        k, device = rows_per_utterance, ctc_log_probs.device
        self.log_probs = ctc_log_probs
        self.utterance = torch.arange(b, device=device).repeat_interleave(k)  # (R,) each row's utterance
        self.frames = torch.arange(t, device=device)
        blank = ctc_log_probs[..., -1].double().repeat_interleave(k, dim=0)  # (R, T')
        self.blank_sum = F.pad(blank.cumsum(-1), (1, 0))  # (R, T'+1): log prod of blanks up to frame t, from frame -1
        lens = enc_lens.repeat_interleave(k)
        self.valid = self.frames[None, :] < lens[:, None]  # (R, T')
        self.last_frame = lens  # index of frame T'-1 in the (T'+1)-long variables, which start at frame -1
        # The empty prefix: emitted nothing (r_n = 0), only blanks (r_b = cumulative blank prob, 1 at frame -1).
        r_n = torch.full_like(self.blank_sum, NEG_INF)
        self.r = torch.stack([r_n, self.blank_sum], dim=1)  # (R, 2, T'+1): log r_n, log r_b per frame -1..T'-1
        self.psi = torch.zeros(b * k, dtype=torch.float64, device=device)  # log psi of each row's prefix
        self.last = torch.full((b * k,), -1, dtype=torch.long, device=device)  # its last token; -1: none
        self.cand_r = None  # (R, C, 2, T'+1) variables of the last scored candidates, for `select`

    def score(self, cand):
        """cand (R, C) token ids (no EOS, no blank) -> log psi(g + c) (R, C), float64."""
        r, c = cand.shape
        x = self.log_probs[self.utterance[:, None, None], self.frames, cand[:, :, None]].double()  # (R, C, T') log x_t(c)
        r_n, r_b = self.r[:, 0, None, :-1], self.r[:, 1, None, :-1]  # (R, 1, T') prefix g at frames -1..T'-2
        # phi[t-1]: g is complete by frame t-1 and c may start at t; a repeated label needs a blank between.
        phi = torch.where(cand[:, :, None] == self.last[:, None, None], r_b, torch.logaddexp(r_n, r_b))  # (R, C, T')
        cum_x = x.cumsum(-1)
        new_n = cum_x + torch.logcumsumexp(phi - F.pad(cum_x[..., :-1], (1, 0)), dim=-1)  # (R, C, T')
        prev_n = F.pad(new_n[..., :-1], (1, 0), value=NEG_INF)  # r_n(h) at frame t-1; -inf at frame -1
        blank_sum = self.blank_sum[:, None, 1:]  # (R, 1, T')
        new_b = blank_sum + torch.logcumsumexp(prev_n - self.blank_sum[:, None, :-1], dim=-1)
        start = torch.full((r, c, 2, 1), NEG_INF, dtype=x.dtype, device=x.device)  # h is never complete at frame -1
        self.cand_r = torch.cat([start, torch.stack([new_n, new_b], dim=2)], dim=3)  # (R, C, 2, T'+1)
        return (phi + x).masked_fill(~self.valid[:, None, :], NEG_INF).logsumexp(-1)  # frames < T' of each row

    def end_score(self):
        """(R,) log P_ctc(g | x): every frame is used and g is complete at the last one."""
        at_end = self.r.gather(2, self.last_frame[:, None, None].expand(-1, 2, 1))  # (R, 2, 1)
        return at_end.logsumexp(dim=(1, 2))

    def select(self, origin, choice, psi, token):
        """Row r continues row origin[r] with candidate column choice[r] of the last `score`; its prefix
        score is psi[r] and its new last token token[r] (all (R,)). A choice past the scored columns
        (EOS) leaves that row's variables as they were: a finished hypothesis is never extended."""
        scored = choice < self.cand_r.size(1)
        picked = self.cand_r[origin, choice.clamp(max=self.cand_r.size(1) - 1)]  # (R, 2, T'+1)
        self.r = torch.where(scored[:, None, None], picked, self.r[origin])
        self.psi = psi
        self.last = token
