"""A token n-gram language model of a corpus's transcripts, for shallow fusion in the beam search.

A small model trained on a few hours hears the sounds and spells them as they sound: "a bout it"
for "about it", "won" for "one", "wether" for "weather" (its English and French character error
rates are half its word error rates). Its attention decoder is the only language model it has,
and two small layers trained on a few thousand sentences have not learnt their spellings. An n-gram
of the same transcripts' tokens has: the beam ranks each candidate token by

    (1 - ctc_weight) log P_att + ctc_weight log P_ctc + lm_weight log P_lm(token | the last n - 1)

(shallow fusion, Gulcehre et al. 2015; the joint CTC term as in `aed.decode_search`). Nothing but the
training text goes in, so it knows the corpus's words and their spelling, not its test sentences.

The model is interpolated Witten-Bell (Witten and Bell 1991; the smoothing SRILM's -wbdiscount
gives): each context's counts mixed with the next shorter context's distribution, in proportion to
how many different tokens followed it, down to add-one unigrams. It works on the tokenizer's ids,
characters or pieces alike, and EOS ends every sequence, so it also says where sentences end.

    python tools/train_lm.py --manifest data/sentences/train.jsonl --tokenizer data/sentences/tokenizer -o runs/laptop/lm.pt
    python infer.py --ckpt runs/laptop --manifest data/sentences/test.jsonl --beam-size 4 --lm runs/laptop/lm.pt

train.py counts one into its run directory (`train.lm_order`), and the beam search of a model loaded
from that run fuses it unless told otherwise (`aed.decode_transcribe.transcribe`). The file holds the
token sequences; the counts are made again when it loads (seconds for the transcripts of a few
thousand utterances), once per process.
"""

import functools
from collections import defaultdict

import torch

from aed.data_manifest import Faults, iter_texts

CACHED_CONTEXTS = 200_000  # next-token distributions kept per model (the beam revisits its prefixes)


class NGramLM:
    def __init__(self, sequences: list[list[int]], vocab_size: int, eos_id: int, order: int = 7):
        """sequences: token ids of each transcript (no prompt, no EOS); vocab_size: the model's
        output size (ids below it); order: the n of n-gram (contexts of n - 1 tokens)."""
        if order < 1:
            raise ValueError(f"n-gram order must be at least 1, got {order}")
        if not 0 <= eos_id < vocab_size:
            raise ValueError(f"EOS id {eos_id} outside the vocabulary of {vocab_size}")
        self.sequences, self.vocab_size, self.eos_id, self.order = sequences, vocab_size, eos_id, order
        counts = [defaultdict(lambda: defaultdict(int)) for _ in range(order)]  # [context length][context][token]
        for seq in sequences:
            seq = [*seq, eos_id]
            bad = [t for t in seq if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"token id {bad[0]} outside the vocabulary of {vocab_size}")
            for i, token in enumerate(seq):
                for k in range(min(order, i + 1)):
                    counts[k][tuple(seq[i - k:i])][token] += 1
        # Per context: the tokens seen after it, their counts, the total and the number of kinds.
        self.tables = [{context: (torch.tensor(list(after)), torch.tensor(list(after.values()), dtype=torch.float64))
                        for context, after in table.items()} for table in counts]
        self.cache: dict[tuple, torch.Tensor] = {}

    def next_log_probs(self, history: tuple) -> torch.Tensor:
        """(V,) float32 log P(token | the last order - 1 tokens of `history`)."""
        context = tuple(history[len(history) - self.order + 1:]) if self.order > 1 else ()
        if context in self.cache:
            return self.cache[context]
        p = torch.full((self.vocab_size,), 1.0 / self.vocab_size, dtype=torch.float64)
        for k in range(len(context) + 1):  # unigrams first, then ever longer contexts
            seen = self.tables[k].get(context[len(context) - k:])
            if seen is None:
                break  # a longer context that holds this one's tail was not seen either
            ids, c = seen
            kinds = len(ids)
            p = p * kinds
            p[ids] += c
            p /= c.sum() + kinds
        if len(self.cache) >= CACHED_CONTEXTS:
            self.cache.clear()
        self.cache[context] = out = p.log().float()
        return out

    def scores(self, tokens: torch.Tensor, length: int, candidates: torch.Tensor) -> torch.Tensor:
        """tokens (R, >= length): each row's generated ids, the first `length` valid; candidates (R, W)
        ids -> (R, W) their log-probabilities after each row's tokens."""
        rows = tokens[:, :length].tolist()
        cand = candidates.cpu()
        out = torch.stack([self.next_log_probs(tuple(row))[c] for row, c in zip(rows, cand)])
        return out.to(candidates.device)

    def save(self, path: str) -> None:
        lengths = torch.tensor([len(s) for s in self.sequences], dtype=torch.int64)
        flat = torch.tensor([t for s in self.sequences for t in s], dtype=torch.int32)
        torch.save({"kind": "aed token n-gram", "order": self.order, "vocab_size": self.vocab_size,
                    "eos_id": self.eos_id, "lengths": lengths, "tokens": flat}, path)


def count_transcripts(manifests: list[str], tokenizer, order: int = 7, skip_invalid: bool = False,
                      faults: Faults | None = None) -> NGramLM:
    """The n-gram of the target texts of every line of `manifests` (read as tokenizers are trained:
    `iter_texts`; a bad line raises ManifestError naming it, or with skip_invalid is counted in
    `faults`, and so is a text the tokenizer cannot encode), each encoded with the model's `tokenizer`
    in its target language: the ids the decoder emits."""
    faults = Faults() if faults is None else faults
    sequences = []
    for text, _, target in iter_texts(manifests, skip_invalid, faults):
        try:
            sequences.append(tokenizer.encode(text, target))
        except (ValueError, KeyError) as e:
            if not skip_invalid:
                raise ValueError(f"{' '.join(manifests)}: cannot encode {text[:40]!r} ({target}): {e}") from None
            faults.skip("not_encodable", f"{target}: {text[:40]!r}", str(e), quiet=True)
    if not sequences:
        raise ValueError(f"no transcripts in {' '.join(manifests)}")
    return NGramLM(sequences, tokenizer.padded_vocab_size, tokenizer.eos, order)


@functools.lru_cache(maxsize=2)
def load(path: str) -> NGramLM:
    """The n-gram saved at `path`, counted once per process."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ValueError(f"{path}: not a language model file of tools/train_lm.py ({e})") from None
    if not isinstance(state, dict) or state.get("kind") != "aed token n-gram":
        raise ValueError(f"{path}: not a language model file of tools/train_lm.py")
    sequences = [s.tolist() for s in state["tokens"].split(state["lengths"].tolist())]
    return NGramLM(sequences, state["vocab_size"], state["eos_id"], state["order"])


def check_fits(lm: NGramLM, vocab_size: int, eos_id: int, path: str) -> None:
    """An n-gram counted with another tokenizer would score the wrong tokens: refuse it."""
    if (lm.vocab_size, lm.eos_id) != (vocab_size, eos_id):
        raise ValueError(f"{path}: counted for a vocabulary of {lm.vocab_size} with EOS {lm.eos_id}, but the model "
                         f"has {vocab_size} with EOS {eos_id}: train it with this model's tokenizer (tools/train_lm.py)")
