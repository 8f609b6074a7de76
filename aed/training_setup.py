"""What a training run is made of, built from its config in one place for train.py and oom.py:
the tokenizer (which sets the model's vocabulary), the model of the run's objective, the
optimizer with its schedule, SpecAugment and the resolved precision.

    setup = build_training_setup(cfg, device)
    setup.model, setup.optimizer, setup.scheduler, setup.scaler, setup.spec_augment
    shapes = setup.bucket_shapes(bins)           # the OOMptimizer's bucket bounds for this run

oom.py measures the memory of exactly the step train.py runs because both build it here.
"""

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from aed.audio import SpecAugment
from aed.config import TrainConfig, load_train_config, resolve_model
from aed.dataclass_config import ConfigError
from aed.distributed import is_distributed, world_size
from aed.objectives import OBJECTIVES, Objective
from aed.oomptimizer import bucket_shapes
from aed.parallel import shard
from aed.tokenizer import Tokenizer
from aed.training import build_model, build_optimizer, lr_factor, new_tokens, resolve_precision, train_mode
from bins import Bins


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
        """(duration s, frames, token bound) of every bucket, as the OOMptimizer measures them;
        an objective that reads no text gets no token bound (2-token batches)."""
        tps = max_tps if self.objective.reads_text else 0.0
        return bucket_shapes(bins, self.cfg.features, self.cfg.model.dec_max_len, tps)

    def describe(self) -> str:
        m = self.cfg.model
        return (f"model: {sum(p.numel() for p in self.model.parameters()) / 1e6:.2f}M parameters (encoder "
                f"{m.enc_layers} x {m.enc_d_model}, {self.objective.head(self.cfg)}), precision {self.precision}, "
                f"device {next(self.model.parameters()).device}"
                + (f", sharded over {world_size()} rank(s) (FSDP2)" if isinstance(self.model, FSDPModule) else ""))


def build_training_setup(cfg: TrainConfig, device: torch.device, precision: str | None = None,
                         simulated: bool = False) -> TrainingSetup:
    """The run of `cfg` on `device`; `precision` overrides cfg.precision. ConfigError when the
    config asks for what cannot be built (freeze=all_but_new_tokens without its record).
    simulated: built inside aed.simulated_memory.SimulatedDevice, standing in for a CUDA device:
    `auto` precision resolves as it would there (bf16), and fake parameters stay where they are."""
    tokenizer = Tokenizer.load(cfg.train.tokenizer)
    cfg = resolve_model(cfg, tokenizer)
    precision = resolve_precision(precision or cfg.precision, torch.device("cuda") if simulated else device)
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
