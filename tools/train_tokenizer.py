"""Train an aed tokenizer (special tokens + SentencePiece) from NeMo-style JSONL manifests.

Manifests are read as training reads them (`aed.data_manifest.iter_texts`: plain or .gz, the
target text in `text` or `answer`, its `source_lang` / `target_lang` or `lang`; a bad line stops
with file:line and field, or with --skip-invalid is skipped and counted). The text is in the
target language: it is what the decoder emits.

    # one BPE model shared by all languages, "canary2" prompts (our default: it exports to NeMo,
    # transformers and sherpa-onnx alike, as Canary-1B-v2's layout)
    python tools/train_tokenizer.py --manifest data/train_*.jsonl --vocab-size 1024 -o runs/tokenizer
    # NeMo's aggregate layout: one BPE model per target language, --vocab-size each
    python tools/train_tokenizer.py --manifest train.jsonl --layout aggregate --vocab-size 1024 -o tok
"""

import argparse
import io
import random
import re
import sys
from pathlib import Path

import sentencepiece as spm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without installing aed

from aed.data_manifest import iter_texts  # noqa: E402
from aed.data_tokenizer import (DEFAULT_LANGUAGES, PROMPT_FORMATS, SentencePieceBlock, SpecialBlock,  # noqa: E402
                                Tokenizer, default_special_tokens)


def read_manifests(paths, skip_invalid: bool = False):
    """Yield (target text, source_lang, target_lang) from every line of every manifest; a bad line
    raises ManifestError (a ValueError) naming file, line and field, unless skip_invalid."""
    yield from iter_texts(paths, skip_invalid)


def sample_sentences(sentences, max_sentences: int, seed: int) -> list[str]:
    """Uniform sample of at most `max_sentences` (reservoir sampling), the same on every run.

    We sample here rather than with SentencePiece's input_sentence_size: its sample changed from
    process to process even after spm.set_random_generator_seed (sentencepiece 0.2.x).
    """
    rng = random.Random(seed)
    sample, seen = [], 0
    for seen, sentence in enumerate(sentences, start=1):
        if len(sample) < max_sentences:
            sample.append(sentence)
        elif (j := rng.randrange(seen)) < max_sentences:
            sample[j] = sentence
    if seen > len(sample):
        print(f"sampled {len(sample)} of {seen} sentences")
    return sample


def train_sentencepiece(sentences: list[str], vocab_size: int, model_type: str = "bpe") -> spm.SentencePieceProcessor:
    """Train one SentencePiece model in memory; a vocab too large for the corpus is lowered to the largest possible."""
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(sentences),
            model_writer=model,
            vocab_size=vocab_size,
            model_type=model_type,
            character_coverage=1.0,  # keep every character seen: accents, umlauts, ...
            byte_fallback=True,  # ... and spell anything unseen as UTF-8 bytes, so no text maps to <unk>
            unk_id=0,
            bos_id=-1,  # prompts and <|endoftext|> live in our special block, not in SentencePiece
            eos_id=-1,
            pad_id=-1,
            input_sentence_size=0,  # use every sentence given: sample_sentences already sampled
            shuffle_input_sentence=False,
            minloglevel=2,  # SentencePiece's own log is thousands of lines
        )
    except RuntimeError as e:
        too_high = re.search(r"Vocabulary size too high \((\d+)\)\. Please set it to a value <= (\d+)", str(e))
        if too_high is None:
            raise RuntimeError(f"SentencePiece training with vocab size {vocab_size} failed: {e}") from e
        smaller = int(too_high.group(2))
        print(f"vocab size {vocab_size} is too large for this corpus; lowering it to {smaller}")
        return train_sentencepiece(sentences, smaller, model_type)
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--manifest", nargs="+", required=True, help="NeMo-style JSONL manifests")
    parser.add_argument("--vocab-size", type=int, default=1024, help="SentencePiece vocab size (per model)")
    parser.add_argument(
        "--layout",
        choices=["single", "aggregate"],
        default="single",
        help="single: one model for all languages; aggregate: one model per target language (NeMo Canary)",
    )
    parser.add_argument("--prompt-format", choices=sorted(PROMPT_FORMATS), default="canary2",
                        help="canary2: the prompt of Canary-1B-Flash, 180M-Flash and 1B-v2 (default; what sherpa-onnx "
                             "builds); canary: Canary-1B's, with a task token")
    parser.add_argument("--model-type", choices=["bpe", "unigram", "char"], default="bpe",
                        help="char: one token per character seen (--vocab-size is ignored), for CTC at 4x subsampling")
    parser.add_argument("--max-sentences", type=int, default=2_000_000, help="sentences sampled per model")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sentence sample")
    parser.add_argument("--skip-invalid", action="store_true",
                        help="skip (and count) manifest lines training would reject, instead of stopping")
    parser.add_argument("-o", "--output", required=True, help="output directory")
    args = parser.parse_args(argv)

    # One pass to validate every line and find the languages; the texts are streamed again per model.
    counts, source_langs = {}, set()
    for _, source_lang, target_lang in read_manifests(args.manifest, args.skip_invalid):
        counts[target_lang] = counts.get(target_lang, 0) + 1
        source_langs.add(source_lang)
    if not counts:
        raise SystemExit(f"no utterances in {args.manifest}")
    languages = sorted(set(DEFAULT_LANGUAGES) | source_langs | set(counts))
    print(f"read {sum(counts.values())} utterances; target texts per language: {dict(sorted(counts.items()))}")

    def texts(lang):
        return (text for text, _, target_lang in read_manifests(args.manifest, args.skip_invalid)
                if lang in ("all", target_lang))

    sp_langs = ["all"] if args.layout == "single" else sorted(counts)
    blocks = [SpecialBlock(default_special_tokens(languages))]
    for lang in sp_langs:
        print(f"training SentencePiece '{lang}'")
        sentences = sample_sentences(texts(lang), args.max_sentences, args.seed)
        sp = train_sentencepiece(sentences, args.vocab_size, args.model_type)
        blocks.append(SentencePieceBlock(lang, sp))
    tokenizer = Tokenizer(blocks, languages, prompt_format=args.prompt_format)
    tokenizer.save(args.output)

    print(f"layout: {args.layout}; prompt format: {args.prompt_format}; languages: {languages}")
    for block in blocks:
        name = "special" if isinstance(block, SpecialBlock) else f"sentencepiece '{block.lang}'"
        print(f"  {name}: {block.size} ids")
    print(f"vocab_size: {tokenizer.vocab_size} (padded to {tokenizer.padded_vocab_size}); saved to {args.output}")


if __name__ == "__main__":
    main()
