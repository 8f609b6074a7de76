"""Validation during training: the loss on every validation manifest, and for objectives that
transcribe, WER per language and BLEU per translation pair.

    model = whole_model(setup.model, lambda: setup.objective.build(setup.cfg, setup.tokenizer.vocab_size))
    results = evaluate(setup, model, {"dev": ManifestEntry.of("data/mini/dev.jsonl")}, rank, world_size,
                       skip_invalid, unreadable)
    results = evaluate(setup, model, {"dev": ManifestEntry.of({"shar": "data/dev_shar"})}, ...)   # any entry
    results = validate(setup, val_names, proc, unreadable, run_log, step, ema)   # a run's: logged, recorded

Each rank scores a slice of every manifest; losses are all-reduced and hypotheses gathered, so
every metric is a corpus metric over the whole manifest. Hypotheses come from the objective's
`hypotheses`, the AED's through `aed.decode_search.decode_features`, infer.py's own path, with the
options of the val.decoding section (infer.py's decoding flags, the same defaults).
"""

import dataclasses
import logging
import time
import weakref
from contextlib import nullcontext
from itertools import islice

import torch
from torch.distributed.fsdp import FSDPModule

from aed.data_audio import LogMel
from aed.data_batch import Collate, ExampleDataset, as_utterance, duration_batches, encodable, fit_decoder
from aed.data_manifest import Faults, read_manifest
from aed.data_sources import ManifestEntry, metadata
from aed.decode_metrics import corpus_scores
from aed.decode_timing import frame_seconds
from aed.model_static import CompiledAED
from aed.train_data import silence_trimmer
from aed.train_distributed import Process, all_gather_objects, all_reduce, full_copy
from aed.train_setup import autocast, count_ctc_skipped, train_mode

log = logging.getLogger(__name__)

# val.compile: each model's compiled decoder, made at its first validation and reused by the later ones
# (the graphs read the parameters the optimizer updates in place).
COMPILED = weakref.WeakKeyDictionary()
# FSDP2: each sharded model's whole copy, built at its first validation; the later ones copy the
# gathered weights into it in place, so its compiled decoder (above) stays valid.
WHOLE = weakref.WeakKeyDictionary()


def whole_model(model, build):
    """The model validation runs: `model` itself when it is whole (one process, or the module DDP
    wraps: its forward outside the wrapper runs no collective); for a model sharded with FSDP2, a
    whole copy on every rank, made by `build()` once and given the current weights at every call.
    Every rank calls this at the same point, and the gather is its one collective. Decoding then
    needs none: each rank decodes its own slice alone, for as many decoder steps as its hypotheses
    need, where a sharded model (a collective in every layer call) would have to hold every rank
    to the same number of batches and steps."""
    if not isinstance(model, FSDPModule):
        return model
    WHOLE[model] = full_copy(model, build, into=WHOLE.get(model))
    return WHOLE[model]


@torch.no_grad()
def evaluate(setup, model, manifests: dict[str, ManifestEntry], rank: int, world_size: int, skip_invalid: bool,
             unreadable: Faults) -> dict:
    """{name: entry} -> {"name/loss": ..., "name/wer": ..., "name/examples": [lines], ...}; with a CTC
    head, also "name/ctc_wer" (its greedy transcripts' WER).

    setup: the run's aed.train_setup.TrainingSetup; model: its model, whole on every rank
    (`whole_model`: each rank decodes its own slice, for its own number of steps).
    Random draws in the model's forward (BEST-RQ's masks) come from a generator reseeded for
    every validation, so each one masks the same frames (losses of different steps compare) and
    training's random stream is left alone."""
    cfg, objective, tokenizer = setup.cfg, setup.objective, setup.tokenizer
    device = next(model.parameters()).device
    model.eval()
    logmel, collate = LogMel(cfg.features).eval(), Collate(tokenizer.pad)
    options = dataclasses.replace(cfg.val.decoding,
                                  frame_seconds=frame_seconds(cfg.features, cfg.model.subsampling_factor))
    decoder = None  # the model itself
    if cfg.val.compile and objective.compiles:
        if model not in COMPILED:
            COMPILED[model] = CompiledAED(model)
        decoder = COMPILED[model]
    results = {}
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(cfg.seed + rank)
        for name, entry in manifests.items():
            ds = val_dataset(entry, cfg.val.max_utterances, tokenizer if objective.reads_text else None, logmel,
                             skip_invalid, rank, world_size, cfg.model.dec_max_len, silence_trimmer(cfg))
            sums = torch.zeros(3, device=device)  # loss, targets, transcriptions too short for CTC
            rows = []  # (task, source language, target language, reference, hypothesis)
            heard = {}  # source language -> [NLL with its own audio, NLL with another's, targets]
            ctc_rows = []  # the CTC head's greedy transcripts: the same rows as `rows`, transcriptions only
            for group in duration_batches([u.duration for u in ds.utterances], cfg.val.batch_duration):
                b = collate([ds[j] for j in group]).to(device)
                unreadable.report(b.errors, "validation")
                if len(b) == 0:
                    continue
                with autocast(device, setup.precision):
                    loss, n = model(b.feats, b.feat_lens, b.tokens, b.token_lens, b.prompt_lens, b.transcribed)
                    if hasattr(model, "token_nll") and len(b) > 1:
                        languages = [ds.utterances[j].source_lang for j in b.indices]
                        add_listening(heard, model, b, languages)
                    if getattr(model, "ctc", None) is not None:
                        ctc_rows += ctc_transcripts(model, b, [ds.utterances[j] for j in b.indices], tokenizer)
                hyps = [] if objective.hypotheses is None else objective.hypotheses(
                    model, b, tokenizer.eos, options, autocast(device, setup.precision), decoder)
                sums += torch.stack([loss.float(), n.float(), torch.tensor(float(count_ctc_skipped(model, [b])),
                                                                           device=device)])
                for k, hyp in enumerate(hyps):
                    u = ds.utterances[b.indices[k]]
                    text = tokenizer.decode_hypothesis(hyp)
                    rows.append((u.taskname, u.source_lang, u.target_lang, u.text, text))
            sums = all_reduce(sums)
            results[f"{name}/loss"] = (sums[0] / sums[1].clamp(min=1)).item()
            if objective.hypotheses is not None:
                results |= scores(name, [r for part in all_gather_objects(rows) for r in part], int(sums[2]), cfg.val)
            if getattr(model, "ctc", None) is not None:
                _, ctc_wer = corpus_scores([r for part in all_gather_objects(ctc_rows) for r in part],
                                           cfg.val.normalizer)
                if ctc_wer is not None:
                    results[f"{name}/ctc_wer"] = ctc_wer
            if hasattr(model, "token_nll"):
                results |= listening(name, all_gather_objects(heard))
    train_mode(model, cfg.freeze)
    return results


def val_dataset(entry: ManifestEntry, max_utterances: int | None, tokenizer, logmel: LogMel, skip_invalid: bool,
                rank: int, world_size: int, max_tokens: int | None = None, trim=None):
    """This rank's share of a validation set, the shortest first: every world_size-th utterance in
    order of duration. entry: a manifest, or a streamed train.manifests entry (aed/data_sources.py),
    whose examples are held in memory (a validation set is small) and decoded when scored; the
    first `max_utterances` in file order are used. tokenizer None: audio only (objective=ssl).
    Utterances over `max_tokens` (model.dec_max_len) are dropped and counted, as training drops them;
    `trim` cuts their edge silence as training's (`aed.train_data.silence_trimmer`)."""
    if not entry.streamed:
        path = entry.path
        utts = read_manifest(path, skip_invalid, needs_text=tokenizer is not None)[:max_utterances]
        if tokenizer is not None:
            utts, num_tokens = encodable(utts, tokenizer, skip_invalid)
            if max_tokens is not None:
                utts, _ = fit_decoder(utts, num_tokens, max_tokens, f"validation on {path}")
        order = sorted(range(len(utts)), key=lambda i: utts[i].duration)[rank::world_size]
        return ExampleDataset([utts[i] for i in order], tokenizer, logmel, trim=trim)
    source = entry.open(shuffle_shards=False)
    rows = [(fields["duration"], where) for where, fields in islice(metadata(source), max_utterances)]
    mine = {where for _, where in sorted(rows)[rank::world_size]}  # durations from metadata: no audio read
    examples = sorted((ex for _, _, ex in source.read(0, 0, 1) if ex["where"] in mine), key=lambda ex: ex["duration"])
    if tokenizer is not None:
        utts, num_tokens = encodable([as_utterance(ex) for ex in examples], tokenizer, skip_invalid)
        if max_tokens is not None:
            utts, _ = fit_decoder(utts, num_tokens, max_tokens, "validation")
        kept = {u.where for u in utts}
        examples = [ex for ex in examples if ex["where"] in kept]
    return ExampleDataset(examples, tokenizer, logmel, trim=trim)


def ctc_transcripts(model, b, utterances: list, tokenizer) -> list[tuple]:
    """The CTC head's greedy transcripts of batch b's transcription rows, as `scores` takes rows:
    whether the encoder has learned the sounds, apart from whether the decoder uses them."""
    enc, enc_lens = model.encoder(b.feats, b.feat_lens)
    transcribed = [True] * len(b) if b.transcribed is None else b.transcribed.tolist()
    return [("asr", u.source_lang, u.target_lang, u.text, tokenizer.decode(ids))
            for u, ids, asr in zip(utterances, model.ctc.greedy_decode(enc, enc_lens), transcribed) if asr]


# A decoder that uses the audio scores over a nat per token worse when it gets another utterance's;
# one that has become a language model of the text, under a tenth of a nat (docs/REPORT.md, "Long
# sentences", on several corpora). Below this gap, between the two, train.py warns.
LISTENING_GAP = 0.25  # nats per token


def add_listening(heard: dict, model, b, languages: list) -> None:
    """Adds batch b's decoder NLL with each row's own audio and with the next row's (rows are sorted
    by duration, so that audio is about as long) to `heard`, by source language."""
    memory, memory_lens = model.encode(b.feats, b.feat_lens)
    own, count = model.token_nll(memory, memory_lens, b.tokens, b.token_lens, b.prompt_lens)
    other, _ = model.token_nll(memory.roll(1, 0), memory_lens.roll(1, 0), b.tokens, b.token_lens, b.prompt_lens)
    for lang, o, x, c in zip(languages, own.tolist(), other.tolist(), count.tolist()):
        sums = heard.setdefault(lang, [0.0, 0.0, 0])
        sums[0], sums[1], sums[2] = sums[0] + o, sums[1] + x, sums[2] + c


@torch.no_grad()
def batch_listening_gap(whole, batch, device, precision: str, freeze: str) -> float | None:
    """The decoder's cross-entropy per token on a training batch with other rows' audio minus with
    its own (`add_listening`), over every rank's batch: what the validation check measures, cheap
    enough to watch during training. None where no rank has two rows to swap audio between; then
    `whole()` (the model, whole: `whole_model`, which gathers a sharded one) is not called. Every rank
    calls this at the same step, whatever its batch (the sums are all-reduced)."""
    if not all_reduce(torch.tensor(float(len(batch) > 1), device=device)).item():
        return None
    model, heard = whole(), {}
    if len(batch) > 1:  # one row has no other audio: that rank adds nothing
        model.eval()
        with autocast(device, precision):
            add_listening(heard, model, batch.to(device), ["all"] * len(batch))
        train_mode(model, freeze)
    own, other, count = heard.get("all", (0.0, 0.0, 0))
    own, other, count = all_reduce(torch.tensor([own, other, count], dtype=torch.float64, device=device)).tolist()
    return (other - own) / count


def listening(name: str, parts: list) -> dict:
    """Every rank's `heard` -> the decoder's cross-entropy per token with the utterances' own audio
    (name/ce) and with other utterances' (name/ce_other_audio), and their difference per source
    language (name/ce_gap_LANG): near 0, the decoder ignores the audio."""
    total = {}
    for heard in parts:
        for lang, sums in heard.items():
            t = total.setdefault(lang, [0.0, 0.0, 0])
            t[0], t[1], t[2] = t[0] + sums[0], t[1] + sums[1], t[2] + sums[2]
    count = sum(t[2] for t in total.values())
    if not count:
        return {}
    results = {f"{name}/ce": sum(t[0] for t in total.values()) / count,
               f"{name}/ce_other_audio": sum(t[1] for t in total.values()) / count}
    return results | {f"{name}/ce_gap_{lang}": (t[1] - t[0]) / t[2] for lang, t in sorted(total.items()) if t[2]}


def listening_gaps(results: dict) -> dict:
    """{validation set: its cross-entropy with other utterances' audio minus with its own} (nats per
    token), for the sets where validation measured both."""
    return {key[:-len("/ce")]: results[f"{key}_other_audio"] - own for key, own in results.items()
            if key.endswith("/ce") and f"{key}_other_audio" in results}


def listens(results: dict) -> bool | None:
    """Whether the decoder uses the audio on every validation set that measured it (None: none did)."""
    gaps = listening_gaps(results)
    return None if not gaps else all(gap >= LISTENING_GAP for gap in gaps.values())


def not_listening(results: dict) -> list[str]:
    """Warnings, one per validation set, where the decoder's cross-entropy barely changes when it is
    given other utterances' audio: it predicts the text from the text alone."""
    lines = []
    for key, own in results.items():
        if not key.endswith("/ce") or f"{key}_other_audio" not in results:
            continue
        name, other = key[:-len("/ce")], results[f"{key}_other_audio"]
        if other - own < LISTENING_GAP:
            lines.append(f"the decoder is not using the audio on {name}: its cross-entropy with other utterances' "
                         f"audio is within {other - own:.2f} nats/token of its own ({other:.2f} vs {own:.2f}; a "
                         f"decoder that listens loses over {LISTENING_GAP} when the audio is swapped). Expected early "
                         "in a run; if it lasts, the run is training a language model (docs/training.md)")
    return lines


def scores(name: str, rows: list, ctc_skipped: int, val_cfg) -> dict:
    """The metrics of one manifest's gathered (task, source, target, reference, hypothesis) rows."""
    results = {f"{name}/ctc_skipped": ctc_skipped}
    if ctc_skipped > 0:
        log.info("validation %s: %d of %d utterances have more tokens than CTC frames allow: left out of the "
                 "CTC term of its loss", name, ctc_skipped, len(rows))
    groups, asr_wer = corpus_scores(rows, val_cfg.normalizer)
    for group_name, group in groups.items():  # "asr en" -> wer_en, wer_pnc_en; "ast en-es" -> bleu_en-es
        for metric in ("wer", "wer_pnc", "bleu"):
            if metric in group:
                results[f"{name}/{metric}_{group_name.split()[1]}"] = group[metric]
    if asr_wer is not None:
        results[f"{name}/wer"] = asr_wer
    results[f"{name}/examples"] = [f"{r[1]}->{r[2]} REF: {r[3]} | HYP: {r[4]}" for r in rows[: val_cfg.num_examples]]
    return results


def validate(setup, val_names: dict, proc: Process, unreadable: Faults, run_log, step: int, ema=None) -> dict:
    """A run's validation at `step` (every rank calls this at the same step): `evaluate`, then rank 0
    logs the results and records them in `run_log` (aed.train_progress.RunLog), with `val/listening`
    (1 or 0: whether the decoder uses the audio on every set). With an EMA of the weights, validation
    scores the EMA (what infer.py --ema decodes), swapped into the model for the duration."""
    t0 = time.time()
    with ema.swapped(setup.model) if ema is not None else nullcontext():
        model = whole_model(setup.model, lambda: setup.objective.build(setup.cfg, setup.tokenizer.vocab_size))
        # train.skip_invalid is one switch for all of a run's manifests, validation's included
        res = evaluate(setup, model, val_names, proc.rank, proc.world_size, setup.cfg.train.skip_invalid, unreadable)
    heard = listens(res)
    run_log.write({f"val/{k}": v for k, v in res.items()} | {"val/seconds": time.time() - t0}
                  | ({} if heard is None else {"val/listening": float(heard)}), step)
    for k, v in res.items():
        if isinstance(v, list):
            for line in v:
                log.info("  %s", line)
    log.info("validation @ step %d%s: %s  (%.1f s)", step, " (EMA weights)" if ema is not None else "", "  ".join(
        f"{k}={v:.2f}" for k, v in res.items() if isinstance(v, float)), time.time() - t0)
    if step > 0:  # at step 0 no decoder listens yet
        for line in not_listening(res):
            log.warning("step %d: %s", step, line)
    return res


def report_listening(results: dict, step: int) -> None:
    """The end of a run: whether the model it leaves uses the audio, from its last validation."""
    gaps = listening_gaps(results)
    if not gaps:
        return
    measured = ", ".join(f"{name} {gap:+.2f}" for name, gap in gaps.items())
    if listens(results):
        log.info("the final model (validated at step %d) uses the audio: its cross-entropy rises by %s nats/token "
                 "with other utterances' audio", step, measured)
    else:
        log.warning("*** the final model (validated at step %d) does not use the audio: its cross-entropy changes by "
                    "%s nats/token with other utterances' audio (under %g): it writes what a language model of the "
                    "training text would. Train longer, guide the attention (train.attention_guide), or check that "
                    "the transcripts belong to their audio (docs/training.md) ***", step, measured, LISTENING_GAP)
