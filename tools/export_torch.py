"""Export a checkpoint's encoder and one decoder step (with its KV cache) with torch.export.

    python tools/export_torch.py --ckpt runs/tiny -o exported/tiny
    python tools/export_torch.py --ckpt canary-180m-flash.pt -o exported/flash --max-len 256 --audio a.wav

Writes, in the output directory:
    encoder.pt2        feats (B, T, F), feat_lens (B,) -> cross_kv, memory_lens[, ctc_log_probs]
    decoder_step.pt2   tokens (R, 1), position (), self_kv, cross_kv, memory_lens -> logits (R, V), self_kv
    export.json        {"features": the log-mel settings the encoder expects (aed.data_audio.FeatureConfig),
                        "max_len": the step's cache positions}
    tokenizer/         the checkpoint's tokenizer (prompt ids, EOS, detokenisation)
(aed/model_static.py documents the shapes; docs/inference.md "Export" decodes with them.)

Before writing, both programs are run on inputs of other sizes than they were traced with and
compared with the eager model (largest absolute difference printed; an error above --tolerance
stops the tool); with --audio, the file is decoded (aed.decode_search's default search) with the
exported programs and with the eager model, and the transcripts compared.
"""

import argparse
import dataclasses
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere

from aed import load_model
from aed.data_audio import LogMel, load_audio
from aed.decode_search import DecodingOptions, decode_features
from aed.model_static import MIN_FRAMES, ExportedAED, empty_cache, export_model


def largest_errors(model, encoder, step, max_len: int) -> tuple[float, float]:
    """Largest |exported - eager| of the cross-attention K/V and of 4 decoder steps' logits, on a
    random batch of 3 utterances of unequal length (the programs were traced with 2)."""
    torch.manual_seed(0)
    feat_lens = torch.tensor([400, 300, 123])
    feats = torch.randn(3, 400, model.cfg.n_mels)
    tokens = torch.randint(0, model.cfg.vocab_size, (3, min(4, max_len)))  # (R, U)
    cross_kv, memory_lens = encoder(feats, feat_lens)[:2]
    self_kv, logits = empty_cache(model, 3, max_len), []
    for pos in range(tokens.size(1)):
        out, self_kv = step(tokens[:, pos : pos + 1], torch.tensor(pos), self_kv, cross_kv, memory_lens)
        logits.append(out)
    with torch.no_grad():
        memory, lens = model.encode(feats, feat_lens)
        cache = model.new_cache(memory, lens, max_len)
        ref = [model.decode_step(tokens[:, pos : pos + 1], cache) for pos in range(tokens.size(1))]
    enc_err = (cross_kv - cache.cross_kv).abs().max().item()
    step_err = max((a - b).abs().max().item() for a, b in zip(logits, ref))
    return enc_err, step_err


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", required=True, help="checkpoint file or directory, or a run directory (its newest)")
    p.add_argument("-o", "--out", required=True, help="output directory")
    p.add_argument("--max-len", type=int, default=None,
                   help="decoder positions the step's cache holds, prompt + output + EOS (default: the model's dec_max_len)")
    p.add_argument("--max-frames", type=int, default=100_000, help="longest input in feature frames (10 ms each)")
    p.add_argument("--tolerance", type=float, default=1e-3, help="largest accepted |exported - eager|")
    p.add_argument("--audio", help="also transcribe this file both ways and compare (prompt: --lang, ASR)")
    p.add_argument("--lang", default="en", help="with --audio: its language")
    args = p.parse_args(argv)

    asr = load_model(args.ckpt)
    model = asr.model.float()
    max_len = args.max_len or model.cfg.dec_max_len
    print(f"exporting {asr.path}: inputs of {MIN_FRAMES}..{args.max_frames} frames, decoder positions {max_len}")
    try:
        encoder, step = export_model(model, max_len, args.max_frames)
    except ValueError as e:
        sys.exit(f"error: {e}")
    enc_err, step_err = largest_errors(model, encoder.module(), step.module(), max_len)
    print(f"largest |exported - eager|: cross-attention K/V {enc_err:.2e}, decoder logits {step_err:.2e}")
    if max(enc_err, step_err) > args.tolerance:
        sys.exit(f"error: the exported programs differ from the eager model by more than {args.tolerance}")

    if args.audio:
        wav = load_audio(args.audio, sample_rate=asr.features.sample_rate)
        feats, feat_lens = LogMel(asr.features).eval()(wav[None], torch.tensor([wav.numel()]))
        prompt = torch.tensor([asr.tokenizer.prompt_ids(args.lang, args.lang, True)])
        options = DecodingOptions(max_new_tokens=max_len - prompt.size(1))  # both within the step's positions
        exported = ExportedAED(encoder.module(), step.module(), max_len)
        got = decode_features(exported, feats, feat_lens, prompt, asr.tokenizer.eos, options)[0][0]
        ref = decode_features(model, feats, feat_lens, prompt, asr.tokenizer.eos, options)[0][0]
        text = asr.tokenizer.decode_hypothesis(got)
        print(f"{args.audio}: {text!r} ({'same as' if got == ref else 'DIFFERENT from'} eager decoding)")
        if got != ref:
            sys.exit("error: the exported programs' transcript differs from the eager one")

    os.makedirs(args.out, exist_ok=True)
    torch.export.save(encoder, os.path.join(args.out, "encoder.pt2"))
    torch.export.save(step, os.path.join(args.out, "decoder_step.pt2"))
    with open(os.path.join(args.out, "export.json"), "w") as f:
        json.dump({"features": dataclasses.asdict(asr.features), "max_len": max_len}, f, indent=2)
    asr.tokenizer.save(os.path.join(args.out, "tokenizer"))
    print(f"wrote {args.out}/: encoder.pt2, decoder_step.pt2, export.json, tokenizer/")


if __name__ == "__main__":
    main()
