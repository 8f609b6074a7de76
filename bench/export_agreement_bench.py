"""A trained model's exports decoded by their own runtimes, against aed's greedy tokens and WER.

    python bench/export_agreement_bench.py --ckpt runs/demo                       # data/mini/digits/dev.jsonl
    python bench/export_agreement_bench.py --ckpt runs/demo --nemo-path .venv/nemo-peers   # NeMo too

Exports the checkpoint as README's "Run an aed model elsewhere" does (tools/export_nemo.py,
tools/export_hf.py, tools/export_onnx.py --int8 --sherpa) into --work-dir, then decodes every file of
the manifest with each runtime, one file at a time, with the file's languages:

    aed            greedy search without the CTC head (no target has one): the reference tokens
    nemo           EncDecMultiTaskModel.restore_from, its greedy search (in a subprocess with
                   --nemo-path on PYTHONPATH: NeMo needs transformers 4.x, the venv has 5.x)
    transformers   CanaryForConditionalGeneration.generate
    ort-fp32/int8  onnxruntime over the graphs with aed's features and greedy loop (OnnxAED)
    sherpa-onnx    OfflineRecognizer.from_nemo_canary: its own features (kaldi-native-fbank) and loop

Each is stopped as the runtime stops (NeMo: its generation delta; sherpa-onnx: 30 tokens per second),
with aed's reference decoded under the same stop. A table, then the JSON line.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, log, manifest_rows, print_json, print_table  # noqa: E402

NEMO_DELTA = 50  # NeMo's max_generation_delta in the released configs


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


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", required=True, help="a trained checkpoint or run directory (what infer.py takes)")
    p.add_argument("--manifest", default=str(ROOT / "data" / "mini" / "digits" / "dev.jsonl"))
    p.add_argument("--nemo-path", help="a folder holding NeMo (bench/requirements-nemo-peers.txt): adds the nemo row")
    p.add_argument("--work-dir", default=str(Path(tempfile.gettempdir()) / "aed-export-agreement"))
    args = p.parse_args(argv)

    import torch

    sys.path.insert(0, str(ROOT / "tools"))
    import export_onnx
    from aed.data_audio import load_audio
    from aed.decode_metrics import wer
    from aed import DecodingOptions, load_model, transcribe
    from aed.model_encoder import subsampled_length

    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    export_all(args.ckpt, work)
    rows = manifest_rows(args.manifest)
    asr = load_model(args.ckpt)
    tok = asr.tokenizer
    refs = [row["text"] for row in rows]

    def aed(row, limit=None, max_delta=10**6):
        options = DecodingOptions(ctc_weight=0.0, max_repeats=0, max_tokens_per_second=None, max_delta=max_delta,
                                  max_new_tokens=limit)
        results, _ = transcribe(asr, [row["audio_filepath"]], options, source_lang=row["source_lang"],
                                target_lang=row["target_lang"])
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
    import sherpa_onnx

    d = work / "onnx" / "sherpa"
    symbols = {int(i): s.replace("\u2581", " ") for s, i in  # compared as the runtime's token strings
               (line.split(" ") for line in (d / "tokens.txt").read_text(encoding="utf-8").splitlines())}
    systems["sherpa-onnx"] = []
    factor = asr.model.cfg.subsampling_factor
    for row in rows:
        recognizer = sherpa_onnx.OfflineRecognizer.from_nemo_canary(
            encoder=str(d / "encoder.onnx"), decoder=str(d / "decoder.onnx"), tokens=str(d / "tokens.txt"),
            src_lang=row["source_lang"], tgt_lang=row["target_lang"], feature_dim=asr.features.n_mels, num_threads=1)
        wav = load_audio(row["audio_filepath"])
        stream = recognizer.create_stream()
        stream.accept_waveform(16000, wav.numpy())
        recognizer.decode_stream(stream)
        frames = int(subsampled_length(torch.tensor((wav.numel() + 80) // 160), factor))  # kaldi-native-fbank's
        limit = int(frames * factor / 100.0 * 30) + 1  # the runtime's 30 tokens per second
        ref = [symbols[i] for i in aed(row, limit)]
        systems["sherpa-onnx"].append((list(stream.result.tokens), ref, stream.result.text))

    if args.nemo_path:
        log("decoding: nemo")
        systems["nemo"] = [(tokens, aed(row, limit, NEMO_DELTA), tok.decode(tokens))
                           for row, (tokens, limit) in zip(rows, nemo_tokens(work, rows, args.nemo_path))]

    result, table = {}, []
    for name, pairs in systems.items():
        equal = sum(got == ref for got, ref, _ in pairs)
        score = wer(refs, [text for _, _, text in pairs])
        result[name] = {"equal": equal, "files": len(pairs), "wer": round(score, 2)}
        table.append([name, f"{equal} / {len(pairs)}", score])
    print_table([("runtime", "<14"), ("tokens equal aed's", ">18"), ("WER", ">6.1f")], table)
    print_json({"ckpt": args.ckpt, "manifest": args.manifest, "systems": result})


if __name__ == "__main__":
    main()
