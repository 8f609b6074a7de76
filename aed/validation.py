"""Validation during training: the loss on every validation manifest, and for objectives that
transcribe, WER per language and BLEU per translation pair.

    results = evaluate(setup, {"dev": "data/mini/dev.jsonl"}, rank, world_size, skip_invalid, unreadable)

Each rank scores a slice of every manifest; losses are all-reduced and hypotheses gathered, so
every metric is a corpus metric over the whole manifest.
"""

import logging
import weakref

import torch

from aed.audio import LogMel
from aed.compiled import CompiledAED
from aed.data import Collate, UnreadableAudio, UtteranceDataset, duration_batches, encodable, read_manifest
from aed.decoding import DecodingOptions
from aed.distributed import all_gather_objects, all_reduce
from aed.metrics import corpus_scores
from aed.timestamps import frame_seconds
from aed.training import autocast, count_ctc_skipped, train_mode

log = logging.getLogger(__name__)

# val.compile: each model's compiled decoder, made at its first validation and reused by the later ones
# (the graphs read the parameters the optimizer updates in place).
COMPILED = weakref.WeakKeyDictionary()


@torch.no_grad()
def evaluate(setup, manifests: dict[str, str], rank: int, world_size: int, skip_invalid: bool,
             unreadable: UnreadableAudio) -> dict:
    """{name: path} -> {"name/loss": ..., "name/wer": ..., "name/examples": [lines], ...}.

    setup: the run's aed.training_setup.TrainingSetup. Random draws in the model's forward (BEST-RQ's
    masks) come from a generator reseeded for every validation, so each one masks the same frames
    (losses of different steps compare) and training's random stream is left alone."""
    cfg, model, objective, tokenizer = setup.cfg, setup.model, setup.objective, setup.tokenizer
    device = next(model.parameters()).device
    model.eval()
    logmel, collate = LogMel(cfg.features).eval(), Collate(tokenizer.pad)
    options = DecodingOptions(ctc_weight=cfg.val.ctc_weight,
                              frame_seconds=frame_seconds(cfg.features, cfg.model.subsampling_factor))
    decoder = model
    if cfg.val.compile and objective.name == "aed":  # the transducer's greedy search has no cached step to compile
        if model not in COMPILED:
            COMPILED[model] = CompiledAED(model)
        decoder = COMPILED[model]
    results = {}
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(cfg.seed + rank)
        for name, path in manifests.items():
            utts = read_manifest(path, skip_invalid, needs_text=objective.reads_text)[: cfg.val.max_utterances]
            if objective.reads_text:
                utts, _ = encodable(utts, tokenizer, skip_invalid)
            order = sorted(range(len(utts)), key=lambda i: utts[i].duration)[rank::world_size]
            ds = UtteranceDataset([utts[i] for i in order], tokenizer if objective.reads_text else None, logmel)
            sums = torch.zeros(3, device=device)  # loss, targets, transcriptions too short for CTC
            rows = []  # (task, source language, target language, reference, hypothesis)
            for group in duration_batches([u.duration for u in ds.utterances], cfg.val.batch_duration):
                b = collate([ds[j] for j in group]).to(device)
                unreadable.report(b.errors, "validation")
                if len(b) == 0:
                    continue
                with autocast(device, setup.precision):
                    loss, n = model(b.feats, b.feat_lens, b.tokens, b.token_lens, b.prompt_lens, b.transcribed)
                    hyps = objective.transcribe(decoder, b, tokenizer.eos, options) if objective.transcribe else []
                sums += torch.stack([loss.float(), n.float(), torch.tensor(float(count_ctc_skipped(model, [b])),
                                                                           device=device)])
                for k, hyp in enumerate(hyps):
                    u = ds.utterances[b.indices[k]]
                    text = tokenizer.decode_hypothesis(hyp)
                    rows.append((u.taskname, u.source_lang, u.target_lang, u.text, text))
            sums = all_reduce(sums)
            results[f"{name}/loss"] = (sums[0] / sums[1].clamp(min=1)).item()
            if objective.transcribe is not None:
                results |= scores(name, [r for part in all_gather_objects(rows) for r in part], int(sums[2]), cfg.val)
    train_mode(model, cfg.freeze)
    return results


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
