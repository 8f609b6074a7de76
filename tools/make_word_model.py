"""Train the tiny word model the long-audio and timestamp tests use: an AED with a CTC head that
recognises the eight word clips of tests/fixtures/words (tools/make_word_clips.py) in any order.

    python tools/make_word_model.py -o tests/fixtures/word_model.pt    # 7 min on one thread of a busy 2-core CPU

Why a committed model: recognising words and placing them in time takes a few hundred training
steps (minutes of CPU), too long for every test run, and the tests need a model that does both
to check what untrained models cannot show: that merged chunk transcripts lose and repeat no word,
and how far CTC word times are from the truth. Each step draws a fresh batch of random word
sequences: 1-6 words, 0-1 s of leading silence, 0-0.4 s between words, over a noise floor of random
level (1e-4 to 1e-2), so the model has to find the words wherever they are, with or without pauses,
and a chunk of the training maximum (~6 s) of continuous words holds no more words than it learned.
The parameters are stored in fp16 (loaded as fp32), the buffers in fp32: under 1 MB.
"""

import argparse
import dataclasses
import json
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere

from aed.audio import FeatureConfig, LogMel, load_audio
from aed.checkpoint import pack_dir
from aed.model import AED, AEDConfig
from aed.tokenizer import Tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = os.path.join(ROOT, "tests", "fixtures", "words")
TOKENIZER = os.path.join(ROOT, "data", "mini", "tokenizer")
SAMPLE_RATE = 16000


def load_clips(folder: str = WORDS) -> dict[str, torch.Tensor]:
    with open(os.path.join(folder, "words.json")) as f:
        return {w: load_audio(os.path.join(folder, f"{w}.flac")) for w in json.load(f)}


def word_sequence(clips: dict, words: list[str], gaps: list[float], lead: float, noise: float,
                  rng: torch.Generator) -> tuple[torch.Tensor, list[tuple[str, float, float]]]:
    """The clips of `words` after `lead` seconds, gaps[i] seconds after word i, over white noise of
    amplitude `noise` -> waveform (S,) and each word's (word, start, end) in seconds."""
    parts, truth, t = [torch.zeros(round(lead * SAMPLE_RATE))], [], lead
    for word, gap in zip(words, gaps):
        clip = clips[word]
        truth.append((word, t, t + clip.numel() / SAMPLE_RATE))
        parts += [clip, torch.zeros(round(gap * SAMPLE_RATE))]
        t += clip.numel() / SAMPLE_RATE + gap
    wav = torch.cat(parts)
    return wav + noise * torch.randn(wav.numel(), generator=rng), truth


def random_sequence(clips: dict, rng: random.Random, gen: torch.Generator):
    words = [rng.choice(sorted(clips)) for _ in range(rng.randint(1, 6))]
    return word_sequence(clips, words, [rng.uniform(0.0, 0.4) for _ in words], rng.uniform(0.0, 1.0),
                         10 ** rng.uniform(-4, -2), gen)


def model_config(tokenizer: Tokenizer) -> AEDConfig:
    return AEDConfig(n_mels=32, vocab_size=tokenizer.padded_vocab_size, pad_id=tokenizer.pad, enc_d_model=64,
                     enc_layers=2, enc_heads=2, subsampling_channels=16, dec_d_model=64, dec_layers=1, dec_heads=2,
                     dec_max_len=64, enc_dropout=0.0, enc_dropout_pre_encoder=0.0, enc_dropout_att=0.0,
                     dec_dropout=0.0, dec_dropout_att=0.0, loss_on_prompt=False, ctc_weight=0.5)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-o", "--out", required=True, help="checkpoint file to write")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads (more only help on idle cores)")
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)  # tiny ops: a second thread on a busy core slowed steps 6x
    torch.manual_seed(args.seed)
    rng, gen = random.Random(args.seed), torch.Generator().manual_seed(args.seed)
    clips, tokenizer, features = load_clips(), Tokenizer.load(TOKENIZER), FeatureConfig(n_mels=32)
    cfg = model_config(tokenizer)
    model = AED(cfg).train()
    logmel = LogMel(features).eval()  # no dither: the random noise floor is the augmentation
    prompt = tokenizer.prompt_ids("en", "en", False)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)  # constant rate: converges in ~500 steps
    max_duration, t0 = 0.0, time.time()
    for step in range(1, args.steps + 1):
        examples = [random_sequence(clips, rng, gen) for _ in range(args.batch_size)]
        wav_lens = torch.tensor([wav.numel() for wav, _ in examples])
        wav = torch.zeros(len(examples), int(wav_lens.max()))  # (B, S)
        for i, (w, _) in enumerate(examples):
            wav[i, : w.numel()] = w
        feats, feat_lens = logmel(wav, wav_lens)
        seqs = [prompt + tokenizer.encode(" ".join(w for w, _, _ in truth), "en") + [tokenizer.eos]
                for _, truth in examples]
        tokens = torch.full((len(seqs), max(map(len, seqs))), tokenizer.pad)  # (B, U)
        for i, s in enumerate(seqs):
            tokens[i, : len(s)] = torch.tensor(s)
        loss, n = model(feats, feat_lens, tokens, torch.tensor([len(s) for s in seqs]),
                        torch.full((len(seqs),), len(prompt)))
        optimizer.zero_grad()
        (loss / n).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        max_duration = max(max_duration, float(wav_lens.max()) / SAMPLE_RATE)
        if step % 100 == 0:
            print(f"step {step}: loss {loss.item() / n.item():.3f} ({time.time() - t0:.0f} s)", flush=True)

    params = {name for name, _ in model.named_parameters()}  # buffers (positions, BatchNorm statistics) stay fp32
    state = {k: v.half() if k in params else v for k, v in model.state_dict().items()}
    ckpt = {"model": state, "model_config": dataclasses.asdict(cfg), "features": dataclasses.asdict(features),
            "tokenizer": pack_dir(TOKENIZER), "max_train_duration": round(max_duration, 2)}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    torch.save(ckpt, args.out)
    print(f"wrote {args.out} ({os.path.getsize(args.out) / 1e6:.2f} MB) after {args.steps} steps")


if __name__ == "__main__":
    main()
