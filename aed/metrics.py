"""WER for speech recognition and BLEU for speech translation.

Both are corpus-level: WER = total word edits / total reference words, BLEU = sacreBLEU's
corpus score. Callers gather every rank's (reference, hypothesis) pairs before scoring;
`corpus_scores` groups them by language (ASR) and language pair (AST).
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


def corpus_scores(rows: list[tuple[str, str, str, str, str]]) -> tuple[dict[str, dict], float | None]:
    """Rows (taskname, source_lang, target_lang, reference, hypothesis) -> per group, sorted by key,
    {"asr en": {"wer": .., "wer_pnc": .., "n": ..}, "ast es-en": {"bleu": .., "n": ..}}, and the
    normalised WER of all ASR rows together (None without ASR rows), a headline number for logs.
    `wer` is normalised (`normalize_text`); `wer_pnc` scores the raw text, punctuation and case.
    """
    groups = {}
    for task, src, tgt, ref, hyp in rows:
        key = f"asr {src}" if task == "asr" else f"ast {src}-{tgt}"
        groups.setdefault(key, []).append((ref, hyp))
    scores = {}
    for key, pairs in sorted(groups.items()):
        refs, hyps = [r for r, _ in pairs], [h for _, h in pairs]
        if key.startswith("asr"):
            scores[key] = {"wer": wer(refs, hyps), "wer_pnc": wer(refs, hyps, normalize=False), "n": len(pairs)}
        else:
            scores[key] = {"bleu": bleu(refs, hyps), "n": len(pairs)}
    asr = [(ref, hyp) for task, _, _, ref, hyp in rows if task == "asr"]
    return scores, (wer([r for r, _ in asr], [h for _, h in asr]) if asr else None)
