"""Train an attention encoder-decoder speech model (multilingual ASR + AST) with 2D bucketing.

    python train.py configs/tiny.yaml                                        # CPU, bundled data
    python train.py configs/tiny.yaml optim.lr=1e-3 max_steps=500            # key=value overrides
    python train.py configs/canary-1b.yaml buckets.yaml                      # + oom.py --out's batch sizes
    torchrun --nproc_per_node 8 train.py configs/canary-1b-flash.yaml \\
        train.manifests='[{path: /data/en.jsonl, weight: 2}, /data/de.jsonl]' run_dir=runs/flash
    torchrun --nnodes 4 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint $HEAD:29500 \\
        train.py configs/canary-1b-flash.yaml ...                            # many nodes

`main()` reads top to bottom in the order things happen: config, distributed init, data, model,
optimizer, resume, loop, cleanup; the helpers above it are used once each. The training step
itself is `aed.training.train_step`, the function oom.py measures. Re-running the same command
resumes from the newest checkpoint in `run_dir`; SIGTERM / SIGUSR1 (a cluster job's time limit)
saves one and exits 0.
"""

import atexit
import dataclasses
import json
import logging
import os
import random
import signal
import sys
import time

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.tensorboard import SummaryWriter

from aed.audio import LogMel, SpecAugment
from aed.checkpoint import (CheckpointError, begin_checkpoint, checkpoint_dir, init_from_checkpoint, load_latest,
                            pack_dir, publish_checkpoint, rng_state, set_rng_state, write_shard)
from aed.config import ConfigError, help_text, load_train_config, resolve_model, to_dict
from aed.data import (Collate, ManifestError, UtteranceDataset, check_audio, duration_batches, encodable,
                      ignore_stop_signals, read_manifest)
from aed.decoding import DecodingOptions, decode
from aed.distributed import (all_gather_objects, all_reduce, barrier, cleanup, gather_objects, init_distributed,
                             peer_lost)
from aed.flops import StepFlops, matmul_peak
from aed.memory import format_bytes, parse_bytes
from aed.metrics import corpus_scores
from aed.shards import MixedSource, ShardDataset, ShardSource
from aed.timestamps import frame_seconds
from aed.tokenizer import Tokenizer
from aed.training import (autocast, build_model, build_optimizer, count_ctc_skipped, count_targets, lr_factor,
                          new_tokens, resolve_precision, train_mode, train_step)
from oom import MemoryBudgetError, preflight
from sampler import Bins, BucketingSampler, estimate_bins, load_batch_sizes

log = logging.getLogger("train")


# --- config -----------------------------------------------------------------------------------


def parse_config(argv: list[str]):
    """`train.py CONFIG.yaml [MORE.yaml ...] [key=value ...]` -> TrainConfig and validation set
    names (later files override earlier ones, e.g. oom.py --out's buckets); --help prints every
    key with its type, default and description."""
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__ + "\nUsage: train.py CONFIG.yaml [MORE.yaml ...] [key=value ...]\n\nConfig keys (YAML sections = "
              "dotted prefixes), type = default, description:\n\n" + help_text())
        sys.exit(0)
    try:
        files = next((i for i, a in enumerate(argv) if "=" in a), len(argv))  # the YAML files come first
        cfg = load_train_config(argv[:files], argv[files:])
        return cfg, val_set_names(cfg.val.manifests)
    except ConfigError as e:
        sys.exit(f"config error: {e}")


def val_set_names(paths: list[str]) -> dict[str, str]:
    """Metric prefix per validation manifest: its file stem, or folder_stem when stems repeat
    (data/mini/dev.jsonl and data/mini/digits/dev.jsonl -> mini_dev, digits_dev)."""
    stems = [os.path.splitext(os.path.basename(p))[0] for p in paths]
    names = [f"{os.path.basename(os.path.dirname(os.path.abspath(p)))}_{s}" if stems.count(s) > 1 else s
             for p, s in zip(paths, stems)]
    if len(set(names)) < len(names):
        raise ConfigError(f"val.manifests need distinct file or folder names, got {paths}")
    return dict(zip(names, paths))


# --- data -------------------------------------------------------------------------------------


def load_examples(specs: list, data_cfg, tokenizer, seed: int, rank: int, world_size: int) -> tuple[list, list]:
    """Manifests (paths or {path, weight}) -> (utterances, token counts); weight w repeats a
    manifest's utterances int(w) times per epoch plus a random fraction w - int(w) of them.
    Lines the tokenizer cannot encode and (with check_audio) utterances whose audio is unreadable
    or disagrees with its duration are skipped and counted, or stop the run without skip_invalid.
    tokenizer None (objective=ssl): audio-only lines are read, and every token count is 0."""
    rng = random.Random(seed)
    out, out_tokens = [], []
    for spec in specs:
        spec = {"path": spec} if isinstance(spec, str) else spec
        if set(spec) - {"path", "weight"} or "path" not in spec:
            raise ConfigError(f"train.manifests entry {spec!r}: expected a path or {{path, weight}}")
        utts = read_manifest(spec["path"], skip_invalid=data_cfg.skip_invalid, needs_text=tokenizer is not None)
        if tokenizer is not None:
            utts, num_tokens = encodable(utts, tokenizer, data_cfg.skip_invalid)
        else:
            num_tokens = [0] * len(utts)
        if data_cfg.check_audio:
            utts, num_tokens = with_valid_audio(spec["path"], utts, num_tokens, data_cfg, rank, world_size)
        weight = float(spec.get("weight", 1.0))
        picked = list(range(len(utts))) * int(weight) + rng.sample(range(len(utts)),
                                                                   round((weight - int(weight)) * len(utts)))
        out += [utts[i] for i in picked]
        out_tokens += [num_tokens[i] for i in picked]
        log.info("%s: %d utterances, %.2f h, weight %g", spec["path"], len(utts),
                 sum(u.duration for u in utts) / 3600, weight)
    return out, out_tokens


def with_valid_audio(path: str, utts: list, num_tokens: list, data_cfg, rank: int, world_size: int):
    """(utts, num_tokens) without the utterances whose audio header is unreadable or disagrees with
    the manifest's duration. Each rank reads 1/world_size of the headers; the problems are shared."""
    t0 = time.time()
    problems = sorted(p for part in all_gather_objects(
        check_audio(utts, data_cfg.duration_tolerance, rank, world_size)) for p in part)
    log.info("%s: read the audio headers of %d utterances in %.1f s", path, len(utts), time.time() - t0)
    if not problems:
        return utts, num_tokens
    if not data_cfg.skip_invalid:
        i, why = problems[0]
        raise ManifestError(f"{utts[i].where}: {utts[i].audio_filepath}: {why} ({len(problems)} such "
                            f"utterance(s); train.skip_invalid=true skips them)")
    if rank == 0:
        for i, why in problems[:10]:
            log.warning("skipping %s: %s: %s", utts[i].where, utts[i].audio_filepath, why)
        unreadable = sum(why.startswith("unreadable") for _, why in problems)
        log.warning("%s: skipped %d utterance(s) after reading their audio headers: %d unreadable, %d whose "
                    "duration is off by more than %g%%%s", path, len(problems), unreadable, len(problems) - unreadable,
                    100 * data_cfg.duration_tolerance, " (first 10 shown)" if len(problems) > 10 else "")
    bad = {i for i, _ in problems}
    keep = [i for i in range(len(utts)) if i not in bad]
    return [utts[i] for i in keep], [num_tokens[i] for i in keep]


def build_training_data(cfg, tokenizer, logmel, rank: int, world_size: int, master: bool):
    """(sampler, dataset, bins) for cfg.train: manifests in memory, or tar shards streamed
    through the sampler's producer thread (then bins come from the source manifests).
    objective=ssl reads audio alone: no text, 1D (duration) buckets."""
    ssl = cfg.objective == "ssl"
    sampler_args = dict(allocation=cfg.train.allocation, min_tps=cfg.train.min_tps,
                        max_tps=cfg.train.max_tps, buffer_size=cfg.train.buffer_size, seed=cfg.seed,
                        rank=rank, world_size=world_size, sync_buckets=cfg.train.sync_buckets,
                        overfill=cfg.train.buffer_overfill, infinite=True)
    bins = Bins.load(cfg.train.bins) if cfg.train.bins else None  # None: estimated from the manifests
    if cfg.train.batch_sizes:
        bins, sizes = load_batch_sizes(cfg.train.batch_sizes)  # the bins the sizes were searched for
        sampler_args["batch_sizes"] = sizes
    elif cfg.train.batch_size is not None:
        sampler_args["batch_size"] = cfg.train.batch_size
    else:
        sampler_args["max_duration"] = cfg.train.max_duration

    shard_specs = [s for s in cfg.train.manifests if isinstance(s, dict) and "shards" in s]
    if shard_specs:
        if ssl:
            raise ConfigError("objective=ssl reads manifests (audio-only lines are fine), not tar shards")
        if len(shard_specs) != len(cfg.train.manifests) or bins is None:
            raise ConfigError("sharded training needs every train.manifests entry as {shards: DIR} "
                              "(convert manifests with tools/make_shards.py) and train.bins or train.batch_sizes")
        longest = max(max(row) for row in bins.tokens) if bins.tokens else None
        if longest is None or longest > cfg.model.dec_max_len:
            raise ConfigError(f"sharded training needs 2D bins whose token bounds fit "
                              f"model.dec_max_len={cfg.model.dec_max_len} (the sampler drops longer examples)")
        sources = [ShardSource(s["shards"]) for s in shard_specs]
        source = sources[0] if len(sources) == 1 else MixedSource(
            sources, [float(s.get("weight", 1.0)) for s in shard_specs])
        return BucketingSampler(source, bins, **sampler_args), ShardDataset(tokenizer, logmel, seed=cfg.seed), bins

    utts, num_tokens = load_examples(cfg.train.manifests, cfg.train, None if ssl else tokenizer, cfg.seed, rank,
                                     world_size)
    too_long = [i for i, n in enumerate(num_tokens) if n > cfg.model.dec_max_len]
    if too_long:
        log.warning("dropping %d utterances whose prompt+text exceed dec_max_len=%d tokens, e.g. %s",
                    len(too_long), cfg.model.dec_max_len, utts[too_long[0]].where)
        keep = sorted(set(range(len(utts))) - set(too_long))
        utts, num_tokens = [utts[i] for i in keep], [num_tokens[i] for i in keep]
    if bins is None:
        bins = estimate_bins([u.duration for u in utts], num_tokens, cfg.train.num_buckets,
                             1 if ssl else cfg.train.sub_buckets, method=cfg.train.bin_method)
        if master:
            bins.save(os.path.join(cfg.run_dir, "bins.json"))
    examples = [{"duration": u.duration, "num_tokens": n} for u, n in zip(utts, num_tokens)]
    sampler = BucketingSampler(examples, bins, **sampler_args, yield_indices=True)
    return sampler, UtteranceDataset(utts, None if ssl else tokenizer, logmel, seed=cfg.seed), bins


class CountingBatches:
    """Counts the batches the DataLoader has taken from the sampler: the DataLoader prefetches,
    so a checkpoint rewinds the sampler by (taken - trained) batches to resume exactly."""

    def __init__(self, sampler):
        self.sampler, self.taken = sampler, 0

    def __iter__(self):
        for batch in self.sampler:
            self.taken += 1
            yield batch


# --- validation -------------------------------------------------------------------------------


@torch.no_grad()
def evaluate(model, cfg, val_names: dict, tokenizer, precision: str, rank: int, world_size: int,
             bad_audio: set) -> dict:
    """Loss, WER (ASR, per language) and BLEU (AST, per pair) on every validation manifest.
    Each rank decodes a slice; hypotheses are gathered so every metric is a corpus metric.
    Unreadable audio is logged the first time only (`bad_audio` holds what was logged)."""
    device = next(model.parameters()).device
    model.eval()
    logmel, collate = LogMel(cfg.features).eval(), Collate(tokenizer.pad)
    options = DecodingOptions(ctc_weight=cfg.val.ctc_weight,
                              frame_seconds=frame_seconds(cfg.features, cfg.model.subsampling_factor))
    results = {}
    for name, path in val_names.items():
        utts = read_manifest(path, skip_invalid=cfg.train.skip_invalid)[: cfg.val.max_utterances]
        utts, _ = encodable(utts, tokenizer, cfg.train.skip_invalid)
        order = sorted(range(len(utts)), key=lambda i: utts[i].duration)[rank::world_size]
        ds = UtteranceDataset([utts[i] for i in order], tokenizer, logmel)
        rows, loss_sum, count, ctc_skipped = [], torch.zeros((), device=device), torch.zeros((), device=device), 0
        for group in duration_batches([u.duration for u in ds.utterances], cfg.val.batch_duration):
            b = collate([ds[j] for j in group]).to(device)
            for err in set(b.errors) - bad_audio:
                log.warning("validation: skipped unreadable audio (logged once per run): %s", err)
                bad_audio.add(err)
            if len(b) == 0:
                continue
            with autocast(device, precision):
                loss, n = model(b.feats, b.feat_lens, b.tokens, b.token_lens, b.prompt_lens, b.transcribed)
                if cfg.objective == "rnnt":
                    hyps = model.transcribe(b.feats, b.feat_lens)
                else:
                    prompt = torch.stack([b.tokens[k, : b.prompt_lens[k]] for k in range(len(b))])
                    hyps = decode(model, b.feats, b.feat_lens, prompt, tokenizer.eos, options)
            loss_sum += loss.float()
            count += n
            ctc_skipped += count_ctc_skipped(model, [b])
            for k, j in enumerate(b.indices):
                u = ds.utterances[j]
                hyp = tokenizer.decode([t for t in hyps[k] if t < tokenizer.vocab_size])
                rows.append((u.taskname, u.source_lang, u.target_lang, u.text, hyp))
        totals = all_reduce(torch.stack([loss_sum, count, torch.tensor(float(ctc_skipped), device=device)]))
        rows = [r for part in all_gather_objects(rows) for r in part]
        results[f"{name}/loss"] = (totals[0] / totals[1].clamp(min=1)).item()
        results[f"{name}/ctc_skipped"] = int(totals[2])
        if totals[2] > 0:
            log.info("validation %s: %d of %d utterances have more tokens than CTC frames allow: left out of the "
                     "CTC term of its loss", name, int(totals[2]), len(rows))
        groups, asr_wer = corpus_scores(rows, cfg.val.normalizer)
        for group_name, scores in groups.items():  # "asr en" -> wer_en, wer_pnc_en; "ast en-es" -> bleu_en-es
            for metric in ("wer", "wer_pnc", "bleu"):
                if metric in scores:
                    results[f"{name}/{metric}_{group_name.split()[1]}"] = scores[metric]
        if asr_wer is not None:
            results[f"{name}/wer"] = asr_wer
        results[f"{name}/examples"] = [f"{r[1]}->{r[2]} REF: {r[3]} | HYP: {r[4]}"
                                       for r in rows[: cfg.val.num_examples]]
    train_mode(model, cfg.freeze)
    return results


@torch.no_grad()
def evaluate_ssl(model, cfg, val_names: dict, precision: str, rank: int, world_size: int, bad_audio: set) -> dict:
    """objective=ssl: the masked-prediction loss on every validation manifest (audio-only lines are
    fine). Masks come from a generator reseeded for every validation, so each one masks the same
    frames (losses of different steps compare) and training's random stream is left alone."""
    device = next(model.parameters()).device
    model.eval()
    logmel, collate, results = LogMel(cfg.features).eval(), Collate(0), {}
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(cfg.seed + rank)
        for name, path in val_names.items():
            utts = read_manifest(path, cfg.train.skip_invalid, needs_text=False)[: cfg.val.max_utterances]
            order = sorted(range(len(utts)), key=lambda i: utts[i].duration)[rank::world_size]
            ds = UtteranceDataset([utts[i] for i in order], None, logmel)
            totals = torch.zeros(2, device=device)
            for group in duration_batches([u.duration for u in ds.utterances], cfg.val.batch_duration):
                b = collate([ds[j] for j in group]).to(device)
                for err in set(b.errors) - bad_audio:
                    log.warning("validation: skipped unreadable audio (logged once per run): %s", err)
                    bad_audio.add(err)
                if len(b):
                    with autocast(device, precision):
                        loss, n = model(b.feats, b.feat_lens)
                    totals += torch.stack([loss.float(), n.float()])
            totals = all_reduce(totals)
            results[f"{name}/loss"] = (totals[0] / totals[1].clamp(min=1)).item()
    train_mode(model, cfg.freeze)
    return results


# --- logging ----------------------------------------------------------------------------------


class RunLog:
    """metrics.jsonl and TensorBoard scalars/text in the run directory, written by rank 0 only.

    A run resumed at step s replays the steps after s that its killed predecessor had already
    logged: their rows are dropped from metrics.jsonl, and TensorBoard purges their events."""

    def __init__(self, run_dir: str, master: bool, resumed_step: int = 0):
        self.writer = self.file = None
        if not master:
            return
        path = os.path.join(run_dir, "metrics.jsonl")
        if resumed_step and os.path.exists(path):
            with open(path) as f:
                rows = f.readlines()
            kept = [r for r in rows if r.strip() and json.loads(r).get("step", 0) <= resumed_step]
            if len(kept) < len(rows):
                log.info("metrics.jsonl: dropped %d rows logged after step %d (replayed now)",
                         len(rows) - len(kept), resumed_step)
                with open(path + ".tmp", "w") as f:
                    f.writelines(kept)
                os.replace(path + ".tmp", path)
        self.writer = SummaryWriter(run_dir, purge_step=resumed_step + 1 if resumed_step else None)
        self.file = open(path, "a")

    def write(self, values: dict, step: int) -> None:
        if self.file is None:
            return
        self.file.write(json.dumps({"step": step, **values}) + "\n")
        self.file.flush()
        for k, v in values.items():
            if isinstance(v, list):
                self.writer.add_text(k, "  \n".join(v), step)
            elif isinstance(v, (int, float)):
                self.writer.add_scalar(k, v, step)

    def close(self) -> None:
        if self.file is not None:
            self.writer.close()
            self.file.close()


def rss_gb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e9


# Sums kept on the device between progress lines (no host sync per step), in this order.
TOTALS = ("loss", "targets", "audio_s", "padded_frames", "frames", "padded_tokens", "tokens", "utterances",
          "ctc_skipped")


def batch_totals(model, batches: list, frame_s: float, device) -> torch.Tensor:
    """The TOTALS of host-side batches except the loss and its target count, on `device`."""
    return torch.tensor([0.0, 0.0,
                         sum(float(b.feat_lens.sum()) * frame_s for b in batches),
                         sum(b.feats.shape[0] * b.feats.shape[1] for b in batches),
                         sum(int(b.feat_lens.sum()) for b in batches),
                         sum(b.tokens.numel() for b in batches),
                         sum(int(b.token_lens.sum()) for b in batches),
                         sum(len(b) for b in batches),
                         count_ctc_skipped(model, batches)], device=device)


# --- the run ----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    cfg, val_names = parse_config(sys.argv[1:] if argv is None else argv)

    # --- distributed init, logging, seeds
    rank, local_rank, world_size, device = init_distributed()
    master = rank == 0
    logging.basicConfig(level=logging.INFO if master else logging.WARNING,
                        format=f"%(asctime)s [rank {rank}] %(message)s", datefmt="%H:%M:%S")
    os.makedirs(cfg.run_dir, exist_ok=True)
    if device.type == "cpu":  # OpenMP threads that outnumber free cores spin and stall every op
        torch.set_num_threads(cfg.cpu_threads or max(1, len(os.sched_getaffinity(0)) // world_size
                                                     - cfg.train.num_workers))
    torch.manual_seed(cfg.seed + rank)  # dropout / SpecAugment differ per rank; data order is the sampler's
    random.seed(cfg.seed + rank)
    np.random.seed(cfg.seed + rank)
    precision = resolve_precision(cfg.precision, device)
    if precision != "fp32" and device.type == "cpu":
        log.warning("precision=%s on CPU: autocast's casts cost more than they save for small models "
                    "(the tiny config ran 2.6x slower in bf16 than in fp32 on a 2-core x86 machine); "
                    "measure both, or use precision=auto (fp32 on CPU)", precision)

    # --- tokenizer (it sets the model's vocabulary), resolved config
    tokenizer = Tokenizer.load(cfg.train.tokenizer)
    cfg = resolve_model(cfg, tokenizer)
    if master:
        log.info("config:\n%s", json.dumps(to_dict(cfg), indent=2, default=str))
        with open(os.path.join(cfg.run_dir, "config.json"), "w") as f:
            json.dump(to_dict(cfg), f, indent=2, default=str)

    # --- data
    logmel = LogMel(cfg.features).train()  # train mode: dither
    try:
        sampler, dataset, bins = build_training_data(cfg, tokenizer, logmel, rank, world_size, master)
    except ConfigError as e:
        sys.exit(f"config error: {e}")
    except ManifestError as e:
        sys.exit(f"data error: {e}")
    batches = CountingBatches(sampler)

    def make_loader():
        # Its own generator: worker seeds must not consume the global RNG, or a resumed run's
        # dropout and SpecAugment would differ from an uninterrupted one.
        return DataLoader(dataset, batch_sampler=batches, collate_fn=Collate(tokenizer.pad),
                          num_workers=cfg.train.num_workers, pin_memory=device.type == "cuda",
                          worker_init_fn=ignore_stop_signals,
                          generator=torch.Generator().manual_seed(cfg.seed))

    # BEST-RQ's masking is its augmentation, and its targets come from the features as loaded.
    spec_augment = SpecAugment(cfg.spec_augment).train(cfg.objective != "ssl").to(device)

    # --- model and optimizer
    try:
        added_tokens = new_tokens(cfg, tokenizer.vocab_size)  # carried into every checkpoint of this run
    except ConfigError as e:
        sys.exit(f"config error: {e}")
    model = build_model(cfg, tokenizer.vocab_size, added_tokens).to(device)
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg.optim, cfg.max_steps))
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    head = (f"{cfg.ssl.codebooks} BEST-RQ head(s) x {cfg.ssl.codebook_size} classes" if cfg.objective == "ssl"
            else f"decoder {cfg.model.dec_layers} x {cfg.model.dec_d_model}")
    log.info("model: %.2fM parameters (encoder %d x %d, %s), precision %s, device %s",
             sum(p.numel() for p in model.parameters()) / 1e6, cfg.model.enc_layers, cfg.model.enc_d_model, head,
             precision, device)

    # --- resume, or initialise from another checkpoint
    step, total_flops = 0, 0.0  # optimizer steps, and the FLOPs they cost on all ranks together (aed/flops.py)
    try:
        ckpt_path, ckpt = load_latest(cfg.run_dir)
    except CheckpointError as e:
        sys.exit(f"cannot resume: {e}")
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        scaler.load_state_dict(ckpt["scaler"])
        step, total_flops = ckpt["step"], ckpt.get("flops", 0.0)  # checkpoints before FLOP accounting have none
        saved_world = len(ckpt["sampler"])
        if saved_world == world_size:
            sampler.load_state_dict(ckpt["sampler"][rank])
            set_rng_state(ckpt["rng"][rank], device)
        else:
            try:
                sampler.load_state_dict(sampler.regroup_state(ckpt["sampler"]))
            except ValueError as e:
                sys.exit(f"cannot resume {ckpt_path}, written by {saved_world} ranks, on {world_size}: {e}; "
                         f"resume with {saved_world} ranks or start a new run_dir with init_from={ckpt_path}")
            if rank < saved_world:
                set_rng_state(ckpt["rng"][rank], device)
            log.warning("%s was written by %d ranks, this run has %d: weights, optimizer, schedule and step "
                        "continue exactly; the data continues the interrupted pass without repeating what was "
                        "trained in it, in other batches than %d ranks would have drawn", ckpt_path, saved_world,
                        world_size, saved_world)
        log.info("resumed from %s at step %d", ckpt_path, step)
    elif cfg.init_from:
        try:
            log.info("init_from %s: %s", cfg.init_from, init_from_checkpoint(model, cfg.init_from, cfg.init_encoder_only))
        except ValueError as e:
            sys.exit(str(e))
    del ckpt

    # Before the DDP wrap: its gradient hooks must not fire during the check.
    if cfg.memory_budget:
        try:
            peaks = preflight(model, optimizer, bins, sampler.sizes, parse_bytes(cfg.memory_budget),
                              cfg.features, precision, spec_augment, ddp=world_size > 1,
                              max_tps=0.0 if cfg.objective == "ssl" else cfg.train.max_tps,
                              text_vocab_size=tokenizer.vocab_size)
        except MemoryBudgetError as e:
            sys.exit(f"preflight: {e}")
        log.info("preflight: all %d buckets fit %s (largest peak %s)", len(peaks), cfg.memory_budget,
                 format_bytes(max(peaks)))
        if device.type == "cuda":  # the progress line's peak memory is the training's, not the check's
            torch.cuda.reset_peak_memory_stats(device)
    ddp_model = DDP(model) if world_size > 1 else model
    fwd_model = torch.compile(ddp_model) if cfg.compile else ddp_model

    def save(step: int) -> None:
        """Every rank writes its share of the weights and optimizer state at once (aed/checkpoint.py);
        rank 0 adds the gathered sampler and RNG states and publishes the checkpoint once every
        shard is written. Also checks that DDP kept the ranks' parameters identical (a desync would
        otherwise go unnoticed)."""
        t0 = time.time()
        checksum = sum(p.detach().double().sum().item() for p in model.parameters())
        states = gather_objects({"checksum": checksum, "rng": rng_state(device),
                                 "sampler": sampler.state_dict(rewind=batches.taken - consumed)})
        path = checkpoint_dir(cfg.run_dir, step)
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
        if master:
            checksums = [s["checksum"] for s in states]
            if len(set(checksums)) > 1:
                raise RuntimeError(f"step {step}: ranks disagree on parameters (checksums {checksums})")
            state |= {"step": step, "flops": total_flops, "model_config": dataclasses.asdict(cfg.model),
                      "features": dataclasses.asdict(cfg.features), "tokenizer": pack_dir(cfg.train.tokenizer),
                      "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
                      "sampler": [s["sampler"] for s in states], "rng": [s["rng"] for s in states],
                      "config": to_dict(cfg), "max_train_duration": bins.durations[-1]}  # infer.py's chunk length
            if added_tokens is not None:  # a later run can still train only them (freeze=all_but_new_tokens)
                state["new_tokens"] = added_tokens
            begin_checkpoint(path)
        barrier()  # the directory exists before anyone writes into it
        written = torch.tensor(float(write_shard(state, path, rank, world_size)), device=device)
        written = all_reduce(written).item()  # returns once every rank has written its shard
        if master:
            publish_checkpoint(path, cfg.run_dir, step, cfg.keep_last)
        log.info("saved %s: %.2f GB in %.1f s (parameter checksum %.6e, equal on %d rank(s))",
                 path, written / 1e9, time.time() - t0, checksum, world_size)

    # --- training loop
    stop_signal = []
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, lambda signum, frame: stop_signal.append(signum))

    def stop_requested() -> bool:
        """Whether any rank got SIGTERM / SIGUSR1: all ranks stop at the same step."""
        flag = torch.tensor(float(bool(stop_signal)), device=device)
        return bool(all_reduce(flag, op=torch.distributed.ReduceOp.MAX).item())

    run_log = RunLog(cfg.run_dir, master, resumed_step=step)
    val_seconds = 0.0  # validation time, kept out of step times and the ETA
    bad_audio = set()  # the errors of unreadable files already logged

    def validate(step: int) -> None:
        nonlocal val_seconds
        t0 = time.time()
        res = (evaluate_ssl(model, cfg, val_names, precision, rank, world_size, bad_audio) if cfg.objective == "ssl"
               else evaluate(model, cfg, val_names, tokenizer, precision, rank, world_size, bad_audio))
        val_seconds += time.time() - t0
        run_log.write({f"val/{k}": v for k, v in res.items()} | {"val/seconds": time.time() - t0}, step)
        for k, v in res.items():
            if isinstance(v, list):
                for line in v:
                    log.info("  %s", line)
        log.info("validation @ step %d: %s  (%.1f s)", step, "  ".join(
            f"{k}={v:.2f}" for k, v in res.items() if isinstance(v, float)), time.time() - t0)

    train_mode(model, cfg.freeze)
    consumed = batches.taken = 0  # batches the loop has trained on / the DataLoader has taken
    loader = iter(make_loader())

    def stop_workers():
        """The workers ignore SIGTERM (make_loader), so multiprocessing's own exit hook, which
        terminates them with SIGTERM and then waits, would hang: release the iterator first,
        which shuts them down cleanly. Registered after that hook, so it runs before it."""
        nonlocal loader
        loader = None

    atexit.register(stop_workers)
    frame_s = cfg.features.hop_length / cfg.features.sample_rate
    bad_steps = skipped_audio = 0
    totals = torch.zeros(len(TOTALS), device=device)
    if step == 0 and cfg.val.every > 0:
        validate(0)
    step_flops, window_flops, run_flops = StepFlops(), 0.0, 0.0
    peak = matmul_peak(device, precision)  # per device: MFU is FLOP/s per rank over this
    log.info("matmul peak %.3g FLOP/s per device (%s, measured); FLOPs so far %.4g%s", peak, precision, total_flops,
             f" of a {cfg.budget_flops:.4g} budget" if cfg.budget_flops else "")

    def budget_spent() -> bool:
        return cfg.budget_flops is not None and total_flops >= cfg.budget_flops

    t_start, t_last, val_at_last, steps_since, start_step = time.time(), time.time(), val_seconds, 0, step
    val_at_start = val_seconds  # the step-0 validation ran before t_start: not to be subtracted again

    while step < cfg.max_steps and not budget_spent():
        micro = []
        while len(micro) < cfg.optim.grad_accum:
            batch = next(loader)
            consumed += 1
            for err in set(batch.errors) - bad_audio:  # the sampler draws a bad file again every pass
                log.warning("skipped unreadable audio (logged once per run): %s", err)
                bad_audio.add(err)
            skipped_audio += len(batch.errors)
            if len(batch):
                micro.append(batch)
        num_targets = all_reduce(torch.tensor(float(count_targets(model, micro)), device=device))
        totals += batch_totals(model, micro, frame_s, device)
        result, flops = step_flops.run(lambda: train_step(
            fwd_model, micro, optimizer, scaler, spec_augment, precision, cfg.optim.clip_grad, num_targets,
            world_size, ddp_model.no_sync if world_size > 1 else None), micro)
        flops = all_reduce(torch.tensor(float(flops), device=device)).item()  # every rank's: the budget is global
        total_flops, window_flops, run_flops = total_flops + flops, window_flops + flops, run_flops + flops
        totals[0] += result.loss
        totals[1] += result.count
        if result.updated:
            bad_steps = 0
        else:
            bad_steps += 1
            log.warning("step %d: non-finite gradient norm, update skipped (%d in a row)", step + 1, bad_steps)
            if bad_steps >= cfg.max_bad_steps:
                sys.exit(f"aborting: {bad_steps} consecutive non-finite steps (lower optim.lr, check the "
                         f"data, or use precision=fp32); last batch: {micro[-1].paths}")
        scheduler.step()
        step += 1
        steps_since += 1

        last = step == cfg.max_steps or budget_spent()
        if step % cfg.log_every == 0 or last:
            t = dict(zip(TOTALS, all_reduce(totals).tolist()))
            skipped = int(all_reduce(torch.tensor(float(skipped_audio), device=device)).item())
            dt = time.time() - t_last - (val_seconds - val_at_last)  # training time of the window
            trained = time.time() - t_start - (val_seconds - val_at_start)
            eta = trained / (step - start_step) * (cfg.max_steps - step)
            if cfg.budget_flops:  # whichever comes first, the last step or the spent budget
                eta = min(eta, trained / run_flops * max(cfg.budget_flops - total_flops, 0.0))
            mem = torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else rss_gb()
            values = {"train/loss": t["loss"] / max(t["targets"], 1), "train/lr": scheduler.get_last_lr()[0],
                      "train/grad_norm": result.grad_norm.item(),
                      "train/batch_size": t["utterances"] / steps_since / world_size,  # per rank and step
                      "train/audio_padding": 100 * (1 - t["frames"] / t["padded_frames"]),
                      "train/text_padding": 100 * (1 - t["tokens"] / t["padded_tokens"]) if t["padded_tokens"] else 0.0,
                      "train/audio_s_per_s": t["audio_s"] / dt, "train/tokens_per_s": t["tokens"] / dt,
                      "train/step_time": dt / steps_since, "train/memory_gb": mem, "train/skipped_audio": skipped,
                      "train/ctc_skipped": int(t["ctc_skipped"]),  # utterances left out of the CTC loss
                      "train/flops": total_flops, "train/flops_per_s": window_flops / dt,  # all ranks
                      "train/mfu": window_flops / dt / world_size / peak,
                      "train/flop_shapes": len(step_flops.cache)}  # batch shapes counted so far (each a slower step)
            run_log.write(values, step)
            log.info(f"step {step} | loss {values['train/loss']:.3f} | lr {values['train/lr']:.2e} | "
                     f"gnorm {values['train/grad_norm']:.2f} | bs {values['train/batch_size']:.1f} | "
                     f"pad audio {values['train/audio_padding']:.1f}% text {values['train/text_padding']:.1f}% | "
                     f"{values['train/audio_s_per_s']:.1f} audio s/s | {values['train/tokens_per_s']:.0f} tok/s | "
                     f"{values['train/step_time']:.2f} s/step | {total_flops:.3g} FLOPs | "
                     f"{values['train/flops_per_s'] / 1e9:.2f} GFLOP/s | MFU {100 * values['train/mfu']:.1f}% | "
                     f"mem {mem:.2f} GB | eta {eta / 60:.1f} min"
                     + (f" | {int(t['ctc_skipped'])} utts too short for CTC" if t["ctc_skipped"] else ""))
            totals.zero_()
            window_flops = 0.0
            t_last, val_at_last, steps_since = time.time(), val_seconds, 0

        # A preempted job has a grace period (often ~30 s) to save: a signal skips validation, and
        # one that arrives during validation or a save stops right after it, not after another step.
        stop = stop_requested()
        if not stop and cfg.val.every > 0 and (step % cfg.val.every == 0 or last):
            validate(step)
            stop = stop_requested()
        if stop or step % cfg.ckpt_every == 0 or last:
            save(step)
            stop = stop or stop_requested()
        if budget_spent():
            log.info("FLOP budget spent at step %d: %.4g of %.4g FLOPs", step, total_flops, cfg.budget_flops)
        if stop:
            log.info("stopping on signal at step %d; rerun the same command to resume", step)
            break

    # --- cleanup
    run_log.close()
    cleanup()


if __name__ == "__main__":
    try:
        main()
    except RuntimeError as e:
        if not peer_lost(e):
            raise
        # The rank that failed first logs its own reason; the others would only show a broken socket.
        sys.exit(f"stopping: a peer rank exited or lost its connection ({str(e).splitlines()[0][:200]}); "
                 "the log of the rank that failed first says why")
