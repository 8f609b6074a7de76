"""Checkpoints: atomic writes, keep-last-k, newest-valid lookup, and loading a model for inference.

A checkpoint is one `torch.save` dict, self-contained so `infer.py` needs nothing else:
    model_config, model (raw module state), features (FeatureConfig fields),
    tokenizer ({file name: bytes} of the tokenizer directory), and for training also
    step, optimizer, scheduler, sampler (one state per rank), rng (one per rank), config.
"""

import glob
import logging
import os
import random
import re
import tempfile

import numpy as np
import torch

from aed.audio import FeatureConfig
from aed.model import AED, AEDConfig
from aed.tokenizer import Tokenizer

log = logging.getLogger(__name__)


def pack_dir(directory: str) -> dict:
    """The files of a (flat) directory as {name: bytes}, to embed a tokenizer in a checkpoint."""
    out = {}
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                out[name] = f.read()
    return out


def unpack_tokenizer(files: dict) -> Tokenizer:
    with tempfile.TemporaryDirectory() as tmp:
        for name, data in files.items():
            with open(os.path.join(tmp, name), "wb") as f:
                f.write(data)
        return Tokenizer.load(tmp)


# Entries without which a checkpoint cannot serve its purpose: inference, or resuming a run.
INFERENCE_KEYS = ("model_config", "model", "features", "tokenizer")
TRAINING_KEYS = INFERENCE_KEYS + ("step", "optimizer", "scheduler", "scaler", "sampler", "rng", "config")


class CheckpointError(RuntimeError):
    pass


def save_checkpoint(state: dict, run_dir: str, step: int, keep_last: int) -> str:
    """Write `ckpt-{step}.pt` via a temp file + rename (a killed job never leaves half a file),
    then delete older checkpoints beyond the newest `keep_last`. Files numbered above `step`
    (left by a run that was rolled back past an unreadable checkpoint) are neither deleted nor
    counted: the checkpoint just written always survives its own cleanup."""
    path = os.path.join(run_dir, f"ckpt-{step:08d}.pt")
    tmp = path + ".tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)
    older = [p for p in list_checkpoints(run_dir) if checkpoint_step(p) < step]
    for old in older[: max(0, len(older) - (keep_last - 1))]:
        os.remove(old)
    return path


def checkpoint_step(path: str) -> int:
    return int(re.search(r"ckpt-(\d+)\.pt$", path).group(1))


def list_checkpoints(run_dir: str) -> list[str]:
    """Checkpoints in `run_dir`, oldest first (by step number)."""
    paths = [p for p in glob.glob(os.path.join(run_dir, "ckpt-*.pt")) if re.search(r"ckpt-(\d+)\.pt$", p)]
    return sorted(paths, key=checkpoint_step)


def read_checkpoint(path: str, required=INFERENCE_KEYS) -> dict:
    """torch.load, then check the `required` entries are there; CheckpointError names the file."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - truncated, corrupt, not a torch file: all unreadable
        raise CheckpointError(f"{path}: unreadable ({type(e).__name__}: {str(e)[:200]})") from None
    missing = [k for k in required if not isinstance(ckpt, dict) or k not in ckpt]
    if missing:
        raise CheckpointError(f"{path}: not a complete aed checkpoint (no {', '.join(missing)})")
    return ckpt


def load_latest(run_dir: str, required=TRAINING_KEYS) -> tuple[str, dict] | tuple[None, None]:
    """The newest valid checkpoint of `run_dir`, or (None, None) when it has none. An invalid one
    (truncated by a full disk, written by something else) is logged by name and the next older one
    tried; when checkpoints exist but none is valid, CheckpointError: starting from scratch
    silently would throw a run away."""
    paths = list_checkpoints(run_dir)
    problems = []
    for path in reversed(paths):
        try:
            ckpt = read_checkpoint(path, required)
        except CheckpointError as e:
            log.warning("skipping invalid checkpoint %s; trying an older one", e)
            problems.append(str(e))
            continue
        return path, ckpt
    if paths:
        raise CheckpointError(f"{run_dir} has {len(paths)} checkpoint(s) and none is valid:\n  "
                              + "\n  ".join(problems) + "\nmove them away to start this run from scratch")
    return None, None


# Tensors with one row per token id. The CTC head has one more, its blank, which stays the last row.
VOCAB_ROWS = ("decoder.embedding.token_embedding.weight", "decoder.output_proj.weight", "decoder.output_proj.bias")
CTC_ROWS = ("ctc.proj.weight", "ctc.proj.bias")


def grow_vocabulary(state: dict, size: int) -> list[str]:
    """Resize a model state dict's vocabulary to `size` ids, in place, for a tokenizer with blocks
    appended (every old id keeps its meaning); returns one note per grown tensor.

    Old rows are copied, so every old token's embedding and logit are what they were. New
    embedding rows are drawn with the old rows' spread; new output (and CTC) rows get zero
    weights and the lowest old bias: a constant logit no better than the least likely old token's,
    so old-language outputs do not change until training teaches the new rows. The CTC blank
    row moves to the new last position."""
    notes = []
    for k in VOCAB_ROWS + CTC_ROWS:
        if k not in state:
            continue
        old = state[k]
        blank = old[-1:] if k in CTC_ROWS else old[:0]
        rows = old[:-1] if k in CTC_ROWS else old
        n_new = size - len(rows)
        if n_new < 0:
            raise ValueError(f"{k}: the checkpoint has {len(rows)} token rows, more than the {size} asked for")
        if n_new == 0:
            continue
        if k.endswith("token_embedding.weight"):
            fresh = torch.randn(n_new, *rows.shape[1:], dtype=rows.dtype) * rows.float().std().to(rows.dtype)
        elif k.endswith("bias"):
            fresh = rows.min().expand(n_new).clone()
        else:
            fresh = rows.new_zeros(n_new, *rows.shape[1:])
        state[k] = torch.cat([rows, fresh, blank])
        notes.append(f"{k} grows from {len(old)} to {len(state[k])} rows")
    return notes


def init_from_checkpoint(model: torch.nn.Module, path: str, encoder_only: bool = False) -> str:
    """Initialise `model` (a fresh run) with the weights of the checkpoint at `path`; returns a
    summary for the log. Tensors of equal name and shape are copied; encoder_only copies only
    `encoder.*` (an rnnt-pretrained encoder into an AED; extra layers stay random). Raises
    ValueError listing every tensor whose shape differs.

    A tokenizer with blocks appended (a new language's SentencePiece model: tools/add_language.py)
    keeps every old id, so the vocabulary-sized tensors, the CTC head's included, grow
    (`grow_vocabulary`)."""
    src = torch.load(path, map_location="cpu", weights_only=False)["model"]
    own = model.state_dict()
    prefix = "encoder." if encoder_only else ""
    notes = []
    size = own[VOCAB_ROWS[0]].shape[0] if VOCAB_ROWS[0] in own else None
    if not encoder_only and size is not None and src[VOCAB_ROWS[0]].shape[0] < size:
        notes = grow_vocabulary(src, size)
    mismatched = [f"{k}: {tuple(v.shape)} -> {tuple(own[k].shape)}" for k, v in src.items()
                  if k.startswith(prefix) and k in own and own[k].shape != v.shape]
    if mismatched:
        raise ValueError(f"init_from={path}: shape mismatches:\n  " + "\n  ".join(mismatched))
    loadable = {k: v for k, v in src.items() if k.startswith(prefix) and k in own}
    model.load_state_dict(loadable, strict=False)
    fresh = sorted({".".join(k.split(".")[:3]) for k in own if k.startswith(prefix) and k not in loadable})
    return (f"loaded {len(loadable)} tensors{' (encoder only)' if encoder_only else ''}"
            + "".join(f"; {n}" for n in notes) + f"; left random: {', '.join(fresh) or 'nothing'}")


def rng_state(device: torch.device) -> dict:
    """Every random number generator a training step draws from (dropout, SpecAugment, ...)."""
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state(),
            "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if device.type == "cuda" and state["cuda"] is not None:
        torch.cuda.set_rng_state(state["cuda"], device)


def load_model(path: str, device="cpu") -> tuple[AED, Tokenizer, FeatureConfig]:
    """Model (eval mode), tokenizer and feature settings from a checkpoint file."""
    return model_from_checkpoint(read_checkpoint(path, INFERENCE_KEYS), device)


def model_from_checkpoint(ckpt: dict, device="cpu") -> tuple[AED, Tokenizer, FeatureConfig]:
    model = AED(AEDConfig(**ckpt["model_config"]))
    model.load_state_dict(ckpt["model"])
    return model.to(device).eval(), unpack_tokenizer(ckpt["tokenizer"]), FeatureConfig(**ckpt["features"])
