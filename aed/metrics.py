"""WER for speech recognition and BLEU for speech translation.

Both are corpus-level: WER = total word edits / total reference words, BLEU = sacreBLEU's
corpus score. Callers gather every rank's (reference, hypothesis) pairs before scoring;
`corpus_scores` groups them by language (ASR) and language pair (AST). Normalised WER applies
one of aed/normalize.py's normalisers to both sides first; raw WER scores the text as written.
"""

from collections.abc import Callable

import jiwer
from sacrebleu.metrics import BLEU

from aed.normalize import get_normalizer, simple


def wer(refs: list[str], hyps: list[str], normalize: Callable[[str], str] | None = simple) -> float:
    """Corpus WER in percent after `normalize` (text -> text) on both sides; None scores the raw
    text (punctuation and case count)."""
    if normalize is not None:
        refs, hyps = [normalize(r) for r in refs], [normalize(h) for h in hyps]
    pairs = [(r, h) for r, h in zip(refs, hyps, strict=True) if r.split()]
    if not pairs:
        return float("nan")
    out = jiwer.process_words([r for r, _ in pairs], [h for _, h in pairs])
    errors = out.substitutions + out.deletions + out.insertions
    return 100.0 * errors / sum(len(r.split()) for r, _ in pairs)


def bleu(refs: list[str], hyps: list[str]) -> float:
    """sacreBLEU corpus BLEU with its default 13a tokenisation."""
    return BLEU().corpus_score(hyps, [refs]).score


def corpus_scores(rows: list[tuple[str, str, str, str, str]],
                  normalizer: str = "simple") -> tuple[dict[str, dict], float | None]:
    """Rows (taskname, source_lang, target_lang, reference, hypothesis) -> per group, sorted by key,
    {"asr en": {"wer": .., "wer_pnc": .., "n": ..}, "ast es-en": {"bleu": .., "n": ..}}, and the
    normalised WER of all ASR rows together (None without ASR rows), a headline number for logs.
    `wer` is normalised (`aed.normalize.get_normalizer(normalizer, language)`: "simple" or
    "whisper", the leaderboards' convention); `wer_pnc` scores the raw text, punctuation and case.
    """
    groups = {}
    for task, src, tgt, ref, hyp in rows:
        key = f"asr {src}" if task == "asr" else f"ast {src}-{tgt}"
        groups.setdefault(key, []).append((ref, hyp))
    scores = {}
    for key, pairs in sorted(groups.items()):
        refs, hyps = [r for r, _ in pairs], [h for _, h in pairs]
        if key.startswith("asr"):
            norm = get_normalizer(normalizer, key.split()[1])
            scores[key] = {"wer": wer(refs, hyps, norm), "wer_pnc": wer(refs, hyps, None), "n": len(pairs)}
        else:
            scores[key] = {"bleu": bleu(refs, hyps), "n": len(pairs)}
    asr = [(get_normalizer(normalizer, src)(ref), get_normalizer(normalizer, src)(hyp))
           for task, src, _, ref, hyp in rows if task == "asr"]
    return scores, (wer([r for r, _ in asr], [h for _, h in asr], None) if asr else None)
