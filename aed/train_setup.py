"""What a training run is made of, built from its config in one place for train.py and oom.py
(`TrainingSetup`), the average of its weights (`ExponentialMovingAverage`), and the training step
run on it (`train_step`).

    setup = build_training_setup(cfg, device)    # the run's tokenizer, model, optimizer, schedule, precision
    setup.model, setup.optimizer, setup.scheduler, setup.scaler, setup.spec_augment
    ema = ExponentialMovingAverage(setup.model, cfg.ema_decay)   # with ema_decay: the weights' average
    shapes = setup.bucket_shapes(bins)           # the OOMptimizer's bucket bounds for this run
    result = train_step(setup.model, [batch], setup.optimizer, setup.scaler, setup.spec_augment, "bf16",
                        clip_grad=1.0, num_targets=count_targets(setup.model, [batch]))

The tokenizer sets the model's vocabulary, and the objective which model is built
(aed/train_config.py: OBJECTIVES). train.py runs `train_step` every step; oom.py runs the same function on
artificial batches to measure its memory (aed.memory_oomptimizer.TrainingStep), so the memory it
finds is the memory of the real step by construction. Nothing here knows about processes: the
caller passes the global target count and world size.
"""

import logging
import math
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, distribute_tensor

from aed.config import ConfigError
from aed.data_audio import SpecAugment
from aed.train_data import bucket_shapes
from aed.data_tokenizer import Tokenizer
from aed.model import AED, infeasible, param_groups, text_targets
from aed.model_checkpoint import Checkpoint, CheckpointError, read_checkpoint
from aed.model_encoder import subsampled_length
from aed.train_config import OBJECTIVES, Objective, OptimConfig, TrainConfig, load_train_config, resolve_model
from aed.train_distributed import is_distributed, peer_lost, shard, world_size
from bins import Bins


log = logging.getLogger(__name__)

AMP_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_precision(precision: str, device: torch.device) -> str:
    """`auto` -> bf16 autocast on CUDA, fp32 elsewhere; explicit choices are kept."""
    if precision == "auto":
        return "bf16" if torch.device(device).type == "cuda" else "fp32"
    if precision not in AMP_DTYPES:
        raise ValueError(f"precision: expected auto or one of {list(AMP_DTYPES)}, got {precision!r}")
    return precision


def autocast(device: torch.device, precision: str):
    dtype = AMP_DTYPES[precision]
    return torch.autocast(torch.device(device).type, dtype=dtype) if dtype else nullcontext()


def new_tokens(cfg: TrainConfig, vocab_size: int) -> dict | None:
    """The tokens tools/add_language.py appended to `cfg.init_from`, as it recorded them there
    ({language, first, language_token, vocab_size}: ids >= first and the language token are new),
    or None. freeze=all_but_new_tokens trains exactly these rows, so the record is read from the
    checkpoint, never typed by hand; it must belong to the training tokenizer (`vocab_size` ids),
    else ConfigError: the rows would be another tokenizer's."""
    try:
        record = Checkpoint.from_dict(read_checkpoint(cfg.init_from)).new_tokens if cfg.init_from else None
    except CheckpointError as e:
        raise ConfigError(f"init_from: {e}") from None
    if cfg.freeze != "all_but_new_tokens":
        return record if record is not None and record["vocab_size"] == vocab_size else None
    if record is None:
        raise ConfigError(f"freeze=all_but_new_tokens: init_from={cfg.init_from} records no added tokens; "
                          f"use the checkpoint tools/add_language.py wrote (or a train.py run started from it)")
    if record["vocab_size"] != vocab_size:
        raise ConfigError(f"freeze=all_but_new_tokens: init_from={cfg.init_from} added {record['language']!r} to a "
                          f"tokenizer of {record['vocab_size']} ids, but train.tokenizer={cfg.train.tokenizer} has "
                          f"{vocab_size}: train with the tokenizer directory add_language.py wrote beside it")
    return record


def build_model(cfg: TrainConfig, text_vocab_size: int, added_tokens: dict | None = None) -> nn.Module:
    """The model `cfg.objective` trains (aed/train_config.py: OBJECTIVES), with the run's activation
    checkpointing and `freeze` applied. text_vocab_size: the tokenizer's real ids.
    added_tokens: `new_tokens(cfg, ...)`, required by freeze=all_but_new_tokens."""
    model = OBJECTIVES[cfg.objective].build(cfg, text_vocab_size)
    model.encoder.checkpoint_activations = cfg.activation_checkpointing in ("encoder", "both")
    if cfg.activation_checkpointing in ("decoder", "both"):
        if not hasattr(model, "decoder"):
            raise ConfigError(f"activation_checkpointing={cfg.activation_checkpointing}: objective={cfg.objective} "
                              f"has no transformer decoder; use encoder")
        model.decoder.checkpoint_activations = True
    if cfg.freeze == "encoder":  # no gradients: AdamW skips the parameters (see train_mode for the rest)
        model.encoder.requires_grad_(False)
    elif cfg.freeze == "all_but_new_tokens":
        if added_tokens is None:
            raise ValueError("freeze=all_but_new_tokens needs the added tokens (aed.train_setup.new_tokens)")
        train_only_rows(model, added_tokens)
    return model


def compile_layers(model: nn.Module, shapes: int = 0, backend: str = "inductor") -> int:
    """torch.compile the forward of every encoder layer and decoder block, as torchtitan compiles
    per block: the blocks hold nearly all of a step's compute, while what sits between them (length
    arithmetic on the host, masks, the losses) would break a whole-model graph into pieces. Shapes
    are marked dynamic (batch, frames, tokens) and the layers of a stack share one graph, which on
    the CPU serves every length as long as no block holds a convolution (inductor fixes the length
    of a convolution's backward; docs/training.md). train.py still pads every batch to its bucket's bounds
    (`compiled_shapes`), so that the shapes stay a finite set where one graph per length has not
    been shown (GPUs: tests/test_cuda.py checks it): `shapes`, the number of buckets, is how many
    graphs a block may then need, and torch's recompile limit is raised to hold them all. A block
    runs compiled in train mode only: validation's batches have other shapes, and would use up that
    limit. Replacing `forward` on the instance keeps the module itself, so state_dict keys, FSDP's
    hooks around each block and activation checkpointing stay as they are. Returns the number of
    blocks compiled.
    `backend`: torch.compile's (the tests' aot_eager traces the same graphs without generating code)."""
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, shapes + 1)  # + the first, dynamic, graph
    # The backward recomputes views of saved tensors instead of saving what is computed from them:
    # otherwise a ReLU over (B, U, 4D) rows that the next product reads as (B * U, 4D) saves its
    # boolean mask besides its output, a store inductor's CPU code is slow at (docs/training.md).
    torch._functorch.config.recompute_views = True
    blocks = [*model.encoder.layers, *(model.decoder.layers if hasattr(model, "decoder") else [])]
    for block in blocks:
        compile_in_train_mode(block, backend)
    return len(blocks)


def compile_in_train_mode(block: nn.Module, backend: str) -> None:
    eager, compiled = block.forward, torch.compile(block.forward, dynamic=True, backend=backend)

    def forward(*args, **kwargs):
        return (compiled if block.training else eager)(*args, **kwargs)

    block.forward = forward


def train_only_rows(model: AED, added: dict) -> None:
    """Freeze every parameter but the vocabulary rows of the added tokens: the decoder embedding
    (which is also the output weight: tied), the output bias and the CTC head's rows (not its blank,
    an old row). `mask_frozen_rows` zeroes the other rows' gradients before each update, and
    `build_optimizer` leaves these tensors out of weight decay, so the old rows stay bit-identical.
    Sets `model.trained_rows`: {parameter name: (rows,) bool, True where the row trains}."""
    model.requires_grad_(False)
    ids = torch.arange(model.cfg.vocab_size)
    new = (ids >= added["first"]) | (ids == added["language_token"])  # (V,)
    rows = {"decoder.embedding.token_embedding.weight": new, "decoder.output_proj.bias": new}
    if model.ctc is not None:
        with_blank = torch.cat([new, torch.zeros(1, dtype=torch.bool)])  # (V + 1,): the blank stays fixed
        rows |= {"ctc.proj.weight": with_blank, "ctc.proj.bias": with_blank}
    for name in rows:
        model.get_parameter(name).requires_grad_(True)
    model.trained_rows = rows


def mask_frozen_rows(model: nn.Module) -> None:
    """Zero the gradient rows `train_only_rows` froze, once the gradients are reduced: plain ones
    (one process, DDP) and FSDP's sharded ones alike. Nothing to do for other models. Each mask is
    made once, in the gradient's device, dtype and sharding, and kept (`model.grad_masks`)."""
    model = getattr(model, "module", model)  # under DDP
    if not hasattr(model, "trained_rows"):
        return
    masks = model.__dict__.setdefault("grad_masks", {})
    for name, trained in model.trained_rows.items():
        grad = model.get_parameter(name).grad
        if grad is None:
            continue
        if name not in masks:
            keep = trained.to(grad.device, grad.dtype).view(-1, *[1] * (grad.dim() - 1))  # (rows, 1, ...)
            if isinstance(grad, DTensor):  # this rank's rows, split as the gradient is: no communication
                keep = distribute_tensor(keep, grad.device_mesh, grad.placements, src_data_rank=None)
            masks[name] = keep
        grad.mul_(masks[name])


def train_mode(model: nn.Module, freeze: str = "none") -> nn.Module:
    """model.train(), except that a frozen encoder runs as at inference: batch norm normalises with
    its fixed running statistics (not the batch's, which it would also keep updating) and dropout
    is off, so the decoder learns on the features the frozen encoder will give at test time."""
    model.train()
    if freeze in ("encoder", "all_but_new_tokens"):
        model.encoder.eval()
    return model


def build_optimizer(model: nn.Module, optim: OptimConfig) -> torch.optim.Optimizer:
    """AdamW over `param_groups`. Tensors of which only some rows train (`train_only_rows`) get no
    weight decay: AdamW's decay is decoupled from the gradient and would shrink their frozen rows."""
    partly = [model.get_parameter(name) for name in getattr(model, "trained_rows", {})]
    groups = [{**g, "params": [p for p in g["params"] if all(p is not q for q in partly)]}
              for g in param_groups(model, optim.weight_decay)]
    if partly:
        groups.append({"params": partly, "weight_decay": 0.0})
    # fused=None: torch picks (foreach on GPUs, a loop over tensors on CPUs)
    return torch.optim.AdamW(groups, lr=optim.lr, betas=optim.betas, fused=optim.fused or None)


def lr_factor(step: int, optim: OptimConfig, max_steps: int) -> float:
    """Linear warmup to lr, then the decay of optim.schedule, floored at min_lr. Inverse square root
    (Noam) suits runs with no set end; cosine reaches min_lr at max_steps, so a short run ends annealed."""
    s, warmup, floor = max(step, 1), max(optim.warmup_steps, 1), optim.min_lr / optim.lr
    if s < warmup:
        return max(s / warmup, floor)
    if optim.schedule == "cosine":
        done = min((s - warmup) / max(max_steps - warmup, 1), 1.0)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * done))
    return max((warmup / s) ** 0.5, floor)


# --- the weights' exponential moving average, beside the optimizer --------------------------------


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of `t`: an FSDP2 DTensor's local shard, a plain tensor itself. The EMA's
    arithmetic is elementwise between tensors of the same placements, so it runs on the shards."""
    return t.to_local() if isinstance(t, DTensor) else t


class ExponentialMovingAverage:
    """fp32 averages of `model`'s trainable parameters, by name, starting from their current values:
    kept beside training (train.py's `ema_decay`), saved in every checkpoint, scored by validation
    and decoded by `infer.py --ema`.

        ema = ExponentialMovingAverage(model, decay=0.9999)   # fp32 copies of the trainable parameters
        ema.update(model, step)                  # after each optimizer step that updated the weights
        with ema.swapped(model):                 # the EMA in the model's parameters, its own weights back after
            evaluate(...)
        ema.state_dict()                         # {parameter name: tensor}: what a checkpoint saves (DCP)

    Why: late in training the weights wander around a minimum with the noise of the updates; their
    average over the last steps sits nearer its centre (Polyak averaging), as NeMo's EMA callback and
    checkpoint averaging (infer.py --average) also use, without keeping the checkpoints.

    Memory: one fp32 copy of every trainable parameter on its device, made like the parameter: under
    FSDP2 a DTensor with the parameter's placements, so each rank keeps, updates and saves its own
    shard and no update or swap communicates; under DDP every rank keeps the whole copy (the same on
    every rank, as the weights are). Frozen parameters (freeze=encoder) are left out: their average is
    themselves. Buffers (BatchNorm's running statistics) are not averaged: the current ones are used.

    Warm-up: the update after `n` earlier steps uses the decay min(decay, (1 + n) / (10 + n)), as
    TensorFlow's ExponentialMovingAverage does with num_updates. A decay of 0.9999 alone would keep
    e^-1 of the random initial weights in the average after 10,000 steps, and the EMA would score worse
    than the raw weights for most of a short run; with the warm-up it averages roughly the last tenth
    of the steps taken, until (1 + n) / (10 + n) reaches `decay` (~90,000 steps for 0.9999).
    """

    def __init__(self, model: nn.Module, decay: float):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"EMA decay: expected 0 < decay < 1, got {decay}")
        self.decay = decay
        params = {name: p for name, p in model.named_parameters() if p.requires_grad}
        other = [name for name, p in params.items() if p.dtype != torch.float32]
        if other:  # swapping trades values with the parameters: one of another dtype would round the EMA
            raise ValueError(f"EMA needs fp32 parameters, got {params[other[0]].dtype} for {other[0]}")
        with torch.no_grad():
            self.weights = {name: p.detach().clone() for name, p in params.items()}

    @property
    def nbytes(self) -> int:
        """Bytes this rank holds (its shards under FSDP)."""
        return sum(local(e).numel() * local(e).element_size() for e in self.weights.values())

    def decay_at(self, step: int) -> float:
        """The decay of the update that follows `step` earlier optimizer steps (the warm-up above)."""
        return min(self.decay, (1 + step) / (10 + step))

    @torch.no_grad()
    def update(self, model: nn.Module, step: int) -> None:
        """ema <- d * ema + (1 - d) * param, d = `decay_at(step)`; `step`: the optimizer steps before
        this one, which the checkpoint records, so a resumed run continues the same sequence."""
        params = dict(model.named_parameters())
        torch._foreach_lerp_([local(e) for e in self.weights.values()],  # one fused kernel per group on a GPU
                             [local(params[name]) for name in self.weights], 1.0 - self.decay_at(step))

    @torch.no_grad()
    def reset(self, model: nn.Module) -> None:
        """Restart the average at `model`'s current weights (a run that had no EMA until now)."""
        params = dict(model.named_parameters())
        for name, e in self.weights.items():
            local(e).copy_(local(params[name]))

    @contextmanager
    def swapped(self, model: nn.Module):
        """`model` with the EMA weights inside the block and its own weights back after it, bit for
        bit. Each parameter trades values with its average in place, one tensor's temporary at a
        time rather than a copy of the model, and the parameters stay the tensors that FSDP and the
        optimizer hold. Every rank swaps its own shards: no collective."""
        self._swap(model)
        try:
            yield model
        finally:
            self._swap(model)

    @torch.no_grad()
    def _swap(self, model: nn.Module) -> None:
        params = dict(model.named_parameters())
        for name, e in self.weights.items():
            p, e = local(params[name]), local(e)
            raw = p.clone()
            p.copy_(e)
            e.copy_(raw)

    def state_dict(self) -> dict:
        """{parameter name: the EMA tensor itself}: DCP saves this rank's shards and loads into them in place."""
        return dict(self.weights)

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Copy `state` (a `state_dict` of the same parameters and placements) into the average."""
        if state.keys() != self.weights.keys():
            missing, extra = sorted(self.weights.keys() - state.keys()), sorted(state.keys() - self.weights.keys())
            raise ValueError(f"EMA state of other parameters: missing {missing[:3]}, unexpected {extra[:3]}")
        for name, e in self.weights.items():
            local(e).copy_(local(state[name]))


# --- the training step, and the setup that runs it ------------------------------------------------


def count_targets(model: nn.Module, batches: list) -> int:
    """Targets the loss scores in these batches, counted on the host from their lengths (tokens;
    BEST-RQ: valid encoder frames, aed/model_ssl.py)."""
    return sum(int(model.count_targets(b).sum()) for b in batches)


def count_ctc_skipped(model: nn.Module, batches: list) -> int:
    """Transcriptions in these batches that the CTC loss leaves out (more text tokens than encoder
    frames allow, aed/model.py), counted from their lengths; 0 for a model without a CTC head.
    Translations, which CTC never learns from, are not counted."""
    if getattr(model, "ctc", None) is None:
        return 0
    skipped = 0
    for b in batches:
        frames = subsampled_length(b.feat_lens, model.cfg.subsampling_factor)
        too_short = infeasible(frames, *text_targets(b.tokens, b.token_lens, b.prompt_lens))  # (B,)
        skipped += int((too_short if b.transcribed is None else too_short & b.transcribed).sum())
    return skipped


@dataclass
class StepResult:
    loss: torch.Tensor  # summed loss over this rank's micro-batches (detached, on the device: no sync)
    count: torch.Tensor  # the number of targets it sums over
    grad_norm: torch.Tensor  # before clipping
    updated: bool  # False when the gradient was not finite and the update was skipped


def train_step(model: nn.Module, batches: list, optimizer, scaler, spec_augment, precision: str,
               clip_grad: float, num_targets: float, world_size: int = 1, no_sync=None) -> StepResult:
    """One optimizer step over micro-batches (aed.data_batch.Batch, on the host or the device).

    Each micro-batch's summed loss is scaled by world_size / num_targets, with num_targets the
    step's target count over all ranks and micro-batches: ranks and micro-batches of different
    2D shapes then weigh every token equally (DDP averages gradients over ranks, hence the
    world_size). `no_sync` (aed.train_distributed.wrap's) skips the gradient reduction of all but the last
    micro-batch.
    A non-finite gradient norm skips the update; the caller counts such steps and steps the
    learning-rate schedule.
    """
    device = next(model.parameters()).device
    optimizer.zero_grad(set_to_none=True)
    loss_sum = torch.zeros((), device=device)
    count = torch.zeros((), dtype=torch.long, device=device)
    for i, batch in enumerate(batches):
        b = batch.to(device, non_blocking=True)
        last = i == len(batches) - 1
        try:
            with (nullcontext() if last or no_sync is None else no_sync()), autocast(device, precision):
                feats = spec_augment(b.feats, b.feat_lens)
                loss, n = model(feats, b.feat_lens, b.tokens, b.token_lens, b.prompt_lens, b.transcribed)
                scaler.scale(loss * world_size / num_targets).backward()
        except Exception as e:
            if peer_lost(e):  # the gradient all-reduce in backward: this batch is not the cause
                log.error("training step stopped: a peer rank exited or lost its connection (%s)",
                          str(e).splitlines()[0][:200])
            else:
                log.error("training step failed on batch %s: feats %s, tokens %s", b.where,
                          tuple(b.feats.shape), tuple(b.tokens.shape))
            raise
        loss_sum += loss.detach().float()
        count += n
    mask_frozen_rows(model)
    scaler.unscale_(optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad)
    if isinstance(grad_norm, DTensor):  # FSDP: the norm over every rank's shard, the same on all ranks
        grad_norm = grad_norm.full_tensor()
    updated = bool(torch.isfinite(grad_norm))  # gradients were averaged over the ranks: every rank agrees
    if updated:
        scaler.step(optimizer)
    scaler.update()
    return StepResult(loss_sum, count, grad_norm, updated)


@dataclass
class TrainingSetup:
    cfg: TrainConfig  # model.vocab_size and pad_id resolved from the tokenizer
    tokenizer: Tokenizer
    objective: Objective
    precision: str  # resolved: fp32, bf16 or fp16
    added_tokens: dict | None  # the rows init_from's tools/add_language.py added: kept in every checkpoint
    model: nn.Module  # on the device, in train mode (`train_mode`: a frozen encoder runs as at inference)
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    scaler: torch.amp.GradScaler  # loss scaling, enabled for fp16 only
    spec_augment: SpecAugment  # in train mode when the objective uses it

    def bucket_shapes(self, bins: Bins, max_tps=None) -> list:
        """(duration s, frames, token bound) of every bucket, as the OOMptimizer measures them: the
        frames count the most augment's edges add; an objective that reads no text gets no token
        bound (2-token batches)."""
        tps = max_tps if self.objective.reads_text else 0.0
        return bucket_shapes(bins, self.cfg.features, self.cfg.model.dec_max_len, tps, self.cfg.augment.added_seconds)

    def describe(self) -> str:
        m = self.cfg.model
        return (f"model: {sum(p.numel() for p in self.model.parameters()) / 1e6:.2f}M parameters (encoder "
                f"{m.enc_layers} x {m.enc_d_model}, {self.objective.describe_head(self.cfg)}), precision {self.precision}, "
                f"device {next(self.model.parameters()).device}"
                + (f", sharded over {world_size()} rank(s) (FSDP2)" if isinstance(self.model, FSDPModule) else ""))


def build_training_setup(cfg: TrainConfig, device: torch.device, precision: str | None = None,
                         simulated: bool = False) -> TrainingSetup:
    """The run of `cfg` on `device`; `precision` overrides cfg.precision. ConfigError when the
    config asks for what cannot be built (freeze=all_but_new_tokens without its record).
    simulated: built inside aed.memory_measure.SimulatedDevice, standing in for a CUDA device:
    `auto` precision resolves as it would there (bf16), and fake parameters stay where they are."""
    precision = resolve_precision(precision or cfg.precision, torch.device("cuda") if simulated else device)
    tokenizer = Tokenizer.load(cfg.train.tokenizer)
    cfg = resolve_model(cfg, tokenizer)
    objective = OBJECTIVES[cfg.objective]
    added_tokens = new_tokens(cfg, tokenizer.vocab_size)
    model = build_model(cfg, tokenizer.vocab_size, added_tokens)
    if not simulated:
        model = model.to(device)
    if cfg.train.strategy == "fsdp" and is_distributed():  # sharded before the optimizer sees the parameters
        model = shard(model, torch.device(device), world_size(), precision, cfg.train.reshard_after_forward,
                      bf16_params=precision == "bf16" if simulated else None)  # simulated: as on CUDA
    train_mode(model, cfg.freeze)
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg.optim, cfg.max_steps))
    scaler = torch.amp.GradScaler(torch.device(device).type, enabled=precision == "fp16")
    spec_augment = SpecAugment(cfg.spec_augment).train(objective.spec_augment).to(device)
    return TrainingSetup(cfg, tokenizer, objective, precision, added_tokens, model, optimizer, scheduler, scaler,
                         spec_augment)


def load_training_setup(path: str, device: torch.device, precision: str | None = None, overrides: list[str] = (),
                        simulated: bool = False) -> TrainingSetup:
    """`build_training_setup` of a train.py YAML config (and key=value overrides); a bad config
    exits with a message naming the file."""
    try:
        return build_training_setup(load_train_config(path, overrides), device, precision, simulated)
    except (ConfigError, OSError, ValueError) as e:
        raise SystemExit(f"{path}: {e}") from None
