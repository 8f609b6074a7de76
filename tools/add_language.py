"""Add a language to a trained or converted model: its own SentencePiece block, its language token,
and the decoder (and CTC head) rows for them, with every existing id and output unchanged.

    # a SentencePiece model trained on the new language's manifest text (tools/train_tokenizer.py's settings)
    python tools/add_language.py --ckpt runs/tiny --lang it --manifest it/train.jsonl -o runs/tiny-it.pt
    # or a SentencePiece model you already have
    python tools/add_language.py --ckpt canary-1b-flash.pt --lang it --spm it.model -o canary-it.pt
    # then fine-tune on the new language with the old ones still in the mix (README: "A new language")
    python train.py configs/tiny.yaml init_from=runs/tiny-it.pt train.tokenizer=runs/tiny-it.tokenizer ...

Why it keeps old outputs: the aggregate tokenizer (aed/data_tokenizer.py) is a list of blocks laid end
to end, so appending a block and, when the special block lacks it, a one-token block for <|it|>,
leaves every old id where it was. The model's vocabulary-sized tensors grow at the end
(`aed.train_checkpoint.grow_vocabulary`): old rows are copied, new output rows start with a constant
logit no higher than the least likely old token's, so old-language greedy and beam outputs stay
the same until fine-tuning moves the new rows.

Output:
    OUT.pt          model config, grown weights, features and the extended tokenizer (infer.py reads it)
    OUT.tokenizer/  the extended tokenizer directory, for train.py's train.tokenizer
"""

import argparse
import dataclasses
import os
import sys
import tempfile

import sentencepiece as spm
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere

from aed.model_checkpoint import INFERENCE_KEYS, CheckpointError, pack_dir, read_checkpoint_or_run, unpack_tokenizer
from aed.train_checkpoint import grow_vocabulary
from aed.model import AED, AEDConfig
from aed.data_tokenizer import SentencePieceBlock, SpecialBlock, Tokenizer, lang_token
from tools.train_tokenizer import read_manifests, sample_sentences, train_sentencepiece


def extend_tokenizer(tokenizer: Tokenizer, lang: str, sp: spm.SentencePieceProcessor) -> Tokenizer:
    """`tokenizer` with a SentencePiece block for `lang` appended, and <|lang|> appended in a
    special block of its own unless a special block already has it (Canary's has dozens)."""
    if lang in tokenizer.languages:
        raise ValueError(f"the tokenizer already has language {lang!r}: {tokenizer.languages}")
    blocks = tokenizer.blocks + [SentencePieceBlock(lang, sp)]
    try:
        tokenizer.token_to_id(lang_token(lang))
    except KeyError:
        blocks.append(SpecialBlock([lang_token(lang)]))
    return Tokenizer(blocks, tokenizer.languages + [lang], tokenizer.prompt_format)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", required=True, help="checkpoint file, or a run directory (its newest checkpoint)")
    p.add_argument("--lang", required=True, help="language code of the new language, e.g. it")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--spm", help="a SentencePiece .model for the new language")
    src.add_argument("--manifest", nargs="+", help="train one from these manifests' text in --lang")
    p.add_argument("--vocab-size", type=int, default=512,
                   help="with --manifest: SentencePiece vocabulary size (at least ~300: 256 byte pieces are included)")
    p.add_argument("-o", "--out", required=True, help="output checkpoint path (OUT.pt)")
    args = p.parse_args(argv)

    try:
        path, ckpt = read_checkpoint_or_run(args.ckpt, INFERENCE_KEYS)
    except (OSError, CheckpointError) as e:
        sys.exit(f"error: {e}")
    old = unpack_tokenizer(ckpt["tokenizer"])

    if args.spm:
        sp = spm.SentencePieceProcessor(model_file=args.spm)
    else:
        texts = [text for text, _, target in read_manifests(args.manifest) if target == args.lang]
        if not texts:
            sys.exit(f"error: no text with target_lang {args.lang!r} in {args.manifest}")
        print(f"training a SentencePiece model on {len(texts)} {args.lang} texts")
        sp = train_sentencepiece(sample_sentences(texts, 2_000_000, seed=0), args.vocab_size)
    try:
        tokenizer = extend_tokenizer(old, args.lang, sp)
    except ValueError as e:
        sys.exit(f"error: {e}")

    config = AEDConfig(**ckpt["model_config"])
    config = dataclasses.replace(config, vocab_size=tokenizer.padded_vocab_size)
    state = ckpt["model"]
    notes = grow_vocabulary(state, config.vocab_size)
    AED(config).load_state_dict(state)  # the grown weights fit the grown config

    tok_dir = os.path.splitext(args.out)[0] + ".tokenizer"
    tokenizer.save(tok_dir)
    out = {"model_config": dataclasses.asdict(config), "model": state, "features": ckpt["features"],
           "tokenizer": pack_dir(tok_dir)}
    # Which rows are new, for freeze=all_but_new_tokens (aed/train_setup.py): recorded, never typed by hand.
    out["new_tokens"] = {"language": args.lang, "first": old.vocab_size, "language_token": tokenizer.lang_id(args.lang),
                         "vocab_size": tokenizer.vocab_size}
    if "max_train_duration" in ckpt:
        out["max_train_duration"] = ckpt["max_train_duration"]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=os.path.dirname(os.path.abspath(args.out)), delete=False) as f:
        torch.save(out, f)
    os.replace(f.name, args.out)
    print(f"{path}: {old}\n  -> {tokenizer}")
    print("\n".join(f"  {n}" for n in notes))
    print(f"wrote {args.out} and {tok_dir}/")


if __name__ == "__main__":
    main()
