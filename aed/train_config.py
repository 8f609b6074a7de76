"""The training run's configuration (train.py, oom.py): TrainConfig and its section dataclasses, and
the objectives its `objective` key picks from (`OBJECTIVES`).

    cfg = load_train_config("configs/tiny.yaml", ["optim.lr=1e-3", "train.manifests=[a.jsonl]"])
    cfg = load_train_config(["configs/canary-1b.yaml", "buckets.yaml"])   # later files win (oom.py --out)
    cfg, val_names = parse_config(["configs/tiny.yaml", "buckets.yaml", "max_steps=500"])   # train.py's argv

aed/config.py does the loading: dataclass defaults, then the YAML file(s), then
`key=value` overrides, with unknown keys and values of the wrong type as errors that name the
key. Each field's trailing comment is its description: `train.py --help` prints it (`help_text`),
so the comment next to the default is the one place a key is documented. Validation's decoding
options, the val.decoding section, are aed.decode_search.DecodingOptions itself: infer.py's
decoding flags, documented there.

The model section describes the architecture only. Three of its fields have another source:
`n_mels` is `features.n_mels`, and `vocab_size` / `pad_id` come from the tokenizer
(`resolve_model`); a config that sets them is rejected, so they can never disagree. So is
`val.decoding.frame_seconds`, which the model sets (`DERIVED`).

The three training objectives sit side by side in `OBJECTIVES`: what `objective=...` changes.

    objective = OBJECTIVES[cfg.objective]
    model = objective.build(cfg, tokenizer.vocab_size)
    hyps = objective.hypotheses(model, batch, tokenizer.eos, options, amp)  # None for ssl: loss only

Everything else (the training step, the target count, checkpoints) is the same for all three:
every model takes the AED's batch and returns (summed loss, target count), and
`model.count_targets(batch)` counts what its loss scores. The encoder and its parameter names are
shared, so an rnnt- or ssl-pretrained encoder loads into an AED (`init_from`, `init_encoder_only`).
"""

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from aed.config import ConfigError, describe, dotted_keys, from_dict, help_table, merged_dict, user_dict
from aed.data_augment import CODECS
from aed.data_audio import FeatureConfig, SpecAugmentConfig
from aed.data_manifest import DURATION_TOLERANCE
from aed.data_sources import ManifestEntry
from aed.decode_metrics import NORMALIZERS
from aed.decode_search import DecodingOptions, decode_features
from aed.model import AED, AEDConfig
from aed.model_ssl import BestRQ, SSLConfig
from aed.model_transducer import TransducerASR
from aed.train_distributed import STRATEGIES


FREEZE = ("none", "encoder", "all_but_new_tokens")  # TrainConfig.freeze (aed/train_setup.py: build_model)
CHECKPOINTED = ("none", "encoder", "decoder", "both")  # TrainConfig.activation_checkpointing: which layers recompute


# --- the objectives: what objective=... changes -------------------------------------------------


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


# --- the training run ---------------------------------------------------------------------------


@dataclass
class TrainSection:
    """The `train:` section: what is trained on and how it is batched, curricula, data workers, and
    how the ranks share the model."""

    manifests: list[dict | str] = field(default_factory=lambda: ["data/mini/train.jsonl"])  # paths, {path, weight, dataset, language}, non-speech {path, nonspeech: true, rate}, or streamed: {shards: DIR}, {shar: DIR}, a NeMo tarred set, {parquet: GLOB} (aed/data_sources.py)
    tokenizer: str = "data/mini/tokenizer"  # directory written by tools/train_tokenizer.py; sets the model's vocabulary
    skip_invalid: bool = True  # bad manifest lines are skipped with a warning and counted, not fatal
    check_audio: bool = True  # read every audio header at start (docs/data.md has its speed): unreadable files and wrong durations are skipped
    duration_tolerance: float = DURATION_TOLERANCE  # an utterance whose audio is longer or shorter than its duration by more than this fraction is skipped and counted (at start with check_audio, and when decoded)
    bins: str | None = None  # bins.json from tools/estimate_bins.py; None: estimated at start
    num_buckets: int = 30  # duration buckets when estimating bins (the paper: 30)
    sub_buckets: int = 2  # token sub-buckets per duration bucket, on average (2 = the paper's 2D; 1 = 1D)
    bin_method: str = "optimised"  # 2D bins: optimised (least padded compute) | equal (the paper's equal-count)
    batch_size: int | None = None  # fixed batch size (the padding-heavy baseline)
    max_duration: float | None = 360.0  # padded seconds of audio per batch (Canary: 360)
    batch_sizes: str | None = None  # per-bucket batch sizes from oom.py (replaces the two above)
    allocation: str = "flexible"  # flexible: smallest bucket that fits | strict: drop what its sub-bucket can't hold
    min_tps: float | None = None  # drop examples below this many output tokens per second
    max_tps: float | list[float] | None = None  # ... and above this (the paper filters at 25); a list: one per duration bin (oom.py --out writes the bins' own)
    buffer_size: int = 20000  # examples held by the bucketing buffer
    buffer_overfill: float = 4.0  # read on up to this x the buffer for the bucket all ranks drew (1: the paper's)
    sync_buckets: bool = True  # same bucket on every rank each step (removes the tail-worker effect)
    sortagrad: bool = False  # first pass over the data from the shortest bucket to the longest (a curriculum)
    short_first: list[float] | None = None  # [seconds, steps]: the first steps train only on utterances up to that long, passing over them repeatedly (a curriculum; in-memory manifests; docs/training.md)
    attention_guide: list[float] | None = None  # [weight, steps]: for the first steps, a loss on cross-attention far from the text/audio diagonal (guided attention; objective aed; docs/training.md)
    attention_guide_to: str = "diagonal"  # where attention_guide points each token: diagonal (its place n/N in the audio) | ctc (its span in the CTC head's forced alignment; needs model.ctc_loss_weight > 0)
    attention_guide_heads: int | None = None  # guide only the first this many heads of each cross-attention layer, leaving the others free to look anywhere (None: every head)
    attention_guide_ramp: int = 0  # steps over which the guide's weight rises linearly from 0 to its full value (0: full from the first step)
    attention_guide_until: str = "steps"  # steps: the guide lasts its steps | listening: it also ends at the first check (every 50 steps) where the decoder uses the audio of its training batch (aed/train_guide.py)
    decoder_restarts: int = 1  # attention_guide_until=listening: a decoder still deaf when the guide's steps end is restarted (fresh weights on the encoder trained so far) and guided again this many times; then the run stops, saying what it measured
    trim_silence: float | None = None  # cut each training and validation utterance to this many seconds of silence before its first and after its last speech frame (energy-based, as inference finds speech; NeMo's trim_silence); None: as read. Long, varied edge silence kept a small model's encoder from learning (docs/training.md)
    speed_perturb: list[float] = field(default_factory=list)  # e.g. [0.9, 1.0, 1.1]: every utterance once at each speed (Kaldi, ESPnet, icefall); in-memory manifests
    mix_temperature: float | None = None  # balance sources and languages: each (dataset, language) group of train.manifests gets a share of the audio proportional to hours^(1/T); 1: natural proportions, .inf: uniform; None: the entries' weights (aed/data_mixing.py)
    mix_log_every: int = 100000  # streamed sources: examples between log lines of the realised mix (in-memory manifests: one line per pass)
    lm_order: int = 0  # count an n-gram of this order over the training manifests' transcripts into run_dir/lm.pt at start, which infer.py's beam search of this run's models then fuses (aed/decode_lm.py; in-memory manifests); 0: none. Off by default: it is counted in Python, seconds per ten thousand transcripts and in proportion for more, and it helps a decoder trained on too little text to spell (configs/laptop.yaml)
    num_workers: int = 2  # DataLoader workers decoding audio and computing features
    strategy: str = "ddp"  # ddp: every rank holds the whole model and optimizer | fsdp: FSDP2 shards parameters, gradients and AdamW state over the ranks (aed/train_distributed.py); on one process, over a group of one
    reshard_after_forward: bool = True  # fsdp: free each layer's gathered parameters after its forward (less memory; false: one all-gather less per layer)

    def __post_init__(self):
        if self.strategy not in STRATEGIES:
            raise ConfigError(f"train.strategy: expected one of {', '.join(STRATEGIES)}, got {self.strategy!r}")
        if self.allocation not in ("flexible", "strict"):
            raise ConfigError(f"train.allocation: expected flexible or strict, got {self.allocation!r}")
        if self.bin_method not in ("optimised", "equal"):
            raise ConfigError(f"train.bin_method: expected optimised or equal, got {self.bin_method!r}")
        if self.short_first is not None and (len(self.short_first) != 2 or self.short_first[0] <= 0
                                             or self.short_first[1] != int(self.short_first[1]) or self.short_first[1] < 1):
            raise ConfigError(f"train.short_first: expected [seconds > 0, steps >= 1], got {self.short_first}")
        if self.attention_guide is not None and (len(self.attention_guide) != 2 or self.attention_guide[0] <= 0
                                                 or self.attention_guide[1] != int(self.attention_guide[1])
                                                 or self.attention_guide[1] < 1):
            raise ConfigError(f"train.attention_guide: expected [weight > 0, steps >= 1], got {self.attention_guide}")
        if self.lm_order < 0:
            raise ConfigError(f"train.lm_order: expected >= 1, or 0 for no n-gram, got {self.lm_order}")
        if self.attention_guide_to not in ("diagonal", "ctc"):
            raise ConfigError(f"train.attention_guide_to: expected diagonal or ctc, got {self.attention_guide_to!r}")
        if self.attention_guide_heads is not None and self.attention_guide_heads < 1:
            raise ConfigError(f"train.attention_guide_heads: expected >= 1 or null, got {self.attention_guide_heads}")
        if self.attention_guide_ramp < 0:
            raise ConfigError(f"train.attention_guide_ramp: expected >= 0 steps, got {self.attention_guide_ramp}")
        if self.attention_guide_until not in ("steps", "listening"):
            raise ConfigError(f"train.attention_guide_until: expected steps or listening, got {self.attention_guide_until!r}")
        if self.trim_silence is not None and self.trim_silence < 0:
            raise ConfigError(f"train.trim_silence: expected >= 0 seconds or null, got {self.trim_silence}")
        if self.decoder_restarts < 0:
            raise ConfigError(f"train.decoder_restarts: expected >= 0, got {self.decoder_restarts}")
        if any(not 0.5 <= f <= 2.0 or abs(100 * f - round(100 * f)) > 1e-6 for f in self.speed_perturb):
            raise ConfigError(f"train.speed_perturb: factors between 0.5 and 2 in steps of 0.01, got {self.speed_perturb}")
        if self.mix_temperature is not None and not self.mix_temperature > 0:
            raise ConfigError(f"train.mix_temperature: a positive number (1: natural proportions), got {self.mix_temperature}")


@dataclass
class AugmentConfig:
    """The `augment:` section (aed/data_augment.py, docs/training.md): changes of the training
    audio, each applied to an utterance with its probability, its strength drawn uniformly from its
    range, in the DataLoader workers (training data only); every probability 0 (off) by default.
    configs/tiny.yaml varies the edges from its 300th batch on (docs/training.md, "Varied edges");
    from the first, they slow a small model's learning several-fold."""

    edge_prob: float = 0.0  # chance an utterance's leading and trailing silence change, each side by its own draw from edge_seconds
    edge_seconds: tuple[float, float] = (-0.5, 0.5)  # the change at each edge in seconds: below 0 crops the silence the utterance holds there (never its speech), above 0 adds silence; batches count the most it adds (added_seconds)
    edge_floor_prob: float = 0.5  # chance added silence is the recording's own floor (the non-speech at its edges, looped) rather than digital zeros
    edge_after: int = 0  # sampler batches (a rank's micro-batches: steps x gradient accumulation) that hear the edges as read before they vary: a small model learns to listen first, where its words sit at predictable times
    reverb_prob: float = 0.0  # chance an utterance is convolved with a room impulse response (direct path kept at time 0, level kept)
    rir_manifests: list[str] = field(default_factory=list)  # JSONL manifests of room impulse responses (audio_filepath, duration): tools/make_noise.py generate writes simulated ones
    noise_prob: float = 0.0  # chance an utterance gets additive noise
    noise_manifests: list[str] = field(default_factory=list)  # JSONL manifests of noise recordings (audio_filepath, duration[, offset]): MUSAN's, or tools/make_noise.py generate's; looped and cut at a random offset
    snr_db: tuple[float, float] = (0.0, 20.0)  # signal-to-noise ratio in dB, over the whole utterance
    gain_prob: float = 0.0  # chance of a level change; per-utterance feature normalisation removes a gain, so it acts only through the codecs after it
    gain_db: tuple[float, float] = (-12.0, 6.0)  # the level change in dB
    clip_prob: float = 0.0  # chance of hard clipping (an overdriven recording)
    clip_level: tuple[float, float] = (0.1, 0.5)  # clipping threshold as a fraction of the utterance's peak
    lowpass_prob: float = 0.0  # chance of a low-pass, by resampling down to twice the cutoff and back up
    lowpass_hz: tuple[float, float] = (2000.0, 6000.0)  # the cutoff in Hz (below half features.sample_rate)
    codec_prob: float = 0.0  # chance of a codec, one of `codecs` picked uniformly
    codecs: list[str] = field(default_factory=lambda: ["telephone", "mulaw"])  # telephone: 300 Hz high-pass, 8 kHz, G.711 mu-law | mulaw: 8-bit mu-law at the training rate | mp3, opus: encoded and decoded in memory by libsndfile
    codec_level: tuple[float, float] = (0.5, 0.95)  # mp3/opus: libsndfile's compression level (0: highest bitrate, 1: lowest; opus at 16 kHz spans ~250 to ~9 kbit/s, mp3 ~70 to ~25)
    cache_mb: int = 256  # per DataLoader worker: decoded noise and RIRs kept in memory (the least recently used dropped first)

    def __post_init__(self):
        for name in ("edge_prob", "edge_floor_prob", "reverb_prob", "noise_prob", "gain_prob", "clip_prob",
                     "lowpass_prob", "codec_prob"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(f"augment.{name}: a probability in [0, 1], got {getattr(self, name)}")
        for name in ("edge_seconds", "snr_db", "gain_db", "clip_level", "lowpass_hz", "codec_level"):
            bounds = getattr(self, name)
            if len(bounds) != 2 or bounds[0] > bounds[1]:
                raise ConfigError(f"augment.{name}: expected [low, high] with low <= high, got {list(bounds)}")
        if not (0 < self.clip_level[0] and self.clip_level[1] <= 1):
            raise ConfigError(f"augment.clip_level: fractions of the peak in (0, 1], got {list(self.clip_level)}")
        if not (0 <= self.codec_level[0] and self.codec_level[1] <= 1):
            raise ConfigError(f"augment.codec_level: compression levels in [0, 1], got {list(self.codec_level)}")
        if self.edge_after < 0:
            raise ConfigError(f"augment.edge_after: a number of batches >= 0, got {self.edge_after}")
        if self.lowpass_hz[0] <= 0:
            raise ConfigError(f"augment.lowpass_hz: cutoffs above 0 Hz, got {list(self.lowpass_hz)}")
        if unknown := sorted(set(self.codecs) - set(CODECS)):
            raise ConfigError(f"augment.codecs: {unknown} unknown; expected some of {', '.join(CODECS)}")
        if self.codec_prob > 0 and not self.codecs:
            raise ConfigError("augment.codec_prob > 0 needs at least one of augment.codecs")
        for prob, manifests in (("reverb_prob", "rir_manifests"), ("noise_prob", "noise_manifests")):
            if getattr(self, prob) > 0 and not getattr(self, manifests):
                raise ConfigError(f"augment.{prob} > 0 needs augment.{manifests} (tools/make_noise.py generate "
                                  "writes a set)")

    @property
    def enabled(self) -> bool:
        return any(p > 0 for p in (self.edge_prob, self.reverb_prob, self.noise_prob, self.gain_prob,
                                   self.clip_prob, self.lowpass_prob, self.codec_prob))

    @property
    def added_seconds(self) -> float:
        """The most audio the edges add to one utterance: bucket shapes (compiled padding, the
        OOMptimizer's measured batches, train.py's preflight) count it beyond the bucket's duration."""
        return 2 * max(0.0, self.edge_seconds[1]) if self.edge_prob > 0 else 0.0


@dataclass
class ValConfig:
    manifests: list[dict | str] = field(default_factory=lambda: ["data/mini/dev.jsonl"])  # validation sets, scored separately: manifest paths or any train.manifests entry ({shar: DIR}, a NeMo tarred set, {parquet: GLOB}, ...)
    every: int = 500  # validate every N steps (and before step 1 and at the end); 0: never
    batch_duration: float = 300.0  # padded seconds of audio per decoding batch (batch size x longest)
    max_utterances: int | None = None  # validate on the first N utterances of each manifest only
    num_examples: int = 4  # transcripts shown in the log and TensorBoard
    normalizer: str = "simple"  # WER text normaliser: simple (case, punctuation) | whisper (the leaderboards', aed/decode_metrics.py)
    compile: bool = False  # decode with a compiled decoder step (aed/model_static.py; infer.py --compile): the same tokens, compiled at the first validation; pays on GPUs
    decoding: DecodingOptions = field(default_factory=DecodingOptions)  # how validation decodes: infer.py's decoding flags as keys (--beam-size: val.decoding.beam_size), with their defaults
    RENAMED = {"ctc_weight": "decoding.ctc_weight"}  # old keys a config gives an error for, naming the new one

    def __post_init__(self):
        if self.normalizer not in NORMALIZERS:
            raise ConfigError(f"val.normalizer: expected one of {NORMALIZERS}, got {self.normalizer!r}")


@dataclass
class OptimConfig:
    lr: float = 3e-4  # peak learning rate (Canary)
    betas: tuple[float, float] = (0.9, 0.98)  # AdamW's moment decay rates
    weight_decay: float = 1e-3  # AdamW weight decay on matrices (not on norms, biases, position biases)
    warmup_steps: int = 2500  # linear warmup, then the decay of `schedule`
    schedule: str = "inverse_sqrt"  # decay after warmup: inverse_sqrt (Noam, Canary's) | cosine (half a cosine down to min_lr at max_steps; raising max_steps on resume raises the lr again, and a run stopped by budget_flops never anneals)
    min_lr: float = 1e-6  # floor of the decay
    clip_grad: float = 1.0  # max gradient norm
    grad_accum: int = 1  # micro-batches per optimizer step
    fused: bool = True  # AdamW's fused kernel: one pass over each tensor's weights, gradient and moments, where torch's default takes several

    def __post_init__(self):
        if self.schedule not in ("inverse_sqrt", "cosine"):
            raise ConfigError(f"optim.schedule: expected inverse_sqrt or cosine, got {self.schedule!r}")


@dataclass
class TrainConfig:
    run_dir: str = "runs/tiny"  # checkpoints, metrics.jsonl, TensorBoard events, resolved config
    seed: int = 0  # data order, initialisation, dropout and SpecAugment
    objective: str = "aed"  # aed: encoder-decoder cross-entropy | rnnt: encoder + transducer (encoder pretraining) | ssl: BEST-RQ on audio alone (encoder pretraining, section ssl)
    rnnt_chunk_size: int = 4  # rnnt: samples per joint tensor (1 = least memory, B = batched speed)
    rnnt_pred_dim: int = 640  # rnnt: predictor width (NeMo's default)
    rnnt_joint_dim: int = 640  # rnnt: joint width; the (B, T', U+1, H) joint dominates a small model's step
    max_steps: int = 100000  # optimizer steps of the whole run
    budget_flops: float | None = None  # stop (and checkpoint) once training has spent this many FLOPs, all ranks together (aed/train_progress.py)
    log_every: int = 10  # steps between progress lines
    ckpt_every: int = 1000  # steps between checkpoints (and at the end, and on SIGTERM/SIGUSR1)
    keep_last: int = 3  # checkpoints kept in run_dir
    async_checkpoint: bool = True  # write checkpoints in the background: the loop waits only for the copy of the state (torch.distributed.checkpoint.async_save)
    precision: str = "auto"  # auto (bf16 on GPU, fp32 on CPU) | fp32 | bf16 | fp16
    compile: bool = False  # torch.compile every encoder layer and decoder block for training, each batch padded to its bucket's bounds (one shape per bucket; aed/train_setup.py compile_layers; docs/training.md has its cost and gain)
    activation_checkpointing: str = "none"  # none | encoder | decoder | both: recompute these layers in backward instead of keeping their activations (less memory, more compute; docs/training.md)
    init_from: str | None = None  # initialise weights from this checkpoint (a fresh run, new optimizer)
    init_encoder_only: bool = False  # with init_from: only encoder weights; extra layers stay random
    freeze: str = "none"  # none | encoder: it runs as at inference (fixed weights and BatchNorm statistics, no dropout); decoder and CTC head train | all_but_new_tokens: only the rows tools/add_language.py added to init_from (embedding/output/CTC) train
    ema_decay: float | None = None  # e.g. 0.9999: keep an exponential moving average of the weights (fp32, sharded like them), saved in checkpoints, scored by validation and decoded by infer.py --ema (aed/train_setup.py); None: off
    max_bad_steps: int = 5  # abort after this many consecutive non-finite steps
    memory_budget: str | None = None  # e.g. "75GB": before step 0 run every bucket's worst batch once (oom.py)
    cpu_threads: int | None = None  # CPU training: torch threads; None = cores - DataLoader workers
    model: AEDConfig = field(default_factory=AEDConfig)  # architecture (aed/model.py)
    features: FeatureConfig = field(default_factory=FeatureConfig)  # log-mel features (aed/data_audio.py)
    spec_augment: SpecAugmentConfig = field(default_factory=SpecAugmentConfig)  # masking in training
    augment: AugmentConfig = field(default_factory=AugmentConfig)  # degradations of the training audio: noise, reverberation, codecs (aed/data_augment.py)
    train: TrainSection = field(default_factory=TrainSection)  # training data, batching and parallelism
    val: ValConfig = field(default_factory=ValConfig)  # validation
    optim: OptimConfig = field(default_factory=OptimConfig)  # optimizer and schedule
    ssl: SSLConfig = field(default_factory=SSLConfig)  # objective=ssl: masking and random-projection targets (aed/model_ssl.py)

    def __post_init__(self):
        if self.objective not in OBJECTIVES:
            raise ConfigError(f"objective: expected one of {', '.join(OBJECTIVES)}, got {self.objective!r}")
        if self.freeze not in FREEZE:
            raise ConfigError(f"freeze: expected one of {FREEZE}, got {self.freeze!r}")
        if self.freeze == "all_but_new_tokens" and (self.objective != "aed" or not self.init_from
                                                    or self.init_encoder_only):
            raise ConfigError("freeze=all_but_new_tokens needs objective=aed, init_from=<the checkpoint "
                              "tools/add_language.py wrote> and init_encoder_only=false: it trains the token rows "
                              "add_language.py added to that checkpoint")
        if self.train.attention_guide and self.objective != "aed":
            raise ConfigError(f"train.attention_guide guides the decoder's cross-attention: objective=aed only "
                              f"(got objective={self.objective})")
        if self.train.attention_guide and self.train.attention_guide_to == "ctc" and not self.model.ctc_loss_weight > 0:
            raise ConfigError("train.attention_guide_to=ctc guides toward the CTC head's alignment: it needs "
                              f"model.ctc_loss_weight > 0 (got {self.model.ctc_loss_weight})")
        if (self.train.attention_guide_heads or 0) > self.model.dec_heads:
            raise ConfigError(f"train.attention_guide_heads={self.train.attention_guide_heads}: the decoder has "
                              f"model.dec_heads={self.model.dec_heads} heads per layer")
        if self.activation_checkpointing not in CHECKPOINTED:
            raise ConfigError(f"activation_checkpointing: expected one of {', '.join(CHECKPOINTED)}, "
                              f"got {self.activation_checkpointing!r}")
        if self.ema_decay is not None and not 0.0 < self.ema_decay < 1.0:
            raise ConfigError(f"ema_decay: expected a value between 0 and 1 (e.g. 0.9999) or null, "
                              f"got {self.ema_decay}")
        if self.precision not in ("auto", "fp32", "bf16", "fp16"):
            raise ConfigError(f"precision: expected auto, fp32, bf16 or fp16, got {self.precision!r}")


# Fields whose value comes from elsewhere, and where: the model's, and the decoding options the model sets.
DERIVED = {"model.n_mels": "features.n_mels", "model.vocab_size": "the tokenizer (train.tokenizer)",
           "model.pad_id": "the tokenizer (train.tokenizer)"} | {
    f"val.decoding.{f.name}": f.metadata["set_from"] for f in dataclasses.fields(DecodingOptions)
    if "set_from" in f.metadata}


def load_train_config(yaml_path: str | list[str] | None = None, overrides: list[str] = ()) -> TrainConfig:
    """A train.py run's config: TrainConfig defaults < YAML file(s), in order < overrides;
    model.n_mels follows the features (vocab_size and pad_id follow the tokenizer once it is
    loaded: `resolve_model`)."""
    d = merged_dict(TrainConfig, yaml_path, overrides)
    given = dotted_keys(user_dict(yaml_path, overrides))
    for key, source in DERIVED.items():
        if key in given:
            raise ConfigError(f"{key} is set from {source}; remove it from the config")
    cfg = from_dict(TrainConfig, d)
    cfg.model = dataclasses.replace(cfg.model, n_mels=cfg.features.n_mels)
    return cfg


def resolve_model(cfg: TrainConfig, tokenizer) -> TrainConfig:
    """The config with the model's vocabulary taken from `tokenizer` (aed.data_tokenizer.Tokenizer)."""
    model = dataclasses.replace(cfg.model, vocab_size=tokenizer.padded_vocab_size, pad_id=tokenizer.pad)
    return dataclasses.replace(cfg, model=model)


def help_text() -> str:
    """train.py --help: every TrainConfig key with its type, default and description."""
    notes = {key: f"set from {source}" for key, source in DERIVED.items()}
    return help_table(describe(TrainConfig, notes))


def parse_config(argv: list[str]) -> tuple[TrainConfig, dict]:
    """train.py's arguments, `CONFIG.yaml [MORE.yaml ...] [key=value ...]` -> its TrainConfig and
    validation sets by name (`val_set_names`); later files override earlier ones (e.g. oom.py
    --out's buckets)."""
    files = next((i for i, a in enumerate(argv) if "=" in a), len(argv))  # the YAML files come first
    cfg = load_train_config(argv[:files], argv[files:])
    return cfg, val_set_names(cfg.val.manifests)


def val_set_names(specs: list) -> dict:
    """Metric prefix -> ManifestEntry per validation set (val.manifests): its file stem, or
    folder_stem when stems repeat (data/mini/dev.jsonl and data/mini/digits/dev.jsonl -> mini_dev,
    digits_dev). A Shar or shard directory is named by the directory, a NeMo set or parquet files by
    the folder that holds them."""
    entries = [ManifestEntry.of(spec) for spec in specs]
    paths = [named_path(entry) for entry in entries]
    stems = [os.path.splitext(os.path.basename(p))[0] for p in paths]
    names = [f"{os.path.basename(os.path.dirname(os.path.abspath(p)))}_{s}" if stems.count(s) > 1 else s
             for p, s in zip(paths, stems)]
    if len(set(names)) < len(names):
        raise ConfigError(f"val.manifests need distinct file or folder names, got {paths}")
    return dict(zip(names, entries))


def named_path(entry: ManifestEntry) -> str:
    """The path that names a validation entry: its manifest or directory, or the folder of its files."""
    if entry.kind in ("shar", "shards", "manifest"):
        return os.path.normpath(entry.location)
    return os.path.dirname(os.path.abspath(entry.location))  # nemo: its tars' pattern; parquet: its glob
