"""Train an attention encoder-decoder speech model (multilingual ASR + AST) with 2D bucketing.

    python train.py configs/tiny.yaml                                        # CPU, bundled data
    python train.py configs/tiny.yaml optim.lr=1e-3 max_steps=500            # key=value overrides
    torchrun --nproc_per_node 8 train.py configs/canary-1b-flash.yaml \\
        train.manifests='[{path: /data/en.jsonl, weight: 2}, /data/de.jsonl]' run_dir=runs/flash
    torchrun --nnodes 4 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint $HEAD:29500 \\
        train.py configs/canary-1b-flash.yaml ...                            # many nodes

The script reads top to bottom in the order things happen: config, distributed init, data,
model, optimizer, resume, loop, cleanup. Re-running the same command resumes from the newest
checkpoint in `run_dir`; SIGTERM / SIGUSR1 (a cluster job's time limit) saves one and exits 0.
"""

import atexit
import dataclasses
import json
import logging
import math
import os
import random
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.tensorboard import SummaryWriter

from aed.audio import FeatureConfig, LogMel, SpecAugment
from aed.checkpoint import load_latest, pack_dir, save_checkpoint
from aed.config import ConfigError, load_config, to_dict
from aed.data import Collate, UtteranceDataset, encode_utterance, ignore_stop_signals, read_manifest
from aed.decoding import DecodingOptions, decode
from aed.distributed import all_gather_objects, all_reduce, cleanup, gather_objects, init_distributed
from aed.memory import format_bytes, parse_bytes
from aed.metrics import bleu, wer
from aed.model import AED, AEDConfig
from aed.transducer import TransducerASR
from aed.shards import MixedSource, ShardDataset, ShardSource
from aed.tokenizer import Tokenizer
from oom import MemoryBudgetError, preflight
from sampler import Bins, BucketingSampler, estimate_bins, load_batch_sizes


@dataclass
class SpecAugmentConfig:
    freq_masks: int = 2  # Canary's SpecAugment: 2 frequency masks ...
    freq_width: int = 27  # ... of up to 27 mel bins
    time_masks: int = 10  # and 10 time masks ...
    time_width: float = 0.05  # ... of up to 5% of the utterance each


@dataclass
class DataConfig:
    manifests: list[dict | str] = field(default_factory=lambda: ["data/mini/train.jsonl"])  # paths, {path, weight} or {shards: DIR, weight}
    tokenizer: str = "data/mini/tokenizer"  # directory written by tools/train_tokenizer.py
    skip_invalid: bool = True  # bad manifest lines are skipped with a warning and counted, not fatal
    bins: str | None = None  # bins.json from `sampler.py estimate-bins`; None: estimate at start
    num_buckets: int = 30  # duration buckets when estimating bins (the paper: 30)
    sub_buckets: int = 2  # token sub-buckets per duration bucket (2 = the paper's 2D; 1 = 1D)
    batch_size: int | None = None  # fixed batch size (the padding-heavy baseline)
    max_duration: float | None = 360.0  # padded-duration budget per batch, seconds (Canary: 360)
    batch_sizes: str | None = None  # per-bucket batch sizes from oom.py (replaces the two above)
    allocation: str = "flexible"  # flexible: smallest bucket that fits; strict: drop what its sub-bucket can't hold
    min_tps: float | None = None  # drop examples below this many output tokens per second
    max_tps: float | None = None  # ... and above this (the paper filters at 25)
    buffer_size: int = 20000  # examples held by the bucketing buffer
    sync_buckets: bool = True  # same bucket on every rank each step (removes the tail-worker effect)
    num_workers: int = 2  # DataLoader workers decoding audio and computing features


@dataclass
class ValConfig:
    manifests: list[str] = field(default_factory=lambda: ["data/mini/dev.jsonl"])
    every: int = 500  # validate every N steps (and before step 1 and at the end)
    batch_duration: float = 300.0  # seconds of audio per decoding batch
    max_utterances: int | None = None  # validate on the first N utterances of each manifest only
    num_examples: int = 4  # transcripts shown in the log and TensorBoard


@dataclass
class OptimConfig:
    lr: float = 3e-4  # peak learning rate (Canary)
    betas: tuple[float, float] = (0.9, 0.98)
    weight_decay: float = 1e-3
    warmup_steps: int = 2500  # linear warmup, then inverse square root decay
    min_lr: float = 1e-6
    clip_grad: float = 1.0  # max gradient norm
    grad_accum: int = 1  # micro-batches per optimizer step


@dataclass
class TrainConfig:
    run_dir: str = "runs/tiny"  # checkpoints, metrics.jsonl, TensorBoard events, resolved config
    seed: int = 0
    objective: str = "aed"  # aed: encoder-decoder cross-entropy | rnnt: encoder + transducer (encoder pretraining)
    rnnt_chunk_size: int = 4  # rnnt: samples per joint tensor (1 = least memory, B = batched speed)
    rnnt_pred_dim: int = 640  # rnnt: predictor width (NeMo's default)
    rnnt_joint_dim: int = 640  # rnnt: joint width; the (B, T', U+1, H) joint dominates a small model's step
    max_steps: int = 100000
    log_every: int = 10
    ckpt_every: int = 1000
    keep_last: int = 3  # checkpoints kept in run_dir
    precision: str = "auto"  # auto (bf16 on GPU, fp32 on CPU) | fp32 | bf16 | fp16
    compile: bool = False  # torch.compile the model (checkpoints still save the raw module)
    activation_checkpointing: bool = False  # recompute encoder layers in backward: less memory, ~30% slower
    init_from: str | None = None  # initialise weights from this checkpoint (a fresh run, new optimizer)
    init_encoder_only: bool = False  # with init_from: only encoder weights; extra layers stay random
    max_bad_steps: int = 5  # abort after this many consecutive non-finite steps
    memory_budget: str | None = None  # e.g. "75GB": before step 0 run every bucket's worst batch once (oom.py)
    cpu_threads: int | None = None  # CPU training: torch threads; None = cores - DataLoader workers
    model: AEDConfig = field(default_factory=AEDConfig)
    features: FeatureConfig = field(default_factory=FeatureConfig)
    spec_augment: SpecAugmentConfig = field(default_factory=SpecAugmentConfig)
    train: DataConfig = field(default_factory=DataConfig)
    val: ValConfig = field(default_factory=ValConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)


# --- config -----------------------------------------------------------------------------------


def val_set_names(paths: list[str]) -> dict[str, str]:
    """Metric prefix per validation manifest: its file stem, or folder_stem when stems repeat
    (data/mini/dev.jsonl and data/mini/digits/dev.jsonl -> mini_dev, digits_dev)."""
    stems = [os.path.splitext(os.path.basename(p))[0] for p in paths]
    names = [f"{os.path.basename(os.path.dirname(os.path.abspath(p)))}_{s}" if stems.count(s) > 1 else s
             for p, s in zip(paths, stems)]
    if len(set(names)) < len(names):
        raise ConfigError(f"val.manifests need distinct file or folder names, got {paths}")
    return dict(zip(names, paths))


if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
    print(__doc__ + "\nUsage: train.py CONFIG.yaml [key=value ...]\n\nKeys and defaults:")
    print(json.dumps(to_dict(TrainConfig()), indent=2, default=str))
    sys.exit(0)
try:
    cfg = load_config(TrainConfig, sys.argv[1], sys.argv[2:])
    val_names = val_set_names(cfg.val.manifests)
except ConfigError as e:
    sys.exit(f"config error: {e}")

if cfg.objective not in ("aed", "rnnt"):
    sys.exit(f"config error: objective must be aed or rnnt, got {cfg.objective!r}")
if cfg.model.n_mels != cfg.features.n_mels:
    sys.exit(f"config error: model.n_mels={cfg.model.n_mels} but features.n_mels={cfg.features.n_mels}")

rank, local_rank, world_size, device = init_distributed()
master = rank == 0
logging.basicConfig(level=logging.INFO if master else logging.WARNING,
                    format=f"%(asctime)s [rank {rank}] %(message)s", datefmt="%H:%M:%S")
log = logging.getLogger("train")
os.makedirs(cfg.run_dir, exist_ok=True)
if master:
    log.info("config:\n%s", json.dumps(to_dict(cfg), indent=2, default=str))
    with open(os.path.join(cfg.run_dir, "config.json"), "w") as f:
        json.dump(to_dict(cfg), f, indent=2, default=str)

if device.type == "cpu":  # OpenMP threads that outnumber free cores spin and stall every op
    torch.set_num_threads(cfg.cpu_threads or max(1, len(os.sched_getaffinity(0)) // world_size
                                                 - cfg.train.num_workers))
torch.manual_seed(cfg.seed + rank)  # dropout / SpecAugment differ per rank; data order is the sampler's
random.seed(cfg.seed + rank)
np.random.seed(cfg.seed + rank)
precision = cfg.precision if cfg.precision != "auto" else ("bf16" if device.type == "cuda" else "fp32")
amp_dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


def autocast():
    return torch.autocast(device.type, dtype=amp_dtype) if amp_dtype else nullcontext()


# --- data -------------------------------------------------------------------------------------

tokenizer = Tokenizer.load(cfg.train.tokenizer)
if cfg.model.vocab_size != tokenizer.padded_vocab_size or cfg.model.pad_id != tokenizer.pad:
    log.info("model.vocab_size/pad_id set from the tokenizer: %d / %d",
             tokenizer.padded_vocab_size, tokenizer.pad)
    cfg.model = dataclasses.replace(cfg.model, vocab_size=tokenizer.padded_vocab_size, pad_id=tokenizer.pad)


def load_examples(specs: list, skip_invalid: bool, seed: int) -> list:
    """Manifests (paths or {path, weight}) -> utterances; weight w repeats a manifest's
    utterances int(w) times per epoch plus a random fraction w - int(w) of them."""
    rng = random.Random(seed)
    out = []
    for spec in specs:
        spec = {"path": spec} if isinstance(spec, str) else spec
        if set(spec) - {"path", "weight"} or "path" not in spec:
            raise ConfigError(f"train.manifests entry {spec!r}: expected a path or {{path, weight}}")
        utts = read_manifest(spec["path"], skip_invalid=skip_invalid)
        weight = float(spec.get("weight", 1.0))
        out += utts * int(weight) + rng.sample(utts, round((weight - int(weight)) * len(utts)))
        log.info("%s: %d utterances, %.2f h, weight %g", spec["path"], len(utts),
                 sum(u.duration for u in utts) / 3600, weight)
    return out


logmel = LogMel(cfg.features).train()  # train mode: dither
sampler_args = dict(allocation=cfg.train.allocation, min_tps=cfg.train.min_tps,
                    max_tps=cfg.train.max_tps, buffer_size=cfg.train.buffer_size, seed=cfg.seed,
                    rank=rank, world_size=world_size, sync_buckets=cfg.train.sync_buckets,
                    infinite=True)
bins = Bins.load(cfg.train.bins) if cfg.train.bins else None  # None: estimated from the manifests
batch_size_args = {"batch_size": cfg.train.batch_size, "max_duration": None, "batch_sizes": None}
if cfg.train.batch_sizes:
    bins, sizes = load_batch_sizes(cfg.train.batch_sizes)  # the bins the sizes were searched for
    batch_size_args = {"batch_size": None, "max_duration": None, "batch_sizes": sizes}
elif cfg.train.batch_size is None:
    batch_size_args["max_duration"] = cfg.train.max_duration
shard_specs = [s for s in cfg.train.manifests if isinstance(s, dict) and "shards" in s]

if shard_specs:
    # Tar shards (tools/make_shards.py) stream through the sampler's producer thread; workers
    # only decode audio. Bins come from `sampler.py estimate-bins` on the source manifests.
    if len(shard_specs) != len(cfg.train.manifests) or bins is None:
        sys.exit("config error: sharded training needs every train.manifests entry as {shards: DIR} "
                 "(convert manifests with tools/make_shards.py) and train.bins or train.batch_sizes")
    longest = max(max(row) for row in bins.tokens) if bins.tokens else None
    if longest is None or longest > cfg.model.dec_max_len:
        sys.exit(f"config error: sharded training needs 2D bins whose token bounds fit "
                 f"model.dec_max_len={cfg.model.dec_max_len} (the sampler drops longer examples)")
    sources = [ShardSource(s["shards"]) for s in shard_specs]
    source = sources[0] if len(sources) == 1 else MixedSource(
        sources, [float(s.get("weight", 1.0)) for s in shard_specs])
    sampler = BucketingSampler(source, bins, **batch_size_args, **sampler_args)
    dataset = ShardDataset(tokenizer, logmel, seed=cfg.seed)
else:
    train_utts = load_examples(cfg.train.manifests, cfg.train.skip_invalid, cfg.seed)
    num_tokens = [len(encode_utterance(tokenizer, u)[0]) for u in train_utts]
    too_long = [i for i, n in enumerate(num_tokens) if n > cfg.model.dec_max_len]
    if too_long:
        log.warning("dropping %d utterances whose prompt+text exceed dec_max_len=%d tokens, e.g. %s",
                    len(too_long), cfg.model.dec_max_len, train_utts[too_long[0]].where)
        keep = sorted(set(range(len(train_utts))) - set(too_long))
        train_utts, num_tokens = [train_utts[i] for i in keep], [num_tokens[i] for i in keep]
    examples = [{"duration": u.duration, "num_tokens": n} for u, n in zip(train_utts, num_tokens)]
    if bins is None:
        bins = estimate_bins([e["duration"] for e in examples], [e["num_tokens"] for e in examples],
                             cfg.train.num_buckets, cfg.train.sub_buckets)
        if master:
            bins.save(os.path.join(cfg.run_dir, "bins.json"))
    sampler = BucketingSampler(examples, bins, **batch_size_args, **sampler_args,
                               yield_indices=True)
    dataset = UtteranceDataset(train_utts, tokenizer, logmel, seed=cfg.seed)


class CountingBatches:
    """Counts the batches the DataLoader has taken from the sampler: the DataLoader prefetches,
    so a checkpoint rewinds the sampler by (taken - trained) batches to resume exactly."""

    def __init__(self, sampler):
        self.sampler, self.taken = sampler, 0

    def __iter__(self):
        for batch in self.sampler:
            self.taken += 1
            yield batch


batches = CountingBatches(sampler)
collate = Collate(tokenizer.pad)


def make_loader():
    # Its own generator: worker seeds must not consume the global RNG, or a resumed run's
    # dropout and SpecAugment would differ from an uninterrupted one.
    return DataLoader(dataset, batch_sampler=batches, collate_fn=collate,
                      num_workers=cfg.train.num_workers, pin_memory=device.type == "cuda",
                      worker_init_fn=ignore_stop_signals, generator=torch.Generator().manual_seed(cfg.seed))


spec_augment = SpecAugment(**dataclasses.asdict(cfg.spec_augment)).train().to(device)

# --- model and optimizer ----------------------------------------------------------------------

if cfg.objective == "aed":
    model = AED(cfg.model).to(device)
else:  # same encoder and parameter names: init_encoder_only later moves it into an AED
    model = TransducerASR(cfg.model, tokenizer.vocab_size, cfg.rnnt_chunk_size,
                          pred_dim=cfg.rnnt_pred_dim, joint_dim=cfg.rnnt_joint_dim).to(device)
if cfg.activation_checkpointing:
    model.encoder.checkpoint_activations = True
decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "pos_bias" not in n]
no_decay = [p for n, p in model.named_parameters() if p.dim() < 2 or "pos_bias" in n]
optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.optim.weight_decay},
                               {"params": no_decay, "weight_decay": 0.0}],
                              lr=cfg.optim.lr, betas=cfg.optim.betas)


def get_lr_factor(step: int) -> float:
    """Linear warmup to lr, then inverse square root decay (Noam), floored at min_lr."""
    o = cfg.optim
    s = max(step, 1)
    factor = min(s / max(o.warmup_steps, 1), math.sqrt(max(o.warmup_steps, 1) / s))
    return max(factor, o.min_lr / o.lr)


scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, get_lr_factor)
scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
log.info("model: %.2fM parameters (encoder %d x %d, decoder %d x %d), precision %s, device %s",
         sum(p.numel() for p in model.parameters()) / 1e6, cfg.model.enc_layers,
         cfg.model.enc_d_model, cfg.model.dec_layers, cfg.model.dec_d_model, precision, device)

# --- resume, or initialise from another checkpoint -------------------------------------------

step = 0
ckpt_path, ckpt = load_latest(cfg.run_dir)
if ckpt is not None:
    model.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    scheduler.load_state_dict(ckpt["scheduler"])
    scaler.load_state_dict(ckpt["scaler"])
    step = ckpt["step"]
    if len(ckpt["sampler"]) != world_size:
        sys.exit(f"{ckpt_path} was written by {len(ckpt['sampler'])} ranks; resume with the same "
                 f"world size (got {world_size}) or start a new run_dir with init_from={ckpt_path}")
    sampler.load_state_dict(ckpt["sampler"][rank])
    rng = ckpt["rng"][rank]
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    if device.type == "cuda" and rng["cuda"] is not None:
        torch.cuda.set_rng_state(rng["cuda"])
    log.info("resumed from %s at step %d", ckpt_path, step)
elif cfg.init_from:
    src = torch.load(cfg.init_from, map_location="cpu", weights_only=False)["model"]
    own = model.state_dict()
    prefix = "encoder." if cfg.init_encoder_only else ""
    # A tokenizer with blocks appended (a new language's SentencePiece model) keeps every old id:
    # the old rows of the vocabulary-sized tensors carry over, the new rows stay random.
    # (A CTC head's rows are not grown: its blank is the last id, so they are listed as a mismatch.)
    grown = [] if cfg.init_encoder_only else [
        "decoder.embedding.token_embedding.weight", "decoder.output_proj.weight", "decoder.output_proj.bias"]
    for k in grown:
        if k in src and k in own and src[k].shape[1:] == own[k].shape[1:] and len(src[k]) < len(own[k]):
            log.info("init_from: %s grows from %d to %d rows", k, len(src[k]), len(own[k]))
            src[k] = torch.cat([src[k], own[k][len(src[k]):]])
    loadable = {k: v for k, v in src.items() if k.startswith(prefix) and k in own
                and own[k].shape == v.shape}
    mismatched = [f"{k}: {tuple(v.shape)} -> {tuple(own[k].shape)}" for k, v in src.items()
                  if k.startswith(prefix) and k in own and own[k].shape != v.shape]
    if mismatched:
        sys.exit(f"init_from={cfg.init_from}: shape mismatches:\n  " + "\n  ".join(mismatched))
    model.load_state_dict(loadable, strict=False)
    fresh = sorted({".".join(k.split(".")[:3]) for k in own
                    if k.startswith(prefix) and k not in loadable})
    log.info("init_from %s: loaded %d tensors%s; left random: %s", cfg.init_from, len(loadable),
             " (encoder only)" if cfg.init_encoder_only else "", ", ".join(fresh) or "nothing")
del ckpt

# Before the DDP wrap: its gradient hooks must not fire during the check.
if cfg.memory_budget:
    try:
        peaks = preflight(model, optimizer, bins, sampler.sizes, parse_bytes(cfg.memory_budget),
                          cfg.features, precision, spec_augment, ddp=world_size > 1,
                          max_tps=cfg.train.max_tps)
    except MemoryBudgetError as e:
        sys.exit(f"preflight: {e}")
    log.info("preflight: all %d buckets fit %s (largest peak %s)", len(peaks), cfg.memory_budget,
             format_bytes(max(peaks)))
ddp_model = DDP(model) if world_size > 1 else model
fwd_model = torch.compile(ddp_model) if cfg.compile else ddp_model


def save(step: int) -> None:
    """All ranks send their sampler and RNG states to rank 0, which writes. Also checks that DDP
    kept the ranks' parameters identical (a desync would otherwise go unnoticed)."""
    checksum = sum(p.detach().double().sum().item() for p in model.parameters())
    rewind = batches.taken - consumed
    states = gather_objects({
        "checksum": checksum,
        "sampler": sampler.state_dict(rewind=rewind),
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate(),
                "numpy": np.random.get_state(),
                "cuda": torch.cuda.get_rng_state() if device.type == "cuda" else None}})
    if master:
        checksums = [s["checksum"] for s in states]
        if len(set(checksums)) > 1:
            raise RuntimeError(f"step {step}: ranks disagree on parameters (checksums {checksums})")
        path = save_checkpoint({
            "step": step, "model": model.state_dict(), "model_config": dataclasses.asdict(cfg.model),
            "features": dataclasses.asdict(cfg.features), "tokenizer": pack_dir(cfg.train.tokenizer),
            "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
            "scaler": scaler.state_dict(), "sampler": [s["sampler"] for s in states],
            "rng": [s["rng"] for s in states], "config": to_dict(cfg)},
            cfg.run_dir, step, cfg.keep_last)
        log.info("saved %s (parameter checksum %.6e, equal on %d rank(s))", path, checksum,
                 world_size)


# --- validation -------------------------------------------------------------------------------


@torch.no_grad()
def evaluate() -> dict:
    """Loss, WER (ASR, per language) and BLEU (AST, per pair) on every validation manifest.
    Each rank decodes a slice; hypotheses are gathered so every metric is a corpus metric."""
    model.eval()
    eval_logmel = LogMel(cfg.features).eval()
    results = {}
    for name, path in val_names.items():
        utts = read_manifest(path, skip_invalid=cfg.train.skip_invalid)[: cfg.val.max_utterances]
        order = sorted(range(len(utts)), key=lambda i: utts[i].duration)[rank::world_size]
        ds = UtteranceDataset([utts[i] for i in order], tokenizer, eval_logmel)
        groups, group, dur = [], [], 0.0  # batches of ~batch_duration seconds
        for j in range(len(ds)):
            group.append(j)
            dur += ds.utterances[j].duration
            if dur >= cfg.val.batch_duration:
                groups.append(group)
                group, dur = [], 0.0
        groups += [group] if group else []
        rows, loss_sum = [], torch.zeros(2, device=device)
        for group in groups:
            b = collate([ds[j] for j in group]).to(device)
            for err in b.errors:
                log.warning("validation: skipped unreadable audio: %s", err)
            if len(b) == 0:
                continue
            with autocast():
                loss, n = model(b.feats, b.feat_lens, b.tokens, b.token_lens, b.prompt_lens)
            loss_sum += torch.stack([loss.float(), n.float()])
            with autocast():
                if cfg.objective == "rnnt":
                    hyps = model.transcribe(b.feats, b.feat_lens)
                else:
                    prompt = torch.stack([b.tokens[k, : b.prompt_lens[k]] for k in range(len(b))])
                    hyps = decode(model, b.feats, b.feat_lens, prompt, tokenizer.eos, DecodingOptions())
            for k, j in enumerate(b.indices):
                u = ds.utterances[j]
                hyp = tokenizer.decode([t for t in hyps[k] if t < tokenizer.vocab_size])
                rows.append((u.taskname, u.source_lang, u.target_lang, u.text, hyp))
        all_reduce(loss_sum)
        rows = [r for part in all_gather_objects(rows) for r in part]
        results[f"{name}/loss"] = (loss_sum[0] / loss_sum[1].clamp(min=1)).item()
        for key in sorted({(t, s, g) for t, s, g, _, _ in rows}):
            refs = [r[3] for r in rows if r[:3] == key]
            hyps = [r[4] for r in rows if r[:3] == key]
            if key[0] == "asr":
                results[f"{name}/wer_{key[1]}"] = wer(refs, hyps)
                results[f"{name}/wer_pnc_{key[1]}"] = wer(refs, hyps, normalize=False)
            else:
                results[f"{name}/bleu_{key[1]}-{key[2]}"] = bleu(refs, hyps)
        asr = [r for r in rows if r[0] == "asr"]
        if asr:
            results[f"{name}/wer"] = wer([r[3] for r in asr], [r[4] for r in asr])
        results[f"{name}/examples"] = [f"{r[1]}->{r[2]} REF: {r[3]} | HYP: {r[4]}"
                                       for r in rows[: cfg.val.num_examples]]
    model.train()
    return results


# --- training loop ----------------------------------------------------------------------------

stop_signal = []
for sig in (signal.SIGTERM, signal.SIGUSR1):
    signal.signal(sig, lambda signum, frame: stop_signal.append(signum))

writer = SummaryWriter(cfg.run_dir) if master else None
metrics_file = open(os.path.join(cfg.run_dir, "metrics.jsonl"), "a") if master else None


def report(values: dict, step: int) -> None:
    """metrics.jsonl + TensorBoard on rank 0."""
    if not master:
        return
    metrics_file.write(json.dumps({"step": step, **values}) + "\n")
    metrics_file.flush()
    for k, v in values.items():
        if isinstance(v, list):
            writer.add_text(k, "  \n".join(v), step)
        elif isinstance(v, (int, float)):
            writer.add_scalar(k, v, step)


def rss_gb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e9


def log_validation(step: int) -> None:
    res = evaluate()
    report({f"val/{k}": v for k, v in res.items()}, step)
    for k, v in res.items():
        if isinstance(v, list):
            for line in v:
                log.info("  %s", line)
    log.info("validation @ step %d: %s", step, "  ".join(
        f"{k}={v:.2f}" for k, v in res.items() if isinstance(v, float)))


model.train()
consumed = batches.taken = 0  # batches the loop has trained on / the DataLoader has taken
loader_iter = iter(make_loader())


def stop_workers():
    """The workers ignore SIGTERM (make_loader), so multiprocessing's own exit hook, which
    terminates them with SIGTERM and then waits, would hang: release the iterator first, which
    shuts them down cleanly. Registered after that hook, so it runs before it on every exit path."""
    global loader_iter
    loader_iter = None


atexit.register(stop_workers)
bad_steps = skipped_audio = 0
t_start, t_last, steps_since, start_step = time.time(), time.time(), 0, step
totals = torch.zeros(8, device=device)  # loss, tokens, audio s, padded frames, frames, padded tok, tok, utts
if step == 0 and cfg.val.every > 0:
    log_validation(0)

while step < cfg.max_steps:
    micro = []
    while len(micro) < cfg.optim.grad_accum:
        batch = next(loader_iter)
        consumed += 1
        for err in batch.errors:
            log.warning("skipped unreadable audio: %s", err)
        skipped_audio += len(batch.errors)
        if len(batch):
            micro.append(batch)
    # Normalise by the global number of target tokens of this step, so ranks and micro-batches
    # with different 2D shapes weigh every token equally (DDP averages gradients: x world_size).
    ntok = torch.tensor(float(sum(int(model.count_targets(b.token_lens, b.prompt_lens).sum())
                                  for b in micro)), device=device)
    all_reduce(ntok)
    frame_s = cfg.features.hop_length / cfg.features.sample_rate
    # audio s, padded frames, frames, padded tokens, tokens, utterances: from the CPU copy, no sync
    shapes = [torch.tensor([b.feat_lens.sum() * frame_s, b.feats.shape[0] * b.feats.shape[1],
                            b.feat_lens.sum(), b.tokens.numel(), b.token_lens.sum(), len(b)],
                           dtype=torch.float, device=device) for b in micro]
    optimizer.zero_grad(set_to_none=True)
    for i, b in enumerate(micro):
        b = b.to(device, non_blocking=True)
        sync = i == len(micro) - 1 or world_size == 1
        try:
            with (nullcontext() if sync else ddp_model.no_sync()), autocast():
                feats = spec_augment(b.feats, b.feat_lens)
                loss, n = fwd_model(feats, b.feat_lens, b.tokens, b.token_lens, b.prompt_lens)
                scaler.scale(loss * world_size / ntok).backward()
        except Exception:
            log.error("step %d failed on batch %s feats %s tokens %s", step + 1, b.paths,
                      tuple(b.feats.shape), tuple(b.tokens.shape))
            raise
        totals[:2] += torch.stack([loss.detach().float(), n.float()])  # no host sync
        totals[2:] += shapes[i]
    scaler.unscale_(optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.clip_grad)
    # DDP has already averaged the gradients, so every rank sees the same norm: they skip together.
    if torch.isfinite(grad_norm):
        scaler.step(optimizer)
        bad_steps = 0
    else:
        bad_steps += 1
        log.warning("step %d: non-finite gradient norm, update skipped (%d in a row)", step + 1, bad_steps)
        if bad_steps >= cfg.max_bad_steps:
            sys.exit(f"aborting: {bad_steps} consecutive non-finite steps (lower optim.lr, check the "
                     f"data, or use precision=fp32); last batch: {micro[-1].paths}")
    scaler.update()
    scheduler.step()
    step += 1
    steps_since += 1

    if step % cfg.log_every == 0 or step == cfg.max_steps:
        all_reduce(totals)
        skipped = torch.tensor(float(skipped_audio), device=device)  # this rank's, summed below
        dt = time.time() - t_last
        loss_v = (totals[0] / totals[1].clamp(min=1)).item()
        eta = (time.time() - t_start) / (step - start_step) * (cfg.max_steps - step)
        mem = (torch.cuda.max_memory_allocated() / 1e9 if device.type == "cuda" else rss_gb())
        values = {"train/loss": loss_v, "train/lr": scheduler.get_last_lr()[0],
                  "train/grad_norm": grad_norm.item(),
                  "train/batch_size": totals[7].item() / steps_since / world_size,  # per rank and step
                  "train/audio_padding": 100 * (1 - (totals[4] / totals[3]).item()),
                  "train/text_padding": 100 * (1 - (totals[6] / totals[5]).item()),
                  "train/audio_s_per_s": totals[2].item() / dt, "train/tokens_per_s": totals[6].item() / dt,
                  "train/step_time": dt / steps_since, "train/memory_gb": mem,
                  "train/skipped_audio": int(all_reduce(skipped).item())}
        report(values, step)
        log.info(f"step {step} | loss {loss_v:.3f} | lr {values['train/lr']:.2e} | "
                 f"gnorm {values['train/grad_norm']:.2f} | bs {values['train/batch_size']:.1f} | "
                 f"pad audio {values['train/audio_padding']:.1f}% text {values['train/text_padding']:.1f}% | "
                 f"{values['train/audio_s_per_s']:.1f} audio s/s | {values['train/tokens_per_s']:.0f} tok/s | "
                 f"{values['train/step_time']:.2f} s/step | mem {mem:.2f} GB | eta {eta / 60:.1f} min")
        totals.zero_()
        t_last, steps_since = time.time(), 0

    if cfg.val.every > 0 and (step % cfg.val.every == 0 or step == cfg.max_steps):
        log_validation(step)
    stop = torch.tensor(float(bool(stop_signal)), device=device)
    all_reduce(stop, op=torch.distributed.ReduceOp.MAX)
    if step % cfg.ckpt_every == 0 or step == cfg.max_steps or stop.item():
        save(step)
    if stop.item():
        log.info("stopping on signal at step %d; rerun the same command to resume", step)
        break

# --- cleanup ----------------------------------------------------------------------------------

if master:
    writer.close()
    metrics_file.close()
cleanup()
