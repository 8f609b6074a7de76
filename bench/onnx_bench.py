"""Exported models against aed itself, in two modes (`python bench/onnx_bench.py MODE --help` lists a mode's flags):

    speed (default)  CPU RTFx of the exported ONNX graphs against aed, on the same files, threads and
                     random-weight model; or (--features-of) sherpa-onnx's features under a trained model
    agreement        a trained model's exports decoded by their own runtimes, against aed's greedy tokens and WER

    python bench/onnx_bench.py                                   # canary-180m-flash, 16 dev files, 2 threads
    python bench/onnx_bench.py --files 3 --enc-layers 2          # a smoke run: minutes, not tens of minutes
    python bench/onnx_bench.py --features-of runs/demo          # a trained model: tokens under sherpa-onnx's features
    python bench/onnx_bench.py agreement --ckpt runs/demo                       # data/mini/digits/dev.jsonl
    python bench/onnx_bench.py agreement --ckpt runs/demo --nemo-path .venv/nemo-peers   # NeMo too

Every runtime decodes one file at a time (batch 1) with the file's languages and stops as it stops
(sherpa-onnx: 30 tokens per second of audio; NeMo: its generation delta); aed's greedy search is given
the same stop, without its CTC head (no export has one) or repetition guard. A table, then the JSON line.
    aed            eager fp32 (aed.decode_transcribe.transcribe)
    aed-int8       (speed) load_model(..., int8=True): torch's dynamic int8 Linear
    ort-fp32/int8  tools/export_onnx.py's graphs through onnxruntime (OnnxAED: aed's LogMel and greedy
                   loop); int8: onnxruntime's quantize_dynamic of the weights
    sherpa-onnx    the sherpa layout in sherpa-onnx's OfflineRecognizer.from_nemo_canary (its own C++
                   features, kaldi-native-fbank, and loop)
    transformers   (agreement) CanaryForConditionalGeneration.generate
    nemo           (agreement) EncDecMultiTaskModel.restore_from, its greedy search (in a subprocess with
                   --nemo-path on PYTHONPATH: NeMo needs transformers 4.x, the venv has 5.x) on aed's audio
    nemo-transcribe (agreement) the same export through NeMo's own transcribe(file paths): its loader pads
                   files under 1 s to 1 s; its text against aed's greedy text under NeMo's stop

speed: audio loading and features are timed, model loading is not. The model is the config's layout
(default configs/canary-180m-flash.yaml) with random weights and data/mini's tokenizer (canary2 prompts,
536 ids with the padding, not Canary's 5248: the output layer is smaller), EOS never chosen (bias -1e9,
as bench/common.py's `fixed_work`), so every system decodes the same number of tokens: sherpa-onnx's
limit. Exporting takes minutes for 17 encoder layers; --enc-layers shortens that for a smoke run.
A random-weight model's tokens hardly depend on the audio, so they cannot show what sherpa-onnx's own
features (kaldi-native-fbank) do to a trained model's tokens. --features-of measures that on any
trained checkpoint, canary2 or not (agreement runs sherpa-onnx itself on a canary2 one): on
data/mini's dev files, how often greedy tokens from the features sherpa-onnx computes
(kaldi-native-fbank with the options its Canary recognizer sets, offline-recognizer-canary-impl.h
and offline-stream.cc: hann window, no DC removal, librosa mel banks, snip_edges=false, per-bin
normalisation with the biased std) equal aed's, for both of the mel ranges its configs use.

agreement: exports the checkpoint as README's "Run an aed model elsewhere" does (tools/export_nemo.py,
tools/export_hf.py, tools/export_onnx.py --int8 --sherpa) into --work-dir, then decodes every file of
the manifest with each runtime; aed's tokens under each runtime's stop are the reference.
"""

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (MINI_TOKENIZER, ROOT, cores, load_avg, log, manifest_rows, print_json, print_table,  # noqa: E402
                    run_modes)

SYSTEMS = ["aed", "aed-int8", "ort-fp32", "ort-int8", "sherpa-onnx"]
NEMO_DELTA = 50  # NeMo's max_generation_delta in the released configs


# --- what both modes share: aed stopped as a runtime stops, and sherpa-onnx ----------------------------

def stopped_as(limit: int | None = None, max_delta: int = 10**6):
    """aed's greedy search stopped only where a runtime stops: after `limit` new tokens, or `max_delta`
    tokens past the encoder's frames (NeMo's generation delta); no CTC head, repetition guard or rate limit."""
    from aed import DecodingOptions

    return DecodingOptions(ctc_weight=0, max_repeats=0, max_tokens_per_second=None, max_delta=max_delta,
                           max_new_tokens=limit)


def token_limit(samples: int, factor: int) -> int:
    """sherpa-onnx's limit for a file of 16 kHz `samples` (offline-recognizer-canary-impl.h): 30 tokens per
    second of its encoder frames, less the last token it drops; kaldi-native-fbank's frames with snip_edges=false."""
    import torch

    from aed.model_encoder import subsampled_length

    frames = int(subsampled_length(torch.tensor((samples + 80) // 160), factor))
    return int(frames * factor / 100.0 * 30) + 1


def sherpa_recognizer(d: Path, source: str, target: str, threads: int, **kw):
    """sherpa-onnx's recognizer of the sherpa layout in `d`, for one task (it is fixed at creation)."""
    import sherpa_onnx

    return sherpa_onnx.OfflineRecognizer.from_nemo_canary(
        encoder=str(d / "encoder.onnx"), decoder=str(d / "decoder.onnx"), tokens=str(d / "tokens.txt"),
        src_lang=source, tgt_lang=target, num_threads=threads, **kw)


def sherpa_decode(recognizer, wav):
    """sherpa-onnx's result (.tokens, .text) of 16 kHz samples."""
    stream = recognizer.create_stream()
    stream.accept_waveform(16000, wav.numpy())
    recognizer.decode_stream(stream)
    return stream.result


# --- speed: RTFx of every runtime on a random-weight model --------------------------------------------

def make_checkpoint(config: Path, enc_layers: int | None, path: Path) -> None:
    """A random-weight checkpoint of `config`'s layout that load_model reads (see the module docstring)."""
    import torch

    from aed.data_audio import FeatureConfig
    from aed.data_tokenizer import Tokenizer
    from aed.model import AED, AEDConfig
    from aed.model_checkpoint import pack_dir

    tokenizer = Tokenizer.load(MINI_TOKENIZER)  # canary2 prompts, as sherpa-onnx builds them
    tokenizer.save(path.parent / "tokenizer")
    cfg = dataclasses.replace(AEDConfig.from_yaml(config), vocab_size=tokenizer.padded_vocab_size)
    if enc_layers:
        cfg = dataclasses.replace(cfg, enc_layers=enc_layers)
    torch.manual_seed(0)
    model = AED(cfg).eval()
    with torch.no_grad():
        model.decoder.output_proj.bias[tokenizer.eos] = -1e9
    torch.save({"model": model.state_dict(), "model_config": dataclasses.asdict(cfg),
                "features": dataclasses.asdict(FeatureConfig(n_mels=cfg.n_mels)),
                "tokenizer": pack_dir(path.parent / "tokenizer")}, path)


def sherpa_features(wav, n_mels: int, high_freq: float):
    """(S,) samples -> (1, T, F) normalised log-mels as sherpa-onnx's Canary recognizer computes them."""
    import kaldi_native_fbank as knf
    import numpy as np
    import torch

    opts = knf.FbankOptions()
    opts.frame_opts.dither, opts.frame_opts.snip_edges, opts.frame_opts.samp_freq = 0.0, False, 16000
    opts.frame_opts.remove_dc_offset, opts.frame_opts.window_type = False, "hann"
    opts.mel_opts.num_bins, opts.mel_opts.low_freq, opts.mel_opts.high_freq = n_mels, 0.0, high_freq
    opts.mel_opts.is_librosa = True
    fbank = knf.OnlineFbank(opts)
    fbank.accept_waveform(16000, wav.tolist())
    fbank.input_finished()
    x = np.stack([fbank.get_frame(i) for i in range(fbank.num_frames_ready)])  # (T, F)
    mean = x.mean(0)
    std = np.sqrt(np.maximum((x**2).mean(0) - mean**2, 0.0))  # biased, as sherpa-onnx's NemoNormalizePerFeature
    return torch.from_numpy((x - mean) / (std + 1e-5)).float()[None]


def feature_agreement(ckpt: str, rows: list) -> dict:
    """Per mel range: files whose greedy tokens from sherpa-onnx's features equal aed's, and the mean
    |difference| of the two features over their common frames."""
    import torch

    from aed.data_audio import LogMel, load_audio
    from aed.decode_search import DecodingOptions, greedy_search
    from aed.decode_timing import frame_seconds
    from aed.model_checkpoint import load_model

    asr = load_model(ckpt)
    options = DecodingOptions(ctc_weight=0, frame_seconds=frame_seconds(asr.features, asr.model.cfg.subsampling_factor))
    logmel = LogMel(asr.features).eval()

    @torch.inference_mode()
    def greedy(feats, source, target):  # the whole file as one chunk (transcribe may cut a long one)
        prompt = torch.tensor([asr.tokenizer.prompt_ids(source, target, True,
                                                        "transcribe" if source == target else "translate")])
        memory, memory_lens = asr.model.encode(feats, torch.tensor([feats.size(1)]))
        return greedy_search(asr.model, memory, memory_lens, prompt, asr.tokenizer.eos, options)[0]

    out = {}
    for high_freq in (-400.0, 0.0):  # kaldi's convention: <= 0 counts down from Nyquist (7600 Hz, 8000 Hz)
        equal, diffs = 0, []
        for f, s, t in rows:
            wav = load_audio(f)
            feats = sherpa_features(wav, asr.features.n_mels, high_freq)
            ours, _ = logmel(wav[None], torch.tensor([wav.numel()]))
            n = min(ours.size(1), feats.size(1))
            diffs.append((ours[:, :n] - feats[:, :n]).abs().mean().item())
            equal += greedy(feats, s, t) == greedy(ours, s, t)
        out[f"high_freq {high_freq:g}"] = {"equal": equal, "files": len(rows),
                                           "mean_abs_feature_diff": round(sum(diffs) / len(diffs), 4)}
        log(f"high_freq {high_freq:g}: tokens equal on {equal} of {len(rows)} files")
    return out


def speed_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=str(ROOT / "configs" / "canary-180m-flash.yaml"), help="the model's layout")
    p.add_argument("--enc-layers", type=int, help="override the config's encoder layers (a quicker export)")
    p.add_argument("--files", type=int, default=16, help="data/mini dev files, ASR and AST")
    p.add_argument("--threads", type=int, default=2, help="CPU threads, for every system")
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=SYSTEMS)
    p.add_argument("--features-of", metavar="CKPT", help="measure sherpa-onnx's features on this trained model instead")
    p.add_argument("--work-dir", default=str(Path(tempfile.gettempdir()) / "aed-onnx-bench"))


def speed_mode(args) -> None:
    import torch

    sys.path.insert(0, str(ROOT / "tools"))
    import export_onnx
    from aed.data_audio import audio_seconds, load_audio
    from aed import load_model, transcribe

    torch.set_num_threads(args.threads)
    rows = [(r["audio_filepath"], r["source_lang"], r["target_lang"])
            for r in manifest_rows(ROOT / "data" / "mini" / "dev.jsonl")]
    if args.features_of:
        result = feature_agreement(args.features_of, rows)
        print_table([("features", "<16"), ("equal", ">6d"), ("files", ">6d"), ("mean |diff|", ">12.4f")],
                    [[k, r["equal"], r["files"], r["mean_abs_feature_diff"]] for k, r in result.items()])
        print_json({"checkpoint": args.features_of, "threads": args.threads, "features": result})
        return
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    ckpt = work / "model.pt"
    log(f"random-weight model of {args.config} (encoder layers: {args.enc_layers or 'as configured'})")
    make_checkpoint(Path(args.config), args.enc_layers, ckpt)
    t0 = time.perf_counter()
    export_onnx.export(str(ckpt), str(work / "onnx"), int8=True, sherpa=True)
    log(f"exported and checked in {time.perf_counter() - t0:.0f} s")

    files = rows[:: max(1, len(rows) // args.files)][: args.files]  # every language and direction
    seconds = sum(audio_seconds(f) for f, _, _ in files)
    factor = torch.load(ckpt, weights_only=False)["model_config"]["subsampling_factor"]
    options = [stopped_as(token_limit(round(audio_seconds(f) * 16000), factor)) for f, _, _ in files]

    def aed_runner(asr):
        return lambda: sum(len(transcribe(asr, [f], opt, source_lang=s, target_lang=t)[0][0].tokens)
                           for (f, s, t), opt in zip(files, options))

    def ort_runner(runtime):
        return lambda: sum(len(runtime.decode(load_audio(f), runtime.tokenizer.prompt_ids(
            s, t, True, "transcribe" if s == t else "translate"), opt)) for (f, s, t), opt in zip(files, options))

    def sherpa_runner():
        recognizers = {(s, t): sherpa_recognizer(work / "onnx" / "sherpa", s, t, args.threads) for _, s, t in files}
        return lambda: sum(len(sherpa_decode(recognizers[s, t], load_audio(f)).tokens) for f, s, t in files)

    loaders = {  # system -> its runner, loaded before the clock starts
        "aed": lambda: aed_runner(load_model(str(ckpt))),
        "aed-int8": lambda: aed_runner(load_model(str(ckpt), int8=True)),
        "ort-fp32": lambda: ort_runner(export_onnx.OnnxAED(str(work / "onnx"), threads=args.threads)),
        "ort-int8": lambda: ort_runner(export_onnx.OnnxAED(str(work / "onnx"), int8=True, threads=args.threads)),
        "sherpa-onnx": sherpa_runner,
    }
    results = {}
    for name in args.systems:
        log(f"{name}: {len(files)} files, {seconds:.1f} s of audio")
        run = loaders[name]()
        t0 = time.perf_counter()
        tokens = run()
        wall = time.perf_counter() - t0
        results[name] = {"wall_s": round(wall, 3), "rtfx": round(seconds / wall, 2), "tokens": tokens}

    print_table([("system", "<12"), ("wall s", ">8.2f"), ("RTFx", ">7.2f"), ("tokens", ">7d")],
                [[name, r["wall_s"], r["rtfx"], r["tokens"]] for name, r in results.items()])
    print_json({"config": Path(args.config).name, "enc_layers": args.enc_layers, "files": len(files),
                "audio_s": round(seconds, 2), "threads": args.threads, "cores": cores(), "load_avg": load_avg(),
                "systems": results})


# --- agreement: a trained model's exports decoded by their runtimes -----------------------------------

def export_all(ckpt: str, work: Path) -> None:
    for argv in (["tools/export_nemo.py", "--ckpt", ckpt, "-o", str(work / "model.nemo")],
                 ["tools/export_hf.py", "--ckpt", ckpt, "-o", str(work / "hf")],
                 ["tools/export_onnx.py", "--ckpt", ckpt, "-o", str(work / "onnx"), "--int8", "--sherpa"]):
        log(f"exporting: {' '.join(argv)}")
        subprocess.run([sys.executable, *argv], cwd=ROOT, check=True, capture_output=True)


def nemo_tokens(work: Path, rows: list, nemo_path: str) -> list[list[int]]:
    """NeMo's greedy tokens per file (no prompt, no EOS), from a subprocess that imports NeMo."""
    script = f"""
import json, sys, torch
from nemo.collections.asr.models import EncDecMultiTaskModel
from nemo.utils import logging
logging.setLevel(logging.ERROR)
from aed.data_audio import load_audio
m = EncDecMultiTaskModel.restore_from({str(work / 'model.nemo')!r}, map_location="cpu").eval()
d = m.cfg.decoding
d.strategy, d.greedy.max_generation_delta = "greedy", {NEMO_DELTA}
m.change_decoding_strategy(d)
out = []
for row in json.load(sys.stdin):
    slots = {{"source_lang": row["source_lang"], "target_lang": row["target_lang"], "pnc": "yes"}}
    if m.cfg.prompt_format == "canary":
        slots["task"] = "asr" if row["source_lang"] == row["target_lang"] else "ast"
    else:
        slots.update(decodercontext="", emotion="<|emo:undefined|>", itn="no", timestamp="no", diarize="no")
    prompt = m.prompt.encode_dialog([{{"role": "user", "slots": slots}}])["context_ids"][None]
    wav = load_audio(row["audio_filepath"])
    m.eval()
    with torch.no_grad():
        f, fl = m.preprocessor(input_signal=wav[None], length=torch.tensor([wav.numel()]))
        e, el = m.encoder(audio_signal=f, length=fl)
        mem = m.encoder_decoder_proj(e.transpose(1, 2))
        mask = (torch.arange(mem.shape[1]) < el[:, None]).to(mem.dtype)
        best = m.decoding.decoding.greedy_search(encoder_hidden_states=mem, encoder_input_mask=mask,
                                                 decoder_input_ids=prompt)[0]
    toks = best[0, prompt.shape[1]:].tolist()
    eos = m.tokenizer.eos_id
    limit = min(m.transf_decoder.max_sequence_length, mem.shape[1] + {NEMO_DELTA}) - prompt.shape[1]
    out.append([toks[: toks.index(eos)] if eos in toks else toks, limit])
print(json.dumps(out))
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([nemo_path, str(ROOT)])}
    p = subprocess.run([sys.executable, "-c", script], input=json.dumps(rows), env=env, capture_output=True,
                       text=True, check=True)
    return json.loads(p.stdout.strip().splitlines()[-1])


def nemo_transcribed(work: Path, rows: list, nemo_path: str) -> list[str]:
    """NeMo's own `transcribe()` of each file's path, as a NeMo user runs the export: its dataloader
    (which pads every file shorter than 1 s to 1 s, half on each side), its features, its greedy search.
    The text per file, from a subprocess that imports NeMo; files of one language pair go in one call."""
    script = f"""
import json, sys
from nemo.collections.asr.models import EncDecMultiTaskModel
from nemo.utils import logging
logging.setLevel(logging.ERROR)
m = EncDecMultiTaskModel.restore_from({str(work / 'model.nemo')!r}, map_location="cpu").eval()
rows = json.load(sys.stdin)
out = [None] * len(rows)
for pair in sorted({{(r["source_lang"], r["target_lang"]) for r in rows}}):
    which = [i for i, r in enumerate(rows) if (r["source_lang"], r["target_lang"]) == pair]
    got = m.transcribe([rows[i]["audio_filepath"] for i in which], batch_size=1, verbose=False,
                       source_lang=pair[0], target_lang=pair[1], pnc="yes")
    for i, h in zip(which, got):
        out[i] = h if isinstance(h, str) else h.text
print(json.dumps(out))
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([nemo_path, str(ROOT)])}
    p = subprocess.run([sys.executable, "-c", script], input=json.dumps(rows), env=env, capture_output=True,
                       text=True, check=True)
    return json.loads(p.stdout.strip().splitlines()[-1])


def agreement_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ckpt", required=True, help="a trained checkpoint or run directory (what infer.py takes)")
    p.add_argument("--manifest", default=str(ROOT / "data" / "mini" / "digits" / "dev.jsonl"))
    p.add_argument("--nemo-path", help="a folder holding NeMo (bench/requirements-nemo-peers.txt): adds the nemo rows")
    p.add_argument("--work-dir", default=str(Path(tempfile.gettempdir()) / "aed-export-agreement"))


def agreement_mode(args) -> None:
    import torch

    sys.path.insert(0, str(ROOT / "tools"))
    import export_onnx
    from aed.data_audio import load_audio
    from aed.decode_metrics import wer
    from aed import load_model, transcribe

    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    export_all(args.ckpt, work)
    rows = manifest_rows(args.manifest)
    asr = load_model(args.ckpt)
    tok = asr.tokenizer
    refs = [row["text"] for row in rows]

    def aed(row, limit=None, max_delta=10**6):
        results, _ = transcribe(asr, [row["audio_filepath"]], stopped_as(limit, max_delta),
                                source_lang=row["source_lang"], target_lang=row["target_lang"])
        return results[0].tokens

    systems = {}  # name -> [(tokens, aed's tokens under the same stop, text)]
    log("decoding: aed, onnxruntime")
    reference = [aed(row) for row in rows]
    systems["aed"] = [(ref, ref, tok.decode(ref)) for ref in reference]
    for name, int8 in (("ort-fp32", False), ("ort-int8", True)):
        runtime = export_onnx.OnnxAED(str(work / "onnx"), int8=int8)
        got = [runtime.transcribe(r["audio_filepath"], r["source_lang"], r["target_lang"]) for r in rows]
        systems[name] = [(g, ref, tok.decode(g)) for g, ref in zip(got, reference)]

    log("decoding: transformers")
    import transformers

    processor = transformers.AutoProcessor.from_pretrained(work / "hf")
    hf = transformers.CanaryForConditionalGeneration.from_pretrained(work / "hf").eval()
    systems["transformers"] = []
    for row, ref in zip(rows, reference):
        inputs = processor.apply_transcription_request([load_audio(row["audio_filepath"]).numpy()],
                                                       source_language=row["source_lang"],
                                                       target_language=row["target_lang"])
        with torch.no_grad():
            ids = hf.generate(**inputs, max_new_tokens=len(ref) + 16, do_sample=False, num_beams=1)[0].tolist()
        ids = ids[inputs["decoder_input_ids"].shape[1]:]
        ids = ids[: ids.index(tok.eos)] if tok.eos in ids else ids
        systems["transformers"].append((ids, ref, processor.decode(ids, skip_special_tokens=True)))

    log("decoding: sherpa-onnx")
    d = work / "onnx" / "sherpa"
    symbols = {int(i): s.replace("\u2581", " ") for s, i in  # compared as the runtime's token strings
               (line.split(" ") for line in (d / "tokens.txt").read_text(encoding="utf-8").splitlines())}
    systems["sherpa-onnx"] = []
    factor = asr.model.cfg.subsampling_factor
    for row in rows:
        recognizer = sherpa_recognizer(d, row["source_lang"], row["target_lang"], 1, feature_dim=asr.features.n_mels)
        wav = load_audio(row["audio_filepath"])
        got = sherpa_decode(recognizer, wav)
        ref = [symbols[i] for i in aed(row, token_limit(wav.numel(), factor))]
        systems["sherpa-onnx"].append((list(got.tokens), ref, got.text))

    if args.nemo_path:
        log("decoding: nemo")
        systems["nemo"] = [(tokens, aed(row, limit, NEMO_DELTA), tok.decode(tokens))
                           for row, (tokens, limit) in zip(rows, nemo_tokens(work, rows, args.nemo_path))]
        log("decoding: nemo's transcribe()")
        texts = [tok.decode(aed(row, None, NEMO_DELTA)) for row in rows]  # aed under NeMo's stop, as text
        systems["nemo-transcribe"] = [(got, ours, got) for got, ours in
                                      zip(nemo_transcribed(work, rows, args.nemo_path), texts)]

    result, table = {}, []
    for name, pairs in systems.items():
        equal = sum(got == ref for got, ref, _ in pairs)
        score = wer(refs, [text for _, _, text in pairs])
        result[name] = {"equal": equal, "files": len(pairs), "wer": round(score, 2)}
        table.append([name, f"{equal} / {len(pairs)}", score])
    print_table([("runtime", "<16"), ("output equals aed's", ">19"), ("WER", ">6.1f")], table)
    print_json({"ckpt": args.ckpt, "manifest": args.manifest, "systems": result})


MODES = {  # name: (its flags, its run, what it measures)
    "speed": (speed_flags, speed_mode, "CPU RTFx of the ONNX exports against aed (or sherpa-onnx's features)"),
    "agreement": (agreement_flags, agreement_mode, "a trained model's exports' tokens and WER against aed's"),
}


def main(argv: list[str] | None = None) -> None:
    run_modes(__doc__, MODES, "speed", argv)


if __name__ == "__main__":
    main()
