"""The attention encoder-decoder (Canary layout): FastConformer encoder + Transformer decoder, with
an optional CTC head on the encoder.

    python -m aed.model --count configs/*.yaml    # parameter counts, built on the meta device

NeMo `EncDecMultiTaskModel` names: `encoder.*` and `encoder_decoder_proj` are ours as is; see
aed/model_decoder.py for the decoder renames.

The CTC head (`CTCHead`, Graves et al. 2006): an optional auxiliary loss and a fast greedy decoder.
Blank is the LAST id (vocab_size - 1), as in the transducer (aed/model_transducer.py): tokenizer ids
pass through unchanged, so one tokenizer serves the AED decoder, the transducer and this head.

Guided attention (`off_diagonal_attention`, Tachibana et al. 2018): an optional loss, early in
training, on the cross-attention weight that falls far from the diagonal of text against audio, or
(`off_alignment_attention`) far from where the CTC head's forced alignment puts each token.
"""

import argparse
import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import torchaudio.functional as AF
import yaml
from torch import nn

from aed.config import from_dict
from aed.model_decoder import KVCache, TransformerDecoder
from aed.model_encoder import SUBSAMPLING_FACTORS, ConformerEncoder


def infeasible(enc_lens, targets, target_lens):
    """(B,) True where no CTC alignment fits: a path needs one frame per token plus a blank between
    each repeated pair. enc_lens (B,), targets (B, U) padded with anything, target_lens (B,)."""
    valid = torch.arange(targets.shape[1], device=targets.device) < target_lens.unsqueeze(1)  # (B, U)
    repeats = ((targets[:, 1:] == targets[:, :-1]) & valid[:, 1:]).sum(1)  # (B,)
    return enc_lens < target_lens + repeats


class CTCHead(nn.Module):
    def __init__(self, enc_dim: int, vocab_size: int):
        super().__init__()
        self.blank = vocab_size - 1  # vocab_size counts the blank
        self.proj = nn.Linear(enc_dim, vocab_size)

    def forward(self, enc):
        """enc (B, T', enc_dim) -> log-probs (B, T', V) in fp32 (CTC sums log-probs over long paths)."""
        return self.proj(enc).float().log_softmax(-1)

    def loss(self, enc, enc_lens, targets, target_lens, rows=None):
        """Summed CTC loss and the number of target tokens it covers (the caller normalises).

        enc (B, T', enc_dim), enc_lens (B,), targets (B, U) padded with anything, target_lens (B,);
        rows (B,) bool or None: only these rows count (the AED passes its transcriptions: a
        translation's words were never spoken, so no alignment to the audio exists).
        An utterance that no alignment fits (`infeasible`) is left out of both the sum and the count;
        train.py counts them from the batch lengths (aed.train_setup.count_ctc_skipped) and logs the
        number with each progress line and validation.
        """
        B, U = targets.shape
        assert enc.shape[0] == B and enc_lens.shape == (B,) and target_lens.shape == (B,), \
            f"enc {tuple(enc.shape)}, enc_lens {tuple(enc_lens.shape)}, targets {tuple(targets.shape)}, " \
            f"target_lens {tuple(target_lens.shape)}"
        valid = torch.arange(U, device=targets.device) < target_lens.unsqueeze(1)  # (B, U)
        if ((targets < 0) | (targets >= self.blank))[valid].any():
            raise ValueError(f"targets must lie in [0, {self.blank}) (blank is {self.blank}), "
                             f"got values {targets[valid].unique().tolist()}")
        targets = targets.masked_fill(~valid, 0)
        feasible = ~infeasible(enc_lens, targets, target_lens)
        if rows is not None:
            feasible &= rows
        log_probs = self(enc).transpose(0, 1)  # (T', B, V), the layout F.ctc_loss wants
        nll = F.ctc_loss(log_probs, targets, enc_lens, target_lens, blank=self.blank,
                         reduction="none", zero_infinity=True)  # (B,)
        return nll.masked_fill(~feasible, 0.0).sum(), (target_lens * feasible).sum()  # no host sync

    @torch.no_grad()
    def greedy_decode(self, enc, enc_lens):
        """enc (B, T', enc_dim), enc_lens (B,) -> B token-id lists: best path, repeats merged, blanks dropped."""
        best = self.proj(enc).argmax(-1)  # (B, T'); argmax of logits == argmax of log-probs
        new = torch.ones_like(best, dtype=torch.bool)
        new[:, 1:] = best[:, 1:] != best[:, :-1]
        inside = torch.arange(best.shape[1], device=best.device) < enc_lens.unsqueeze(1)
        keep = (new & (best != self.blank) & inside).cpu()
        best = best.cpu()
        return [best[b][keep[b]].tolist() for b in range(best.shape[0])]


def ctc_spans(log_probs: torch.Tensor, ids: list[int], blank: int) -> list[tuple[int, int]]:
    """log_probs (T', V) of one utterance's valid frames, ids (a CTC path must fit: see `infeasible`)
    -> the [start, end) frame span of each id on the most likely CTC path that emits exactly them
    (Viterbi forced alignment)."""
    T = log_probs.shape[0]
    labels, _ = AF.forced_align(log_probs[None].float().cpu(), torch.tensor([ids], dtype=torch.int32),
                                torch.tensor([T]), torch.tensor([len(ids)]), blank=blank)  # (1, T') id or blank
    spans = AF.merge_tokens(labels[0], torch.zeros(T), blank=blank)  # runs of one id, blanks dropped
    assert len(spans) == len(ids), f"{len(spans)} spans for {len(ids)} tokens"
    return [(sp.start, sp.end) for sp in spans]


@dataclass
class AEDConfig:
    """Model hyperparameters, saved in every checkpoint. Defaults are Canary-1B (24 + 24 layers)."""

    n_mels: int = 128  # log-mel bins of the input features; fixes the subsampling's output Linear
    vocab_size: int = 5248  # tokenizer's padded vocab (multiple of 8); Canary: 4 x 1024 BPE + 1152 specials
    pad_id: int = 1  # `<pad>` in aed/data_tokenizer.py's default layout; its embedding row gets no gradient
    # --- encoder (FastConformer)
    enc_d_model: int = 1024  # encoder width; 1024 for the 1B models, 512 for 180M-Flash
    enc_layers: int = 24  # Canary-1B 24; the Flash recipe moves capacity here (32)
    enc_heads: int = 8  # self-attention heads
    enc_ff_mult: int = 4  # FF inner width = enc_ff_mult * enc_d_model
    conv_kernel: int = 9  # depthwise conv kernel over encoder frames (FastConformer uses 9, not 31)
    conv_norm: str = "batch_norm"  # batch_norm (Canary, masked statistics) or layer_norm (batch-size independent)
    subsampling_channels: int = 256  # conv channels of the dw_striding subsampling
    subsampling_factor: int = 8  # feature frames per encoder frame: 8 (Canary, 80 ms) or 4 (40 ms: frames enough for CTC over characters)
    enc_xscaling: bool = False  # scale the subsampled input by sqrt(enc_d_model), as NeMo's xscaling (its default)
    # --- decoder (pre-LN Transformer)
    dec_d_model: int = 1024  # decoder width; an encoder_decoder_proj Linear appears when it differs from enc_d_model
    dec_layers: int = 24  # Canary-1B 24; the decoder dominates decode time, Flash uses 4
    dec_heads: int = 8  # self- and cross-attention heads
    dec_ff_mult: int = 4  # FFN inner width = dec_ff_mult * dec_d_model
    dec_max_len: int = 512  # positions in the fixed positional table: prompt + text + eos must fit
    # --- regularisation (NeMo's Canary values)
    enc_dropout: float = 0.1  # encoder residual branches and FF inner activations
    enc_dropout_pre_encoder: float = 0.1  # after subsampling
    enc_dropout_att: float = 0.1  # encoder attention probabilities
    dec_dropout: float = 0.1  # decoder embedding and sublayer outputs
    dec_dropout_att: float = 0.1  # decoder attention probabilities
    # --- loss
    label_smoothing: float = 0.0  # Canary trains without smoothing
    loss_on_prompt: bool = True  # NeMo also scores the prompt tokens after <|startoftranscript|>; False scores text + eos only
    ctc_loss_weight: float = 0.0  # > 0 adds a CTC head on the encoder: loss = CE + ctc_loss_weight * CTC (both summed); decoding's own weight is DecodingOptions.ctc_weight
    RENAMED = {"ctc_weight": "ctc_loss_weight"}  # old keys: an error in a config, read as the new one in a checkpoint (aed/model_checkpoint.py)

    def __post_init__(self):
        assert self.enc_d_model % self.enc_heads == 0, f"enc_d_model {self.enc_d_model} % enc_heads {self.enc_heads} != 0"
        assert self.dec_d_model % self.dec_heads == 0, f"dec_d_model {self.dec_d_model} % dec_heads {self.dec_heads} != 0"
        assert 0 <= self.pad_id < self.vocab_size, f"pad_id {self.pad_id} outside vocab_size {self.vocab_size}"
        assert self.subsampling_factor in SUBSAMPLING_FACTORS, \
            f"subsampling_factor must be one of {SUBSAMPLING_FACTORS}, got {self.subsampling_factor}"

    @classmethod
    def from_dict(cls, d: dict) -> "AEDConfig":
        """Build from a mapping (a YAML `model:` section); unknown keys and wrong types name the key."""
        return from_dict(cls, d, prefix="model.")

    @classmethod
    def from_yaml(cls, path) -> "AEDConfig":
        """The architecture a config file describes: its `model:` section, with n_mels from its
        `features:` section. The vocabulary stays Canary's (5248) unless the section sets it: a
        training run takes it from its tokenizer instead (aed/train_config.py)."""
        with open(path) as f:
            doc = yaml.safe_load(f) or {}
        if not isinstance(doc.get("model"), dict):
            raise ValueError(f"{path}: needs a top-level 'model:' mapping")
        n_mels = (doc.get("features") or {}).get("n_mels", cls.n_mels)
        return cls.from_dict({"n_mels": n_mels, **doc["model"]})

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def text_targets(tokens, token_lens, prompt_lens):
    """(B, U) prompt + text + EOS -> the text alone, left aligned: (B, U_text), (B,) lengths."""
    text_lens = token_lens - prompt_lens - 1
    pos = torch.arange(int(text_lens.max()), device=tokens.device)[None, :]  # (1, U_text)
    idx = (prompt_lens[:, None] + pos).clamp(max=tokens.shape[1] - 1)
    return tokens.gather(1, idx), text_lens


GUIDE_WIDTH = 0.2  # the diagonal band's width, in fractions of the text and of the audio (Tachibana et al.'s g)
GUIDE_FRAMES = 2.0  # the band's width around a token's CTC span, in encoder frames (a CTC peak may sit a frame off its sound)


def off_target_attention(weights: list, centers, width, mask):
    """The cross-attention weight far from where each decoder position should look, summed over the
    positions of `mask` and averaged over layers and heads: each position's weights times
    1 - exp(-(t - c)^2 / 2w^2), t a frame's centre and c the position's centre (in frames).

    weights: per layer (B, H, U-1, T'); centers (B, U-1) frames; width (B, 1) frames or a number;
    mask (B, U-1) bool: the positions that count."""
    w = torch.stack(weights).float().mean(dim=(0, 2))  # (L, B, H, U-1, T') -> (B, U-1, T')
    t = torch.arange(w.size(-1), device=w.device) + 0.5  # (T',)
    far = 1 - torch.exp(-(t[None, None, :] - centers[:, :, None]) ** 2 / (2 * width**2)[..., None])  # (B, U-1, T')
    return (w * far).sum(-1)[mask].sum()


def off_diagonal_attention(weights: list, scored, token_lens, prompt_lens, memory_lens, rows=None):
    """`off_target_attention` toward the diagonal, over the scored text positions of `rows` (B,)
    bool (None: every row): the n-th of N text tokens should be near n/N of the audio, with a band
    of GUIDE_WIDTH of the utterance. Read speech moves through both at a steady pace, so this is a
    gradient toward the right part of the audio from the first step, where one spread over all
    frames is too weak to find it in long utterances (docs/training.md). The band grows with the
    utterance: on long ones it points at a stretch of many tokens.

    weights: per layer (B, H, U-1, T'); scored (B, U-1) bool: the positions the loss scores.
    """
    u = weights[0].size(2) + 1
    text = (token_lens - prompt_lens).clamp(min=1)  # text + eos tokens
    # position i predicts token i + 1: the first text token comes from the last prompt position
    n = (torch.arange(u - 1, device=text.device)[None, :] - (prompt_lens[:, None] - 1) + 0.5) / text[:, None]  # (B, U-1)
    mask = scored & (n >= 0)  # text positions only (loss_on_prompt also scores the prompt)
    if rows is not None:
        mask &= rows[:, None]
    frames = memory_lens[:, None].float()  # (B, 1)
    return off_target_attention(weights, n * frames, GUIDE_WIDTH * frames, mask)


def off_alignment_attention(weights: list, log_probs, blank: int, tokens, token_lens, prompt_lens, memory_lens,
                            rows=None):
    """`off_target_attention` toward the CTC head's own alignment: the position that predicts a text
    token should look within GUIDE_FRAMES of that token's span on the most likely CTC path through
    the utterance's text (`ctc_spans`), a narrow band on utterances of any length. Rows (B,) bool
    (None: every row) that no CTC path fits are left out, as CTC leaves them out; so is EOS.

    log_probs (B, T', V) of the CTC head; tokens (B, U) prompt + text + EOS.
    """
    u = weights[0].size(2) + 1
    targets, text_lens = text_targets(tokens, token_lens, prompt_lens)
    use = ~infeasible(memory_lens, targets, text_lens) & (text_lens > 0)
    if rows is not None:
        use &= rows
    centers = torch.zeros(tokens.size(0), u - 1)
    mask = torch.zeros(tokens.size(0), u - 1, dtype=torch.bool)
    for b in use.nonzero().flatten().tolist():
        n, first = int(text_lens[b]), int(prompt_lens[b]) - 1  # position first + k predicts text token k
        spans = ctc_spans(log_probs[b, :int(memory_lens[b])].detach(), targets[b, :n].tolist(), blank)
        centers[b, first:first + n] = torch.tensor([(a + e) / 2 for a, e in spans])
        mask[b, first:first + n] = True
    device = weights[0].device
    return off_target_attention(weights, centers.to(device), torch.tensor(GUIDE_FRAMES, device=device),
                                mask.to(device))


def build_encoder(cfg: AEDConfig) -> ConformerEncoder:
    """The FastConformer encoder of `cfg`: the same module (and parameter names) under every objective."""
    return ConformerEncoder(
        cfg.n_mels, cfg.enc_d_model, cfg.enc_layers, cfg.enc_heads, cfg.enc_ff_mult, cfg.conv_kernel,
        cfg.conv_norm, cfg.subsampling_channels, cfg.enc_dropout, cfg.enc_dropout_pre_encoder, cfg.enc_dropout_att,
        cfg.enc_xscaling, cfg.subsampling_factor,
    )


class AED(nn.Module):
    def __init__(self, cfg: AEDConfig):
        super().__init__()
        self.cfg = cfg
        self.encoder = build_encoder(cfg)
        # Canary-180M-Flash: 512-wide encoder feeding a 1024-wide decoder.
        if cfg.enc_d_model != cfg.dec_d_model:
            self.encoder_decoder_proj = nn.Linear(cfg.enc_d_model, cfg.dec_d_model)
        else:
            self.encoder_decoder_proj = nn.Identity()
        self.decoder = TransformerDecoder(
            cfg.vocab_size, cfg.pad_id, cfg.dec_d_model, cfg.dec_layers, cfg.dec_heads, cfg.dec_ff_mult,
            cfg.dec_max_len, cfg.dec_dropout, cfg.dec_dropout_att,
        )
        # Auxiliary CTC on the encoder output over the text tokens (blank = the extra last id).
        self.ctc = CTCHead(cfg.enc_d_model, cfg.vocab_size + 1) if cfg.ctc_loss_weight > 0 else None
        # The weight of the guided-attention loss in training, and what it guides toward ("diagonal" or
        # "ctc": the CTC head's alignment); train.py sets them (train.attention_guide, attention_guide_to).
        self.attention_guide = 0.0
        self.guide_to = "diagonal"
        self.guide_heads = None  # how many heads of each layer the guide holds (None: all; train.attention_guide_heads)

    def encode(self, feats, feat_lens):
        """feats (B, T, F), feat_lens (B,) -> memory (B, T', D_dec), memory_lens (B,)."""
        x, x_lens = self.encoder(feats, feat_lens)
        return self.encoder_decoder_proj(x), x_lens

    def encode_with_ctc(self, feats, feat_lens):
        """`encode` plus the CTC head's log-probs (B, T', V + 1) of the same frames, or None without a
        head: what joint CTC/attention decoding needs. The head reads the encoder output before the
        projection to the decoder's width, as in training."""
        x, x_lens = self.encoder(feats, feat_lens)
        ctc_log_probs = self.ctc(x) if self.ctc is not None else None
        return self.encoder_decoder_proj(x), x_lens, ctc_log_probs

    def forward(self, feats, feat_lens, tokens, token_lens, prompt_lens, transcribed=None):
        """Summed next-token cross-entropy and its token count; the training script normalises.

        tokens (B, U) = prompt + text + eos, right-padded; token_lens (B,) and prompt_lens (B,) count them.
        transcribed (B,) bool: rows whose text is the spoken words; the CTC term learns from these
        only (None: every row). The decoder learns from every row.
        Targets are tokens[:, 1:]: with loss_on_prompt=False only the text and eos are scored.
        With `attention_guide` > 0 in training, that times `off_diagonal_attention` (or, guide_to "ctc",
        `off_alignment_attention`) on the transcribed rows joins the sum (a translation's words need
        not follow the audio's order).
        """
        b = tokens.size(0)
        assert token_lens.shape == (b,) and prompt_lens.shape == (b,), (
            f"token_lens {tuple(token_lens.shape)} / prompt_lens {tuple(prompt_lens.shape)} must be ({b},)"
        )
        enc, memory_lens = self.encoder(feats, feat_lens)  # (B, T', D_enc)
        memory = self.encoder_decoder_proj(enc)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]  # position i predicts token i+1
        weights = [] if self.attention_guide and self.training else None
        hidden = self.decoder(inputs, memory, memory_lens, weights)  # (B, U-1, D)
        is_target = self.target_mask(tokens, token_lens, prompt_lens)
        # Project only real targets: the vocab-sized logits of padded positions would be pure waste.
        logits = self.decoder.output_proj(hidden[is_target])  # (N, V)
        loss = F.cross_entropy(logits.float(), targets[is_target], label_smoothing=self.cfg.label_smoothing, reduction="sum")
        if self.ctc is not None:
            # Summed like the CE and divided by the same (decoder) target count in train.py, so the
            # effective CTC weight is ctc_loss_weight x (text tokens / decoder targets), slightly under it.
            ctc_sum, _ = self.ctc.loss(enc, memory_lens, *text_targets(tokens, token_lens, prompt_lens), transcribed)
            loss = loss + self.cfg.ctc_loss_weight * ctc_sum
        if weights is not None:
            weights = [w[:, :self.guide_heads] for w in weights]  # (B, H, U-1, T') -> the guided heads
            if self.guide_to == "ctc":
                with torch.no_grad():
                    log_probs = self.ctc(enc)  # (B, T', V)
                guide = off_alignment_attention(weights, log_probs, self.ctc.blank, tokens, token_lens, prompt_lens,
                                                memory_lens, transcribed)
            else:
                guide = off_diagonal_attention(weights, is_target, token_lens, prompt_lens, memory_lens, transcribed)
            loss = loss + self.attention_guide * guide
        return loss, is_target.sum()

    def target_mask(self, tokens, token_lens, prompt_lens):
        """(B, U-1) bool: the positions of tokens[:, :-1] whose next token the loss scores (with
        loss_on_prompt=False the text and eos: the first text token is predicted from the last prompt token)."""
        pos = torch.arange(tokens.size(1) - 1, device=tokens.device)[None, :]
        mask = pos < (token_lens - 1)[:, None]
        if not self.cfg.loss_on_prompt:
            mask &= pos >= (prompt_lens - 1)[:, None]
        return mask

    def token_nll(self, memory, memory_lens, tokens, token_lens, prompt_lens):
        """Per-row summed negative log-likelihood of the scored tokens given `memory` (no label
        smoothing), and their count: (B,), (B,). Validation scores each row with its own audio's memory
        and with another row's, to tell a decoder that listens from a language model (train_validation)."""
        hidden = self.decoder(tokens[:, :-1], memory, memory_lens)  # (B, U-1, D)
        mask = self.target_mask(tokens, token_lens, prompt_lens)
        rows = torch.arange(tokens.size(0), device=tokens.device)[:, None].expand_as(mask)[mask]  # (N,) row of each target
        nll = F.cross_entropy(self.decoder.output_proj(hidden[mask]).float(), tokens[:, 1:][mask], reduction="none")
        return torch.zeros(tokens.size(0), device=tokens.device).index_add_(0, rows, nll), mask.sum(1)

    def count_targets(self, batch):
        """Per-row number of scored tokens, as `forward` counts them (for global normalisation)."""
        return batch.token_lens - 1 if self.cfg.loss_on_prompt else batch.token_lens - batch.prompt_lens

    def new_cache(self, memory, memory_lens, max_len: int, rows_per_utterance: int = 1) -> KVCache:
        return self.decoder.new_cache(memory, memory_lens, max_len, rows_per_utterance)

    def decode_step(self, tokens, cache: KVCache):
        """Feed tokens (R, U) after the cached positions; fp32 logits (R, V) of the last position."""
        hidden = self.decoder.forward_cached(tokens, cache)
        return self.decoder.output_proj(hidden[:, -1]).float()


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW parameter groups: decay on weight matrices only, not on norms, biases or the
    relative position biases (NeMo's Canary recipe). Works for any of our models."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.dim() >= 2 and "pos_bias" not in name else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())  # tied weights are counted once


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", nargs="+", metavar="CONFIG", required=True, help="YAML files with a model: section")
    args = parser.parse_args()
    print(f"{'config':40s} {'encoder':>14s} {'decoder':>14s} {'total':>15s}")
    for path in args.count:
        cfg = AEDConfig.from_yaml(path)
        with torch.device("meta"):  # shapes only: a 1B model costs no memory or init time
            model = AED(cfg)
        enc = count_parameters(model.encoder) + count_parameters(model.encoder_decoder_proj)
        total = count_parameters(model)
        print(f"{path:40s} {enc:>14,d} {total - enc:>14,d} {total:>15,d}")


if __name__ == "__main__":
    main()
