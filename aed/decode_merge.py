"""Joining the hypotheses of overlapping chunks of one long file, without repeating or losing
the words that both chunks heard.

    words = merge_chunks([Chunk(0.0, 10.0, words_a, timed=True), Chunk(8.0, 18.0, words_b, timed=True)])

Chunk i + 1 starts `overlap` seconds before chunk i ends, so the words spoken in the overlap are in
both hypotheses, and the words at a chunk's edges (cut mid-word, or heard without context) are the
least reliable. Each join keeps chunk i's words up to the middle of the overlap and chunk i + 1's
from there on: the middle is as far as possible from both edges.

Where the middle falls in each hypothesis:
- Timed words (the model has a CTC head: `aed.decode_timestamps` aligns every chunk): by time. A word
  belongs to the chunk on whose side of the middle its centre lies, so a word both chunks heard at
  about the same time is kept once, whatever else the two hypotheses disagree on; only a word the
  two chunks time on opposite sides of the middle could be lost or repeated. Where the two words
  at the join overlap in time, they meet halfway, so times stay ordered.
- Untimed words (no CTC head): by text. The longest run of words (compared lower-cased, without
  punctuation) that ends chunk i's overlap region and starts chunk i + 1's is the overlap both
  heard; the join falls at its middle word. This is the word-level form of the longest-common-
  subsequence merge of buffered decoding. When the two share no word there (a model that
  misheard either side), the words' times are estimated by spreading each chunk's words evenly
  over it and the join falls at the middle by those estimates: approximate, and counted
  (`MergeStats.estimated`), so the caller can say so.
"""

import re
from dataclasses import dataclass, replace

from aed.decode_timestamps import Word

NON_WORD = re.compile(r"[^\w']+")


@dataclass
class Chunk:
    start: float  # seconds in the file
    end: float
    words: list[Word]  # in order; untimed: start/end ignored
    timed: bool


@dataclass
class MergeStats:
    joins: int = 0  # joins of overlapping chunks
    by_text: int = 0  # placed by matching words
    estimated: int = 0  # placed by evenly spread word times (no common word in the overlap)


def spread(chunk: Chunk) -> list[Word]:
    """The chunk's words with times spread evenly over it: the estimate for a chunk without alignments."""
    n, length = len(chunk.words), chunk.end - chunk.start
    return [Word(w.text, chunk.start + k * length / n, chunk.start + (k + 1) * length / n, w.ids)
            for k, w in enumerate(chunk.words)]


def _key(word: Word) -> str:
    return NON_WORD.sub("", word.text.lower()) or word.text


def longest_common_run(a: list[str], b: list[str]) -> tuple[int, int, int]:
    """(i, j, n): a[i:i+n] == b[j:j+n] with n as large as possible; among equally long runs the one
    nearest a's end and b's start (where an overlap lies); n = 0 when they share no word."""
    best, best_key = (0, 0, 0), (0, 0)
    run = [0] * (len(b) + 1)  # run[j + 1]: length of the common run ending at a[i - 1], b[j]
    for i in range(len(a)):
        new = [0] * (len(b) + 1)
        for j in range(len(b)):
            if a[i] == b[j]:
                n = new[j + 1] = run[j] + 1
                key = (n, (i - n + 1) - (j - n + 1))
                if key > best_key:
                    best, best_key = (i - n + 1, j - n + 1, n), key
        run = new
    return best


def _centre(w: Word) -> float:
    return (w.start + w.end) / 2


def merge_chunks(chunks: list[Chunk], stats: MergeStats | None = None) -> list[Word]:
    """Consecutive chunks of one file (chunk i + 1 may start before chunk i ends) -> their words,
    each spoken word once, in order. Words keep their times when timed (estimated ones are not
    returned: untimed input gives untimed output, the words as the chunks had them)."""
    stats = stats if stats is not None else MergeStats()
    out: list[Word] = []  # words kept so far, with (possibly estimated) times
    originals: list[Word] = []  # the same words as the chunks gave them
    for k, chunk in enumerate(chunks):
        words = chunk.words if chunk.timed else spread(chunk)
        if k == 0 or chunk.start >= chunks[k - 1].end:
            out, originals = out + words, originals + chunk.words
            continue
        prev = chunks[k - 1]
        middle = (chunk.start + prev.end) / 2
        stats.joins += 1
        cut_out, cut_new = None, None
        if not (chunk.timed and prev.timed):
            # The overlap regions, with a margin of one overlap for speech that is not evenly spread.
            margin = prev.end - chunk.start
            tail = [i for i, w in enumerate(out) if _centre(w) >= chunk.start - margin]
            head = [j for j, w in enumerate(words) if _centre(w) < prev.end + margin]
            if tail and head:
                i, j, n = longest_common_run([_key(out[i]) for i in tail], [_key(words[j]) for j in head])
                if n:
                    cut_out, cut_new = tail[0] + i + n // 2, head[0] + j + n // 2
                    stats.by_text += 1
            if cut_out is None:
                stats.estimated += 1
        if cut_out is None:
            cut_out = sum(_centre(w) < middle for w in out)  # words are in time order
            cut_new = sum(_centre(w) < middle for w in words)
        if 0 < cut_out and cut_new < len(words) and out[cut_out - 1].end > words[cut_new].start:
            # The two chunks placed the words at the join a little differently: they meet halfway.
            a, b = out[cut_out - 1], words[cut_new]
            t = min(max((a.end + b.start) / 2, a.start), b.end)
            out[cut_out - 1], words = replace(a, end=t), words[:cut_new] + [replace(b, start=t)] + words[cut_new + 1:]
        out, originals = out[:cut_out] + words[cut_new:], originals[:cut_out] + chunk.words[cut_new:]
    return out if all(c.timed for c in chunks) else originals
