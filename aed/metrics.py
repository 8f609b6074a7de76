"""WER for speech recognition and BLEU for speech translation.

Both are corpus-level: WER = total word edits / total reference words, BLEU = sacreBLEU's
corpus score. Callers gather every rank's (reference, hypothesis) pairs before scoring.
"""

import re
import unicodedata

import jiwer
from sacrebleu.metrics import BLEU

_PUNCT = re.compile(r"[^\w\s']|_")


def normalize_text(text: str) -> str:
    """Lower-case, punctuation removed, whitespace collapsed: the 'normalised' WER convention."""
    text = unicodedata.normalize("NFKC", text).lower()
    return " ".join(_PUNCT.sub(" ", text).split())


def wer(refs: list[str], hyps: list[str], normalize: bool = True) -> float:
    """Corpus WER in percent; `normalize=False` scores the raw text (punctuation and case count)."""
    if normalize:
        refs, hyps = [normalize_text(r) for r in refs], [normalize_text(h) for h in hyps]
    pairs = [(r, h) for r, h in zip(refs, hyps, strict=True) if r.split()]
    if not pairs:
        return float("nan")
    out = jiwer.process_words([r for r, _ in pairs], [h for _, h in pairs])
    errors = out.substitutions + out.deletions + out.insertions
    return 100.0 * errors / sum(len(r.split()) for r, _ in pairs)


def bleu(refs: list[str], hyps: list[str]) -> float:
    """sacreBLEU corpus BLEU with its default 13a tokenisation."""
    return BLEU().corpus_score(hyps, [refs]).score
