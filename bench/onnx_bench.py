"""CPU RTFx of the exported ONNX graphs against aed itself, on the same files, threads and model.

    python bench/onnx_bench.py                                   # canary-180m-flash, 16 dev files, 2 threads
    python bench/onnx_bench.py --files 3 --enc-layers 2          # a smoke run: minutes, not tens of minutes

Systems, each decoding one file at a time (batch 1), audio loading and features included, model
loading not:
    aed          eager fp32 (aed.decode_transcribe.transcribe)
    aed-int8     load_model(..., int8=True): torch's dynamic int8 Linear
    ort-fp32     tools/export_onnx.py's graphs through onnxruntime (OnnxAED: aed's LogMel and greedy loop)
    ort-int8     the same with int8 weights (onnxruntime's quantize_dynamic)
    sherpa-onnx  the sherpa layout in sherpa-onnx's OfflineRecognizer (its own C++ features and loop)

The model is the config's layout (default configs/canary-180m-flash.yaml) with random weights and
data/mini's tokenizer (canary2 prompts, 536 ids with the padding, not Canary's 5248: the output
layer is smaller), EOS never chosen (bias -1e9, as bench/common.py's `fixed_work`), so
every system decodes the same number of tokens: sherpa-onnx's limit (30 per second of audio), which
aed's search is given too, without its repetition guard. Exporting takes minutes for 17 encoder
layers; --enc-layers shortens that for a smoke run.

    python bench/onnx_bench.py --features-of runs/demo          # a trained model: tokens under sherpa-onnx's features

A random-weight model's tokens hardly depend on the audio, so they cannot show what sherpa-onnx's own
features (kaldi-native-fbank) do to a trained model's tokens. --features-of measures that on any
trained checkpoint, canary2 or not (bench/export_agreement_bench.py runs sherpa-onnx itself on a
canary2 one): on data/mini's dev files, how often greedy tokens from the features sherpa-onnx computes
(kaldi-native-fbank with the options its Canary recognizer sets, offline-recognizer-canary-impl.h
and offline-stream.cc: hann window, no DC removal, librosa mel banks, snip_edges=false, per-bin
normalisation with the biased std) equal aed's, for both of the mel ranges its configs use.
"""

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import MINI_TOKENIZER, ROOT, cores, load_avg, log, print_json, print_table  # noqa: E402

SYSTEMS = ["aed", "aed-int8", "ort-fp32", "ort-int8", "sherpa-onnx"]


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


def token_limit(seconds: float, factor: int) -> int:
    """sherpa-onnx's limit for a file (offline-recognizer-canary-impl.h): 30 tokens per second of its
    encoder frames, less the last token it drops; kaldi-native-fbank's frames with snip_edges=false."""
    from aed.model_encoder import subsampled_length

    import torch

    frames = int(subsampled_length(torch.tensor((round(seconds * 16000) + 80) // 160), factor))
    return int(frames * factor / 100.0 * 30) + 1


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
    from aed.decode_timestamps import frame_seconds
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


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(ROOT / "configs" / "canary-180m-flash.yaml"), help="the model's layout")
    p.add_argument("--enc-layers", type=int, help="override the config's encoder layers (a quicker export)")
    p.add_argument("--files", type=int, default=16, help="data/mini dev files, ASR and AST")
    p.add_argument("--threads", type=int, default=2, help="CPU threads, for every system")
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=SYSTEMS)
    p.add_argument("--features-of", metavar="CKPT", help="measure sherpa-onnx's features on this trained model instead")
    p.add_argument("--work-dir", default=str(Path(tempfile.gettempdir()) / "aed-onnx-bench"))
    args = p.parse_args(argv)

    import torch

    sys.path.insert(0, str(ROOT / "tools"))
    import export_onnx
    from aed.data_audio import audio_seconds, load_audio
    from aed.data_manifest import read_rows
    from aed import DecodingOptions, load_model, transcribe

    torch.set_num_threads(args.threads)
    rows = list(read_rows(str(ROOT / "data" / "mini" / "dev.jsonl"), lambda d, where, base: (
        str(Path(base) / d["audio_filepath"]), d["source_lang"], d["target_lang"])))
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
    options = [DecodingOptions(ctc_weight=0, max_repeats=0, max_tokens_per_second=None, max_delta=10**6,
                               max_new_tokens=token_limit(audio_seconds(f), factor)) for f, _, _ in files]

    def aed_runner(asr):
        return lambda: sum(len(transcribe(asr, [f], opt, source_lang=s, target_lang=t)[0][0].tokens)
                           for (f, s, t), opt in zip(files, options))

    def ort_runner(runtime):
        def run():
            tokens = 0
            for (f, s, t), opt in zip(files, options):
                prompt = runtime.tokenizer.prompt_ids(s, t, True, "transcribe" if s == t else "translate")
                tokens += len(runtime.decode(load_audio(f), prompt, opt))
            return tokens
        return run

    def sherpa_runner():
        import sherpa_onnx

        d = work / "onnx" / "sherpa"
        recognizers = {(s, t): sherpa_onnx.OfflineRecognizer.from_nemo_canary(  # the task is fixed at creation
            encoder=str(d / "encoder.onnx"), decoder=str(d / "decoder.onnx"), tokens=str(d / "tokens.txt"),
            src_lang=s, tgt_lang=t, num_threads=args.threads) for _, s, t in files}

        def run():
            tokens = 0
            for f, s, t in files:
                stream = recognizers[s, t].create_stream()
                stream.accept_waveform(16000, load_audio(f).numpy())
                recognizers[s, t].decode_stream(stream)
                tokens += len(stream.result.tokens)
            return tokens
        return run

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


if __name__ == "__main__":
    main()
