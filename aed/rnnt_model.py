"""Encoder pretraining model: the AED's FastConformer encoder with a transducer (RNN-T) head.

Canary initialises its encoder from one pretrained with a transducer loss (Zelasko et al. 2025,
sec. 3). This model shares the AED's encoder construction and parameter names (`encoder.*`), so
`train.py init_from=rnnt_ckpt.pt init_encoder_only=true` loads it into an AED model.
It takes the same batch as the AED (prompt + text + EOS tokens) and trains on the text only.
"""

import torch
from torch import nn

from aed.encoder import ConformerEncoder
from aed.model import AEDConfig, text_targets
from aed.transducer import Transducer, TransducerConfig


class TransducerASR(nn.Module):
    def __init__(self, cfg: AEDConfig, text_vocab_size: int, chunk_size: int = 1,
                 predictor: str = "lstm", pred_dim: int = 640, joint_dim: int = 640):
        super().__init__()
        self.cfg, self.chunk_size = cfg, chunk_size
        self.encoder = ConformerEncoder(
            cfg.n_mels, cfg.enc_d_model, cfg.enc_layers, cfg.enc_heads, cfg.enc_ff_mult, cfg.conv_kernel,
            cfg.conv_norm, cfg.subsampling_channels, cfg.enc_dropout, cfg.enc_dropout_pre_encoder,
            cfg.enc_dropout_att, cfg.enc_xscaling,
        )
        # Blank is appended after the tokenizer's ids (aed/transducer.py). pred_dim and joint_dim default
        # to NeMo's 640; a tiny model wants less, as the (B, T', U+1, joint_dim) joint dominates its step.
        self.transducer = Transducer(TransducerConfig(
            vocab_size=text_vocab_size + 1, enc_dim=cfg.enc_d_model, pred_dim=pred_dim, joint_dim=joint_dim,
            predictor=predictor))

    def count_targets(self, token_lens, prompt_lens):
        """Per-row number of scored tokens: the text, without prompt and EOS."""
        return token_lens - prompt_lens - 1

    def forward(self, feats, feat_lens, tokens, token_lens, prompt_lens):
        """Summed sample-wise transducer loss over the text tokens, and their count."""
        enc, enc_lens = self.encoder(feats, feat_lens)  # (B, T', D)
        targets, target_lens = text_targets(tokens, token_lens, prompt_lens)
        return self.transducer.loss(enc, enc_lens, targets, target_lens, mode="samplewise",
                                    chunk_size=self.chunk_size)

    @torch.no_grad()
    def transcribe(self, feats, feat_lens) -> list[list[int]]:
        enc, enc_lens = self.encoder(feats, feat_lens)
        return self.transducer.greedy_decode(enc, enc_lens)
