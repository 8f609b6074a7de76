"""CTC prefix scores (aed/decode_search.py) against sums over every CTC path, and against F.ctc_loss."""

import itertools
import math

import torch
import torch.nn.functional as F

from aed.decode_search import CTCPrefixScorer


def collapse(path, blank):
    """A frame-level CTC path -> its label sequence: repeats merged, blanks dropped."""
    out = []
    for i, s in enumerate(path):
        if s != blank and (i == 0 or s != path[i - 1]):
            out.append(s)
    return tuple(out)


def brute_force(log_probs, length):
    """{label sequence: log P(sequence | x)} over all (V+1)^T paths of the first `length` frames."""
    lp = log_probs[:length].tolist()
    blank = len(lp[0]) - 1
    totals = {}
    for path in itertools.product(range(len(lp[0])), repeat=length):
        y = collapse(path, blank)
        totals.setdefault(y, []).append(sum(lp[t][s] for t, s in enumerate(path)))
    return {y: math.log(sum(math.exp(v) for v in vals)) for y, vals in totals.items()}


def prefix_log_prob(totals, prefix):
    """log psi(prefix): the probability of every label sequence that starts with it."""
    vals = [v for y, v in totals.items() if y[: len(prefix)] == tuple(prefix)]
    return math.log(sum(math.exp(v) for v in vals)) if vals else float("-inf")


def follow(scorer, prefix, rows):
    """Advance every row of `scorer` along the same token sequence."""
    for tok in prefix:
        cand = torch.full((rows, 1), tok)
        psi = scorer.score(cand)
        scorer.select(torch.arange(rows), torch.zeros(rows, dtype=torch.long), psi[:, 0], cand[:, 0])


def test_prefix_and_end_scores_equal_sums_over_all_paths():
    torch.manual_seed(0)
    v, lens = 3, [5, 4]  # 3 tokens + blank over 5 frames: 4^5 paths
    log_probs = F.log_softmax(2 * torch.randn(2, 5, v + 1, dtype=torch.float64), dim=-1)
    totals = [brute_force(log_probs[b], lens[b]) for b in range(2)]
    everything = torch.arange(v).repeat(2, 1)  # (2, V): every token as a candidate
    for prefix in [(), (0,), (1, 1), (1, 2), (2, 0, 2), (0, 0, 0), (1, 2, 1, 0, 2)]:
        scorer = CTCPrefixScorer(log_probs, torch.tensor(lens))
        follow(scorer, prefix, rows=2)
        got, end = scorer.score(everything), scorer.end_score()
        for b in range(2):
            want = [prefix_log_prob(totals[b], prefix + (c,)) for c in range(v)]
            torch.testing.assert_close(got[b], torch.tensor(want, dtype=torch.float64), atol=1e-10, rtol=0,
                                       msg=f"utterance {b}, prefix {prefix}")
            want_end = totals[b].get(prefix, float("-inf"))
            torch.testing.assert_close(end[b], torch.tensor(want_end, dtype=torch.float64), atol=1e-10, rtol=0)
            assert math.isclose(float(scorer.psi[b]), prefix_log_prob(totals[b], prefix), abs_tol=1e-10)


def test_end_score_equals_ctc_loss_on_long_inputs():
    """Over 300 frames and a 40-token vocabulary, against PyTorch's CTC loss (float32 CTC log-probs)."""
    torch.manual_seed(1)
    t, v = 300, 40
    log_probs = F.log_softmax(3 * torch.randn(2, t, v + 1), dim=-1)
    lens = torch.tensor([300, 211])
    target = torch.randint(0, v, (25,)).tolist()
    scorer = CTCPrefixScorer(log_probs, lens)
    follow(scorer, target, rows=2)
    nll = F.ctc_loss(log_probs.transpose(0, 1).double(), torch.tensor([target, target]), lens, torch.tensor([25, 25]),
                     blank=v, reduction="none")
    torch.testing.assert_close(scorer.end_score(), -nll, atol=1e-8, rtol=1e-10)


def test_rows_of_one_utterance_share_its_frames_and_selection_moves_hypotheses():
    torch.manual_seed(2)
    log_probs = F.log_softmax(torch.randn(2, 6, 5, dtype=torch.float64), dim=-1)
    lens = torch.tensor([6, 4])
    beams = CTCPrefixScorer(log_probs, lens, rows_per_utterance=2)  # rows: u0b0, u0b1, u1b0, u1b1
    psi = beams.score(torch.tensor([[1, 2], [0, 3], [2, 2], [1, 0]]))
    # Every row now takes one candidate of another row of its utterance.
    origin, choice = torch.tensor([1, 0, 3, 3]), torch.tensor([1, 0, 0, 1])
    token = torch.tensor([3, 1, 1, 0])
    beams.select(origin, choice, psi[origin, choice], token)
    for row, (b, tok) in enumerate([(0, 3), (0, 1), (1, 1), (1, 0)]):
        alone = CTCPrefixScorer(log_probs[b : b + 1, : lens[b]], lens[b : b + 1])
        follow(alone, [tok], rows=1)
        cand = torch.arange(4)[None]
        torch.testing.assert_close(beams.score(cand.repeat(4, 1))[row], alone.score(cand)[0], atol=1e-12, rtol=0)
        torch.testing.assert_close(beams.end_score()[row], alone.end_score()[0], atol=1e-12, rtol=0)
