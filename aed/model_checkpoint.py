"""A checkpoint on disk -> the model, tokenizer and features: what a checkpoint holds (`Checkpoint`),
finding and reading checkpoints (the newest valid one of a run, an average of the newest few, the
EMA of the weights), and `load_model`, which makes one ready for inference. Writing them is
training's (aed/train_checkpoint.py); this side needs no distributed world and no training code.

    loaded = load_model("runs/tiny")                # a run directory (its newest valid checkpoint) or a checkpoint
    loaded.model, loaded.tokenizer, loaded.features
    path, ckpt = read_checkpoint_or_run("runs/tiny")   # the checkpoint as a dict (INFERENCE_KEYS checked)

A checkpoint holds a `Checkpoint`: self-contained, so `infer.py` needs nothing else, and for a
training run everything resuming needs. train.py writes it as a directory:

    ckpt-00001000/
        .metadata, __0_0.distcp ...   DCP: the model, optimizer and EMA tensors, each rank writing its part
        meta.pt                       everything else (rank 0): config, tokenizer, schedule, sampler and RNG states
        COMPLETE                      written last, once every rank's part is in place

The tensors are saved under their parameter names, so `read_checkpoint` reads one in a single
process whichever world size and strategy wrote it (inference, init_from). A directory without
COMPLETE (a job killed mid-save) is not a checkpoint. Also read: single `torch.save` files
(tools/convert_nemo.py). Directories of per-rank `shard-*.pt` files, from aed before DCP, are
refused with the command that converts them (tools/upgrade_checkpoint.py).
"""

import glob
import logging
import os
import re
import tempfile
import warnings
from contextlib import contextmanager
from dataclasses import MISSING, dataclass, field, fields

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from aed.config import renamed
from aed.data_audio import FeatureConfig
from aed.data_tokenizer import Tokenizer
from aed.model import AED, AEDConfig
from aed.model_static import CompiledAED

log = logging.getLogger(__name__)


# --- the format -----------------------------------------------------------------------------------


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


RESUME = {"resume": True}  # marks the fields a run needs to resume, beyond inference's


@dataclass
class Checkpoint:
    """What a checkpoint holds, each entry named here once. Fields without a default are what
    inference needs; those marked RESUME are what a training run needs to continue exactly."""
    model_config: dict  # AEDConfig fields
    model: dict  # the raw module's state dict
    features: dict  # FeatureConfig fields
    tokenizer: dict  # {file name: bytes} of the tokenizer directory (pack_dir)
    max_train_duration: float | None = None  # longest training utterance (s): infer.py's chunk length
    edge_silence: tuple | None = None  # (before, after) s of silence around the training utterances' speech
    trim_silence: float | None = None  # train.trim_silence: inference cuts its inputs' edges the same way
    varied_edges: tuple | None = None  # augment.edge_seconds where training varied its utterances' edges (augment.edge_prob > 0)
    new_tokens: dict | None = None  # the rows tools/add_language.py appended (freeze=all_but_new_tokens)
    ema: dict | None = None  # the trainable weights' EMA by parameter name, fp32 (ema_decay: aed/train_setup.py)
    step: int | None = field(default=None, metadata=RESUME)  # optimizer steps taken
    flops: float = 0.0  # their FLOPs, all ranks together (aed/train_progress.py); checkpoints before FLOP counting have none
    optimizer: dict | None = field(default=None, metadata=RESUME)
    scheduler: dict | None = field(default=None, metadata=RESUME)
    scaler: dict | None = field(default=None, metadata=RESUME)
    sampler: list | None = field(default=None, metadata=RESUME)  # one BucketingSampler state per rank
    rng: list | None = field(default=None, metadata=RESUME)  # one `rng_state` per rank
    config: dict | None = field(default=None, metadata=RESUME)  # the run's resolved TrainConfig
    guide_ended: int | None = None  # the step train.attention_guide ended at because the decoder listened (until=listening)
    guide_check_due: bool = False  # until=listening: the last check found no two rows to compare, so one is due at the next step
    guide_start: int = 0  # the step the guide last (re)started at: its ramp and steps count from there
    guide_restarts: int = 0  # the decoder restarts so far (train.decoder_restarts)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    @classmethod
    def from_dict(cls, d: dict) -> "Checkpoint":
        """A dict from `read_checkpoint` (with at least INFERENCE_KEYS); other keys are ignored."""
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})


INFERENCE_KEYS = tuple(f.name for f in fields(Checkpoint) if f.default is MISSING)
TRAINING_KEYS = INFERENCE_KEYS + tuple(f.name for f in fields(Checkpoint) if f.metadata.get("resume"))
COMPLETE = "COMPLETE"
LM_FILE = "lm.pt"  # a run directory's n-gram of its training transcripts (train.lm_order, aed/decode_lm.py)
TENSORS = ("model", "optimizer", "ema")  # the Checkpoint fields written through DCP; the rest goes to meta.pt


class CheckpointError(RuntimeError):
    pass


# --- reading --------------------------------------------------------------------------------------


@contextmanager
def quiet_single_process():
    """DCP warns that it assumes a single process whenever no process group exists, even when told
    so (no_dist): for tools, tests and inference that is the normal case, not news."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def checkpoint_step(path: str) -> int:
    return int(re.search(r"ckpt-(\d+)(\.pt)?$", path).group(1))


def list_checkpoints(run_dir: str) -> list[str]:
    """Checkpoints in `run_dir` (directories, and single `ckpt-N.pt` files), oldest first."""
    paths = [p for p in glob.glob(os.path.join(run_dir, "ckpt-*")) if re.search(r"ckpt-(\d+)(\.pt)?$", p)]
    return sorted(paths, key=checkpoint_step)


def is_checkpoint(path: str) -> bool:
    """A checkpoint (file or directory), as opposed to a run directory that holds checkpoints."""
    return os.path.isfile(path) or bool(re.search(r"ckpt-\d+$", os.path.normpath(path))) \
        or os.path.isfile(os.path.join(path, "meta.pt"))


def is_complete(path: str) -> bool:
    return os.path.isfile(path) or os.path.isfile(os.path.join(path, COMPLETE))


def read_checkpoint(path: str, required=INFERENCE_KEYS, with_tensors: bool = True) -> dict:
    """The checkpoint at `path` as one dict, with the `required` entries checked; CheckpointError
    names the file at fault. Of a DCP directory, the TENSORS entries in `required` are read into
    this process, whole (inference, init_from); with_tensors=False reads meta.pt alone (a training
    run loads its tensors itself, sharded: `load_training_state`). The model config of a checkpoint
    saved before one of its keys was renamed (AEDConfig.RENAMED) comes back under today's keys."""
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, COMPLETE)):
            raise CheckpointError(f"{path}: incomplete (no {COMPLETE} marker: the job stopped while saving it)")
        ckpt = load_file(os.path.join(path, "meta.pt"), mmap=False)
        if not isinstance(ckpt, dict):
            raise CheckpointError(f"{path}/meta.pt: not an aed checkpoint's meta.pt")
        if isinstance(ckpt.get("shards"), int):
            raise CheckpointError(f"{path}: per-rank shard files (shard-*.pt) of aed before DCP checkpoints; "
                                  f"convert it once: python tools/upgrade_checkpoint.py {path} -o NEW_RUN_DIR")
        check_dcp_files(path)
        if with_tensors:
            ckpt |= read_dcp(path, [k for k in TENSORS if k in required])
        else:
            required = [k for k in required if k not in TENSORS]
    else:
        ckpt = load_file(path, mmap=False)
    missing = [k for k in required if not isinstance(ckpt, dict) or k not in ckpt]
    if missing:
        raise CheckpointError(f"{path}: not a complete aed checkpoint (no {', '.join(missing)})")
    if isinstance(ckpt, dict) and "model_config" in ckpt:  # saved before a key was renamed: today's names
        ckpt["model_config"] = renamed(AEDConfig, ckpt["model_config"])
    return ckpt


def check_dcp_files(path: str) -> None:
    """CheckpointError unless DCP's index is readable and every file it points into is there, at
    least as long as the index says (a disk that filled up, a copy cut short)."""
    try:
        index = dcp.FileSystemReader(path).read_metadata()
    except Exception as e:  # noqa: BLE001 - missing, truncated, not a DCP index
        raise CheckpointError(f"{path}/.metadata: unreadable ({type(e).__name__}: {str(e)[:200]})") from None
    ends = {}
    for item in index.storage_data.values():
        ends[item.relative_path] = max(ends.get(item.relative_path, 0), item.offset + item.length)
    for name, end in sorted(ends.items()):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise CheckpointError(f"{file}: missing")
        if os.path.getsize(file) < end:
            raise CheckpointError(f"{file}: truncated ({os.path.getsize(file)} of {end} bytes)")


def read_dcp(path: str, keys: list[str]) -> dict:
    """The `keys` entries of a DCP directory, whole, in this process (no distributed world needed):
    tensors are allocated from DCP's own index."""
    if not keys:
        return {}
    state = {}
    try:
        with quiet_single_process():
            _load_state_dict(state, storage_reader=dcp.FileSystemReader(path),
                             planner=_EmptyStateDictLoadPlanner(keys=set(keys)), no_dist=True)
    except Exception as e:  # noqa: BLE001 - a missing or truncated .distcp file, a corrupt index
        raise CheckpointError(f"{path}: unreadable ({type(e).__name__}: {str(e)[:200]})") from None
    return state


def read_ema(path: str) -> dict:
    """The EMA weights of the checkpoint at `path`, {parameter name: fp32 tensor}, whole in this
    process (infer.py --ema); CheckpointError when it has none."""
    ema = read_dcp(path, ["ema"]).get("ema") if os.path.isdir(path) else load_file(path, mmap=False).get("ema")
    if ema is None:
        raise CheckpointError(f"{path} holds no EMA of the weights: its run trained without ema_decay "
                              "(leave out --ema to decode its weights)")
    return ema


def load_file(path: str, mmap: bool):
    try:
        return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)
    except Exception as e:  # noqa: BLE001 - missing, truncated, corrupt, not a torch file: all unreadable
        raise CheckpointError(f"{path}: unreadable ({type(e).__name__}: {str(e)[:200]})") from None


def load_latest(run_dir: str, required=TRAINING_KEYS,
                with_tensors: bool = True) -> tuple[str, dict] | tuple[None, None]:
    """The newest valid checkpoint of `run_dir` (`read_checkpoint`), or (None, None) when it has none. An invalid one
    (interrupted, truncated by a full disk, written by something else) is logged by name and the
    next older one tried; when checkpoints exist but none is valid, CheckpointError: starting from
    scratch silently would throw a run away."""
    paths = list_checkpoints(run_dir)
    problems = []
    for path in reversed(paths):
        try:
            ckpt = read_checkpoint(path, required, with_tensors)
        except CheckpointError as e:
            log.warning("skipping invalid checkpoint %s; trying an older one", e)
            problems.append(str(e))
            continue
        return path, ckpt
    if paths:
        raise CheckpointError(f"{run_dir} has {len(paths)} checkpoint(s) and none is valid:\n  "
                              + "\n  ".join(problems) + "\nmove them away to start this run from scratch")
    return None, None


def read_checkpoint_or_run(path: str, required=TRAINING_KEYS) -> tuple[str, dict]:
    """(path, checkpoint) of a checkpoint (a file or a `ckpt-*` directory) or of a run directory's
    newest valid one (`load_latest`): what every --ckpt of infer.py and the tools takes.
    FileNotFoundError names what is missing."""
    if os.path.isdir(path) and not is_checkpoint(path):
        newest, ckpt = load_latest(path, required)
        if ckpt is None:
            raise FileNotFoundError(f"{path}: a directory without ckpt-* checkpoints")
        return newest, ckpt
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such checkpoint file or run directory")
    return path, read_checkpoint(path, required)


def average_checkpoints(run_dir: str, count: int) -> tuple[list[str], dict]:
    """(paths, checkpoint) of the newest `count` valid checkpoints of run_dir, the checkpoint being
    the newest with its model weights replaced by their mean (ESPnet's and icefall's averaging:
    the mean of the last weights of a run sits nearer a wide minimum than any one of them).
    Integer buffers (BatchNorm's batch counter) keep the newest value."""
    paths = []
    for path in reversed(list_checkpoints(run_dir)):
        if len(paths) == count:
            break
        try:
            read_checkpoint(path, with_tensors=False)
            paths.append(path)
        except CheckpointError as e:
            log.warning("not averaging invalid checkpoint %s", e)
    if len(paths) < count:
        raise CheckpointError(f"{run_dir}: {len(paths)} valid checkpoint(s), asked to average {count} "
                              "(train.keep_last keeps that many; train.ckpt_every sets how far apart)")
    newest = read_checkpoint(paths[0])
    total = {k: v.double() if v.is_floating_point() else v for k, v in newest["model"].items()}
    for path in paths[1:]:
        for k, v in read_checkpoint(path)["model"].items():
            if v.is_floating_point():
                total[k] += v.double()
    newest["model"] = {k: (v / count).to(newest["model"][k].dtype) if v.is_floating_point() else v
                       for k, v in total.items()}
    return paths[::-1], newest


def model_from_checkpoint(ckpt: dict, device="cpu") -> tuple[AED, Tokenizer, FeatureConfig]:
    """Model (eval mode), tokenizer and feature settings of a checkpoint read by `read_checkpoint`."""
    ckpt = Checkpoint.from_dict(ckpt)
    model = AED(AEDConfig(**ckpt.model_config))
    model.load_state_dict(ckpt.model)
    return model.to(device).eval(), unpack_tokenizer(ckpt.tokenizer), FeatureConfig(**ckpt.features)


# --- a model ready for inference ------------------------------------------------------------------


@dataclass
class LoadedModel:
    """What `load_model` returns: a model ready to decode and what it needs to read audio and text."""

    model: AED  # eval mode, on its device
    tokenizer: Tokenizer
    features: FeatureConfig
    path: str  # the checkpoint file that was loaded
    max_train_duration: float | None = None  # longest utterance it was trained on (s); None: not recorded
    edge_silence: tuple | None = None  # (before, after) s of silence around its training utterances' speech
    trim_silence: float | None = None  # s of silence training kept around each utterance's speech (train.trim_silence)
    varied_edges: tuple | None = None  # (least, most) s training moved each edge of its utterances by; None: as read
    compiled: CompiledAED | None = None  # the model with a compiled decoder step, which decoding then uses
    lm: str | None = None  # the n-gram of its training transcripts (LM_FILE beside its checkpoint), which its beam search fuses

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device


def quantize_int8(model: AED) -> AED:
    """`model` with int8 weights in every nn.Linear of encoder and decoder (activations quantized per
    call: torch's dynamic quantization), for CPUs: a batch-1 decoder step reads every weight once per
    token, and int8 weights are a quarter of the bytes. In place: a copy of the fp32 weights beside the
    int8 ones would double the memory the model needs while it loads. One scale per output channel,
    which keeps the WER of fp32 where one per matrix does not (docs/inference.md). Convolutions, norms
    and the embedding stay fp32 (the tied output projection gets its own int8 copy). CPU only: the
    kernels are fbgemm/oneDNN."""
    check_loading(next(model.parameters()).device, compile=False, int8=True)
    # torch.ao.quantization warns that it is deprecated in favour of torchao; it is still in torch, and
    # its eager int8 Linear is the one bench/infer_speed_bench.py measures.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.filterwarnings("ignore", message=".*quantize_per_tensor.*")
        qconfig = torch.ao.quantization.per_channel_dynamic_qconfig
        return torch.ao.quantization.quantize_dynamic(model, {nn.Linear: qconfig}, dtype=torch.qint8, inplace=True)


def check_loading(device, compile: bool, int8: bool, average: int = 1, ema: bool = False) -> None:
    """ValueError unless `load_model` can load with these settings; infer.py calls it before any work."""
    if ema and average > 1:
        raise ValueError("--ema and --average do not combine: the EMA is itself an average of the weights over the "
                         "last steps; decode one checkpoint's EMA")
    if compile and int8:
        raise ValueError("int8 and compile do not combine: torch.compile cannot trace torch's int8 Linear "
                         "into one graph; on a CPU at batch 1, int8 is the faster of the two")
    if int8 and torch.device(device).type != "cpu":
        raise ValueError("int8 weights run on CPUs only (torch's dynamic int8 Linear kernels); on a GPU use bf16")


def load_model(path: str, device="cpu", *, compile: bool = False, int8: bool = False, average: int = 1,
               ema: bool = False) -> LoadedModel:
    """A checkpoint (a train.py `ckpt-*` directory or a single file), or a run directory (its newest
    valid checkpoint: a truncated newer one is skipped with a warning naming it), ready for inference.
    average > 1: the mean weights of a run directory's newest `average` valid checkpoints.
    ema: the checkpoint's EMA of the weights (train.py's ema_decay, aed/train_setup.py) in place of its
    weights; buffers (BatchNorm statistics) and frozen parameters, which it does not average, are the
    checkpoint's own. CheckpointError when it has none; not with average (`check_loading`).

    compile: decode with a compiled decoder step (aed/model_static.py), compiled on the first batch of each
    shape bucket. int8: int8 Linear weights (`quantize_int8`), CPU only; the two do not combine (torch
    cannot trace the int8 Linear into one graph)."""
    check_loading(device, compile, int8, average, ema)
    if average > 1:
        if not os.path.isdir(path) or is_checkpoint(path):
            raise ValueError(f"{path}: averaging needs a run directory (its newest checkpoints are averaged)")
        averaged, ckpt = average_checkpoints(path, average)
        log.info("averaged the weights of %s", ", ".join(map(os.path.basename, averaged)))
        path = averaged[-1]
    else:
        path, ckpt = read_checkpoint_or_run(path, INFERENCE_KEYS)
    model, tokenizer, features = model_from_checkpoint(ckpt, device)
    if ema:  # by parameter, as training kept it: a tied weight (the output projection) is one parameter
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, weight in read_ema(path).items():
                params[name].copy_(weight)
        log.info("decoding the EMA of the weights of %s", path)
    if int8:
        model = quantize_int8(model)
    trained = Checkpoint.from_dict(ckpt)
    return LoadedModel(model, tokenizer, features, path, trained.max_train_duration,
                       trained.edge_silence and tuple(trained.edge_silence), trained.trim_silence,
                       trained.varied_edges and tuple(trained.varied_edges), CompiledAED(model) if compile else None,
                       lm=run_lm if os.path.isfile(run_lm := os.path.join(os.path.dirname(os.path.normpath(path)), LM_FILE))
                       else None)
