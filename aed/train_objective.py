"""The three training objectives, side by side: what `objective=...` in train.py changes.

    objective = OBJECTIVES[cfg.objective]
    model = objective.build(cfg, tokenizer.vocab_size)
    hyps = objective.hypotheses(model, batch, tokenizer.eos, options, amp)  # None for ssl: loss only

Everything else (the training step, the target count, checkpoints) is the same for all three:
every model takes the AED's batch and returns (summed loss, target count), and
`model.count_targets(batch)` counts what its loss scores. The encoder and its parameter names are
shared, so an rnnt- or ssl-pretrained encoder loads into an AED (`init_from`, `init_encoder_only`).
"""

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from aed.decode_search import decode_features
from aed.model import AED
from aed.model_ssl import BestRQ
from aed.model_transducer import TransducerASR


def _hypotheses_aed(model: AED, batch, eos_id: int, options, amp, decoder=None) -> list[list[int]]:
    prompt = torch.stack([batch.tokens[k, : batch.prompt_lens[k]] for k in range(len(batch))])  # (B, P)
    return decode_features(model, batch.feats, batch.feat_lens, prompt, eos_id, options, amp, decoder)[0]


def _hypotheses_rnnt(model: TransducerASR, batch, eos_id: int, options, amp, decoder=None) -> list[list[int]]:
    with amp:
        return model.transcribe(batch.feats, batch.feat_lens)  # greedy: the transducer has no prompt or options


@dataclass(frozen=True)
class Objective:
    name: str
    # (TrainConfig, the tokenizer's real ids) -> the model. A transducer's blank comes after those ids.
    build: Callable[..., nn.Module]
    # (model, batch, eos id, DecodingOptions, autocast context, compiled decoder or None) -> generated ids
    # per row, for validation's WER and BLEU (the AED's through infer.py's `decode_features`);
    # None: validation reports the loss alone.
    hypotheses: Callable | None
    reads_text: bool  # False: audio-only manifests, 1D (duration) buckets, no token bound in oom.py
    spec_augment: bool  # False: the objective masks its input itself (BEST-RQ)
    describe_head: Callable[..., str]  # TrainConfig -> what sits on the encoder, in words, for the start-up log
    compiles: bool = False  # its validation decoding steps a KV cache that val.compile can compile (aed/model_static.py)


OBJECTIVES = {
    "aed": Objective(
        "aed", build=lambda cfg, vocab: AED(cfg.model), hypotheses=_hypotheses_aed, reads_text=True, spec_augment=True,
        describe_head=lambda cfg: f"decoder {cfg.model.dec_layers} x {cfg.model.dec_d_model}", compiles=True),
    "rnnt": Objective(
        "rnnt", build=lambda cfg, vocab: TransducerASR(cfg.model, vocab, cfg.rnnt_chunk_size,
                                                       pred_dim=cfg.rnnt_pred_dim, joint_dim=cfg.rnnt_joint_dim),
        hypotheses=_hypotheses_rnnt, reads_text=True, spec_augment=True,
        describe_head=lambda cfg: f"transducer: predictor {cfg.rnnt_pred_dim}, joint {cfg.rnnt_joint_dim}"),
    "ssl": Objective(
        "ssl", build=lambda cfg, vocab: BestRQ(cfg.model, cfg.ssl, seed=cfg.seed), hypotheses=None,
        reads_text=False, spec_augment=False,  # BEST-RQ's masking is its augmentation; targets come from clean features
        describe_head=lambda cfg: f"{cfg.ssl.codebooks} BEST-RQ head(s) x {cfg.ssl.codebook_size} classes"),
}
