"""An exponential moving average (EMA) of the weights: kept beside training (train.py's
`ema_decay`), saved in every checkpoint, scored by validation and decoded by `infer.py --ema`.

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

from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of `t`: an FSDP2 DTensor's local shard, a plain tensor itself. The EMA's
    arithmetic is elementwise between tensors of the same placements, so it runs on the shards."""
    return t.to_local() if isinstance(t, DTensor) else t


class ExponentialMovingAverage:
    """fp32 averages of `model`'s trainable parameters, by name, starting from their current values."""

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
