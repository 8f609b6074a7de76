"""Inference speed against what users would pick: aed eager / compiled / int8 and faster-whisper fp32 / int8.

    python bench/infer_speed_bench.py                                  # CPU, 2 threads: ~25 min on a quiet 2-core machine
                                                                       # (+ ~45 min with faster-whisper small, ~2 h medium)
    python bench/infer_speed_bench.py --layouts canary-180m-flash --utterances 16 --long-seconds 300   # ~8 min
    python bench/infer_speed_bench.py --device cuda --no-peers         # make gpu-check: eager vs compiled (CUDA graphs)

Peers (optional, never in requirements.txt): faster-whisper, CTranslate2 and transformers, the last only
to build a random Whisper that CTranslate2's own converter turns into a faster-whisper model:
    .venv/bin/pip install --target /tmp/aed-peers --no-deps -r bench/requirements-infer-peers.txt
    PYTHONPATH=/tmp/aed-peers .venv/bin/python bench/infer_speed_bench.py
Without them the aed rows are measured and the comparisons are left out (the JSON says why).
NeMo's own Canary at the same shapes (optional, its own install; bench/nemo_canary.py says how):
    PYTHONPATH=/tmp/nemo-peers .venv/bin/python bench/infer_speed_bench.py --nemo --no-peers --parts files

Everything has random weights (speed does not depend on them), every system gets the same audio, the
same number of decoded tokens (EOS suppressed, so every utterance decodes exactly --tokens) and the same
threads. Greedy search, fp32 activations. Three parts:

1. Decoder step: ms per step of the Canary layouts' decoders (both 4 x 1024; canary-180m-flash's encoder
   is 17 x 512, canary-1b-flash's 32 x 1024), 100 encoder frames, at batch 1 and 16: eager, compiled (the
   static cache, aed/compiled.py) and int8 weights (aed.inference.quantize_int8); the systems take turns,
   the fastest of --repeats runs kept. GB/s: the weight bytes a batch-1 step reads per second, beside the
   CPU's read bandwidth (summing 512 MB), the rate a step bound by reading its weights cannot beat.
2. Short utterances: --utterances generated files of --min-seconds to --max-seconds through the real
   pipeline (aed.inference.transcribe: files -> features -> encoder -> search), files sorted by length in
   groups of 1 and 16. faster-whisper: WhisperModel.transcribe per file (batch 1); batch 16 runs its own
   pieces the way its BatchedInferencePipeline does (features padded to 30 s, encode, generate), across
   files. Whisper pads every input to 30 s: that is its cost on short utterances. NeMo (--nemo): the
   same groups through NeMo's preprocessor, encoder and greedy search (bench/nemo_canary.py).
3. Long form: one file of --long-seconds (the short files, repeated), 30 s windows, each window decoding
   as many tokens per second as the short utterances did. aed: transcribe(chunk_seconds=30), its chunks
   batched 16 at a time. faster-whisper: WhisperModel.transcribe (windows in sequence) and
   BatchedInferencePipeline (16 windows a batch, windows given as clip_timestamps: no VAD). The long file
   against the same audio as short files is `long_file_vs_short_files`.

RTFx = audio seconds / wall seconds. Encoder and decoder seconds are aed's own timers (the device
synchronised between phases); faster-whisper does not split its time, so its encoder seconds are a
separate run of its encoder over the same 30 s windows. Peak memory is the process's resident-set
high-water mark over each run (reset before it through /proc/self/clear_refs), with only that
system's model alive (the others are freed and handed back to the OS first; aed's int8 system, last,
quantizes the fp32 model in place): the model, its working memory, and the interpreter with torch
and its kernels (~0.6 GB, the same for every system), on the CPU. Compilation happens in a warm-up
before the timed runs (its seconds are printed). On a machine shared with other jobs absolute times
are noisy: compare the ratios of one run, and rerun a row that looks off.
"""

import argparse
import atexit
import copy
import ctypes
import gc
import math
import re
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import soundfile as sf
import torch

from aed.audio import FeatureConfig
from aed.compiled import CompiledAED
from aed.decoding import DecodingOptions
from aed.inference import LoadedModel, Timings, quantize_int8, transcribe
from aed.model import AED, AEDConfig
from aed.tokenizer import Tokenizer
from common import MINI_TOKENIZER, ROOT, load_avg, log, print_json, print_table
from rtfx_bench import make_audio

LAYOUTS = {name: ROOT / "configs" / f"{name}.yaml" for name in ("canary-180m-flash", "canary-1b-flash")}
WHISPER = {  # size: (d_model, layers of encoder and of decoder, heads), as in openai/whisper
    "base": (512, 6, 8), "small": (768, 12, 12), "medium": (1024, 24, 16)}
COMPARABLE = {"canary-180m-flash": "small", "canary-1b-flash": "medium"}  # 182M vs 244M; 883M vs 769M parameters
WINDOW_S = 30.0  # Whisper's window, and the chunk length both systems decode long audio in


# --- measuring ------------------------------------------------------------------------------------

def reset_peak_memory(device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        Path("/proc/self/clear_refs").write_text("5")  # Linux: VmHWM starts again from the current RSS


def release_memory() -> None:
    """Drop what is no longer referenced and hand it back to the OS (glibc keeps freed memory resident
    otherwise), so that the next run's resident-set peak counts only the models still alive."""
    gc.collect()
    torch._dynamo.reset()  # compiled graphs keep the model they were made from
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: freed memory may stay counted
        pass


def peak_memory_gb(device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) / 2**20


def result(audio_s: float, wall_s: float, encoder_s: float, decoder_s: float, tokens: int, peak_gb: float) -> dict:
    return {"rtfx": round(audio_s / wall_s, 2), "audio_s": round(audio_s, 1), "wall_s": round(wall_s, 2),
            "encoder_s": round(encoder_s, 2), "decoder_s": round(decoder_s, 2), "tokens": tokens,
            "peak_gb": round(peak_gb, 2)}


# --- aed ------------------------------------------------------------------------------------------

def random_asr(layout: str, tokenizer: Tokenizer, device) -> LoadedModel:
    """The layout at full width (Canary's vocabulary and 128 mels), random weights, EOS never chosen."""
    torch.manual_seed(0)
    model = AED(AEDConfig.from_yaml(LAYOUTS[layout])).to(device).eval()
    with torch.no_grad():
        model.decoder.output_proj.bias[tokenizer.eos] = -1e9  # fixed work: every utterance decodes all its tokens
    return LoadedModel(model, tokenizer, FeatureConfig(), "random weights")


def aed_variant(asr: LoadedModel, system: str, in_place: bool = False) -> LoadedModel:
    """in_place: int8 quantizes `asr`'s own model (its fp32 weights are gone after), not a copy."""
    if system == "aed-compiled":
        return LoadedModel(asr.model, asr.tokenizer, asr.features, asr.path, compiled=CompiledAED(asr.model))
    if system == "aed-int8":
        model = asr.model if in_place else copy.deepcopy(asr.model)
        return LoadedModel(quantize_int8(model), asr.tokenizer, asr.features, asr.path)
    return asr


def run_aed(asr: LoadedModel, groups: list[list[str]], options: DecodingOptions, device, **kwargs) -> dict:
    """transcribe() once per group (one batch each, or a long file's chunks in batches of kwargs)."""
    total, tokens = Timings(), 0
    reset_peak_memory(device)
    for group in groups:
        results, t = transcribe(asr, group, options, **({"batch_duration": math.inf} | kwargs))
        tokens += sum(len(r.tokens) for r in results)
        for f in ("audio", "wall", "encoder", "decoder"):
            setattr(total, f, getattr(total, f) + getattr(t, f))
    return result(total.audio, total.wall, total.encoder, total.decoder, tokens, peak_memory_gb(device))


def decoder_step_ms(model, batch: int, frames: int, steps: int, device) -> float:
    """ms per greedy decoder step of `model` (an AED or CompiledAED), after a 5-token prompt."""
    memory = torch.randn(batch, frames, model.cfg.dec_d_model, device=device)
    memory_lens = torch.full((batch,), frames, device=device)
    prompt = torch.full((batch, 5), 3, device=device)
    with torch.inference_mode():
        cache = model.new_cache(memory, memory_lens, 5 + steps + 1)
        token = model.decode_step(prompt, cache).argmax(-1, keepdim=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(steps):
            token = model.decode_step(token, cache).argmax(-1, keepdim=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return 1000 * (time.perf_counter() - start) / steps


def step_weight_bytes(model: AED, system: str) -> int:
    """Weight bytes one decoder step reads: every decoder Linear but the cross-attention key and value
    projections (made once per utterance); int8 keeps one byte per weight."""
    weights = sum(m.weight.numel() for n, m in model.decoder.named_modules()
                  if isinstance(m, torch.nn.Linear) and not re.search(r"cross_attn\.(key|value)_net", n))
    return weights * (1 if system == "aed-int8" else model.decoder.output_proj.weight.element_size())


def read_bandwidth_gbs(repeats: int = 10) -> float:
    """GB/s of summing a 512 MB tensor on the CPU, the fastest of `repeats` sums: the rate at which a
    batch-1 step could read weights (a ceiling, so the best run; on a shared host single sums vary 2x)."""
    x = torch.ones(2**27)
    x.sum()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        seconds.append(time.perf_counter() - start)
    return x.numel() * x.element_size() / min(seconds) / 1e9


# --- faster-whisper -------------------------------------------------------------------------------

def random_whisper(size: str, directory: Path) -> Path:
    """A multilingual Whisper of `size` with random weights, converted by CTranslate2's own converter
    (kept in `directory` for the next run). Its tokenizer is a stand-in with Whisper's ids: 50257 text
    tokens, then the special tokens faster-whisper looks up by name, then 1501 timestamps."""
    out = directory / f"whisper-{size}-ct2"
    if (out / "model.bin").exists():
        return out
    import tokenizers
    import transformers
    from ctranslate2.converters import TransformersConverter
    from faster_whisper.tokenizer import _LANGUAGE_CODES

    d_model, layers, heads = WHISPER[size]
    languages = [f"<|{code}|>" for code in _LANGUAGE_CODES[:99]]  # the 99 of the 51865-token vocabulary
    specials = ["<|endoftext|>", "<|startoftranscript|>", *languages, "<|translate|>", "<|transcribe|>",
                "<|startoflm|>", "<|startofprev|>", "<|nocaptions|>", "<|notimestamps|>"]
    vocab = {f"t{i}": i for i in range(50257)}
    vocab |= {tok: 50257 + i for i, tok in enumerate(specials)}
    vocab |= {f"<|{0.02 * i:.2f}|>": 50364 + i for i in range(1501)}
    assert len(vocab) == 51865, len(vocab)
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    hf_dir = directory / f"whisper-{size}-hf"
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0").save_pretrained(hf_dir)
    config = transformers.WhisperConfig(
        vocab_size=51865, num_mel_bins=80, d_model=d_model, encoder_layers=layers, decoder_layers=layers,
        encoder_attention_heads=heads, decoder_attention_heads=heads, encoder_ffn_dim=4 * d_model,
        decoder_ffn_dim=4 * d_model, decoder_start_token_id=50258, bos_token_id=50257, eos_token_id=50257,
        pad_token_id=50257)
    torch.manual_seed(0)
    model = transformers.WhisperForConditionalGeneration(config)
    model.generation_config.lang_to_id = {lang: vocab[lang] for lang in languages}
    model.generation_config.suppress_tokens = []
    model.generation_config.begin_suppress_tokens = [50257]
    model.save_pretrained(hf_dir)
    TransformersConverter(str(hf_dir), copy_files=["tokenizer.json"]).convert(str(out), force=True)
    return out


def text_only(model) -> list[int]:
    """Every id from EOS on (the special tokens and the 1501 timestamps): suppressed, so that the random
    Whisper decodes text tokens only, as a trained one does on speech with timestamps off. Otherwise it
    emits runs of timestamps, and transcribe() cuts each window there and decodes the rest again (seen:
    2 segments and 6 of 40 tokens for one 9 s file, in twice the time)."""
    eot = model.hf_tokenizer.token_to_id("<|endoftext|>")
    return list(range(eot, model.hf_tokenizer.get_vocab_size()))


def whisper_options(model, tokens: int) -> dict:
    """faster-whisper's transcribe() options for fixed work: greedy, one temperature, no fallback, no
    timestamps, no VAD, no conditioning, text tokens only (EOS suppressed) so that each window decodes
    `tokens` tokens."""
    return dict(language="en", task="transcribe", beam_size=1, temperature=[0.0], max_new_tokens=tokens,
                suppress_tokens=text_only(model), suppress_blank=False, without_timestamps=True,
                condition_on_previous_text=False, compression_ratio_threshold=None, log_prob_threshold=None,
                no_speech_threshold=None, vad_filter=False)


def fw_new_tokens(model, tokens: int) -> int:
    """The max_new_tokens under which faster-whisper returns `tokens` tokens per window. This CTranslate2
    build (4.8.5) returns max_length / 2 tokens for a max_length of prompt + max_new_tokens, whatever the
    prompt (measured: 44 -> 22, 84 -> 42, 164 -> 82), so max_new_tokens alone would decode about half
    of aed's tokens. Found by one short generate, and checked by the token counts in the tables."""
    from faster_whisper.tokenizer import Tokenizer as WhisperTokenizer

    wt = WhisperTokenizer(model.hf_tokenizer, True, task="transcribe", language="en")
    prompt = model.get_prompt(wt, [], without_timestamps=True)
    encoded = model.encode(np.zeros((1, 80, 3000), dtype=np.float32))
    out = model.model.generate(encoded, [list(prompt)], beam_size=1, max_length=len(prompt) + tokens,
                               suppress_blank=False, suppress_tokens=text_only(model))
    returned = len(out[0].sequences_ids[0])
    return round(tokens * (len(prompt) + tokens) / returned) - len(prompt)


def fw_count(segments) -> int:
    return sum(len(s.tokens) for s in segments)  # consuming the generator is what runs the decoding


def fw_windows(model, paths: list[str]) -> np.ndarray:
    """Each file's log-mels padded to one 30 s window, as faster-whisper feeds its encoder: (N, 80, 3000)."""
    from faster_whisper.audio import decode_audio

    feats = []
    for p in paths:
        audio = decode_audio(p, sampling_rate=model.feature_extractor.sampling_rate)
        f = model.feature_extractor(audio)[..., :-1]
        feats.append(np.pad(f, ((0, 0), (0, max(0, 3000 - f.shape[-1]))))[..., :3000])
    return np.stack(feats)


def fw_encoder_s(model, paths: list[str], batch: int) -> float:
    """Seconds of faster-whisper's encoder alone over the files' 30 s windows, `batch` at a time."""
    feats = fw_windows(model, paths)
    start = time.perf_counter()
    for i in range(0, len(paths), batch):
        model.encode(feats[i : i + batch])
    return time.perf_counter() - start


def run_whisper_files(model, groups: list[list[str]], batch: int, tokens: int, audio_s: float, device) -> dict:
    """Short files: transcribe() per file at batch 1; at batch 16, BatchedInferencePipeline's steps
    (pad to 30 s, encode, generate) over 16 files at once."""
    from faster_whisper.tokenizer import Tokenizer as WhisperTokenizer

    wt = WhisperTokenizer(model.hf_tokenizer, True, task="transcribe", language="en")
    prompt = model.get_prompt(wt, [], without_timestamps=True)
    reset_peak_memory(device)
    start, count = time.perf_counter(), 0
    for group in groups:
        if batch == 1:
            segments, _ = model.transcribe(group[0], **whisper_options(model, tokens))
            count += fw_count(segments)
        else:
            encoded = model.encode(fw_windows(model, group))
            out = model.model.generate(encoded, [list(prompt)] * len(group), beam_size=1,
                                       max_length=len(prompt) + tokens, suppress_blank=False,
                                       suppress_tokens=text_only(model))
            count += sum(len(r.sequences_ids[0]) for r in out)
            [wt.decode(r.sequences_ids[0]) for r in out]  # the text, as a user would get it
    wall = time.perf_counter() - start
    peak = peak_memory_gb(device)
    enc = fw_encoder_s(model, [p for g in groups for p in g], batch)
    return result(audio_s, wall, enc, wall - enc, count, peak)


def run_whisper_long(model, path: str, batch: int, tokens: int, audio_s: float, device) -> dict:
    from faster_whisper import BatchedInferencePipeline

    reset_peak_memory(device)
    start = time.perf_counter()
    if batch == 1:
        segments, _ = model.transcribe(path, **whisper_options(model, tokens))
    else:
        windows = [{"start": s, "end": min(s + WINDOW_S, audio_s)} for s in np.arange(0.0, audio_s, WINDOW_S)]
        segments, _ = BatchedInferencePipeline(model).transcribe(
            path, batch_size=batch, clip_timestamps=windows, **whisper_options(model, tokens))
    count = fw_count(segments)
    return result(audio_s, time.perf_counter() - start, float("nan"), float("nan"), count, peak_memory_gb(device))


# --- the run --------------------------------------------------------------------------------------

def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    p.add_argument("--systems", nargs="+", default=["aed-eager", "aed-compiled", "aed-int8"],
                   choices=["aed-eager", "aed-compiled", "aed-int8"])
    p.add_argument("--utterances", type=int, default=48, help="short files")
    p.add_argument("--min-seconds", type=float, default=2.0)
    p.add_argument("--max-seconds", type=float, default=14.0)
    p.add_argument("--tokens", type=int, default=40, help="decoded tokens per short utterance")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    p.add_argument("--long-seconds", type=float, default=600.0, help="the long file (the issue's hour: 3600)")
    p.add_argument("--step-frames", type=int, default=100, help="encoder frames in the decoder-step timing (8 s)")
    p.add_argument("--steps", type=int, default=40, help="timed decoder steps")
    p.add_argument("--repeats", type=int, default=3, help="decoder-step timings per system: the fastest is kept")
    p.add_argument("--parts", nargs="+", choices=["step", "files"], default=["step", "files"],
                   help="step: 1. alone; files: 2. and 3. (the pipeline on short files and the long file)")
    p.add_argument("--peers", action=argparse.BooleanOptionalAction, default=True,
                   help="faster-whisper (needs bench/requirements-infer-peers.txt; CPU only here)")
    p.add_argument("--whisper", choices=list(WHISPER), help="peer size for every layout; default: the comparable one")
    p.add_argument("--nemo", action=argparse.BooleanOptionalAction, default=False,
                   help="NeMo's own Canary at each layout's shapes on the short files, CPU only (bench/nemo_canary.py; "
                        "needs bench/requirements-nemo-peers.txt, which clash with faster-whisper's: add --no-peers)")
    p.add_argument("--work-dir", default=str(Path(tempfile.gettempdir()) / "aed-infer-bench"),
                   help="converted Whisper models are kept here between runs")
    p.add_argument("--threads", type=int, default=2, help="CPU threads, for every system")
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    systems = sorted((s for s in args.systems if not (s == "aed-int8" and device.type != "cpu")),  # int8: CPU only
                     key=["aed-eager", "aed-compiled", "aed-int8"].index)  # int8 last: it quantizes in place
    tokenizer = Tokenizer.load(MINI_TOKENIZER)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    peers_missing = None
    if args.peers:
        try:
            import faster_whisper  # noqa: F401
        except ImportError as e:
            peers_missing = f"faster-whisper is not installed ({e}): see bench/requirements-infer-peers.txt"
            log(peers_missing)
    peers = args.peers and peers_missing is None and device.type == "cpu"
    nemo_missing = None
    if args.nemo:
        try:
            import nemo_canary
        except ImportError as e:
            nemo_missing = f"NeMo is not installed ({e}): see bench/requirements-nemo-peers.txt"
            log(nemo_missing)

    audio_dir = Path(tempfile.mkdtemp(dir=work))
    atexit.register(shutil.rmtree, audio_dir, ignore_errors=True)  # the converted models stay, the audio goes
    paths = make_audio(audio_dir, args.utterances, args.min_seconds, args.max_seconds)
    durations = {q: sf.info(q).duration for q in paths}
    short_s = sum(durations.values())
    by_length = sorted(paths, key=durations.get, reverse=True)
    groups = {bs: [by_length[i : i + bs] for i in range(0, len(paths), bs)] for bs in args.batch_sizes}
    rate = args.tokens * len(paths) / short_s  # tokens per audio second of the short files, kept in long form
    window_tokens = round(WINDOW_S * rate)
    long_path = str(audio_dir / "long.wav")
    wavs = [sf.read(q, dtype="float32")[0] for q in paths]
    long_wav = np.concatenate(wavs * math.ceil(args.long_seconds / short_s))[: int(args.long_seconds * 16000)]
    sf.write(long_path, long_wav, 16000, subtype="PCM_16")
    print(f"device {device}, {args.threads} threads, load {load_avg()}; {len(paths)} files / {short_s:.0f} s, "
          f"{args.tokens} tokens each; long file {args.long_seconds:.0f} s in {WINDOW_S:.0f} s windows of "
          f"{window_tokens} tokens")

    short_opts = DecodingOptions(max_new_tokens=args.tokens, max_repeats=0, max_tokens_per_second=None, ctc_weight=0.0)
    long_opts = DecodingOptions(max_repeats=0, max_tokens_per_second=rate, ctc_weight=0.0)  # tokens in proportion to a chunk's length
    long_batch = max(args.batch_sizes)
    rows, steps, long_rows, compile_s, weight_gbs = {}, {}, {}, {}, {}
    read_gbs = round(read_bandwidth_gbs(), 1) if device.type == "cpu" and "step" in args.parts else None
    for layout in args.layouts:
        base = random_asr(layout, tokenizer, device)
        aed_params = sum(q.numel() for q in base.model.parameters())
        log(f"{layout}: {aed_params / 1e6:.0f}M parameters")
        variants = {f"{system}/{layout}": aed_variant(base, system) for system in systems if "step" in args.parts}
        # --- 1. decoder step: the systems take turns, and each keeps its fastest of --repeats runs, so
        # that another job's burst of load does not land on one system only
        for name, asr in variants.items():
            steps[name] = {}
            for bs in args.batch_sizes if "step" in args.parts else []:
                start = time.perf_counter()
                decoder_step_ms(asr.compiled or asr.model, bs, args.step_frames, 3, device)  # warm-up; compiles
                compile_s[f"{name} step batch{bs}"] = round(time.perf_counter() - start, 1)
        for _ in range(args.repeats if "step" in args.parts else 0):
            for name, asr in variants.items():
                for bs in args.batch_sizes:
                    ms = decoder_step_ms(asr.compiled or asr.model, bs, args.step_frames, args.steps, device)
                    steps[name][f"batch{bs}"] = round(min(ms, steps[name].get(f"batch{bs}", math.inf)), 2)
        for name in variants if "step" in args.parts and 1 in args.batch_sizes else []:
            weight_gbs[name] = round(step_weight_bytes(base.model, name.split("/")[0]) / steps[name]["batch1"] / 1e6, 1)
        log(f"{layout}: decoder step ms {steps}")
        # --- 2. and 3., one system at a time with only its own model in memory (the peak GB column):
        # the step's variants go, each system is made again, and int8 (last) quantizes the fp32 model
        variants.clear()
        release_memory()
        for system in systems if "files" in args.parts else []:
            name = f"{system}/{layout}"
            asr = aed_variant(base, system, in_place=True)
            release_memory()  # the fp32 weights int8 replaced
            # --- 2. short utterances
            rows[name] = {}
            for bs in args.batch_sizes:
                start = time.perf_counter()
                run_aed(asr, [groups[bs][0], groups[bs][-1]], short_opts, device)  # warm-up: longest and shortest bucket
                compile_s[f"{name} batch{bs}"] = round(time.perf_counter() - start, 1)
                rows[name][f"batch{bs}"] = run_aed(asr, groups[bs], short_opts, device)
                log(f"{name} batch {bs}: {rows[name][f'batch{bs}']}")
            # --- 3. long form: its 30 s chunks batched
            kwargs = dict(chunk_seconds=WINDOW_S, batch_duration=long_batch * WINDOW_S)
            if system == "aed-compiled":  # warm-up: every bucket of the file's batches compiles before the timed run
                run_aed(asr, [[long_path]], long_opts, device, **kwargs)
            long_rows[name] = {f"batch{long_batch}": run_aed(asr, [[long_path]], long_opts, device, **kwargs)}
            log(f"{name} long file: {long_rows[name]}")
            del asr
        aed_cfg = base.model.cfg
        del base  # the peers' peak GB counts their own model only
        release_memory()

        if args.nemo and nemo_missing is None and "files" in args.parts and device.type == "cpu":
            model = nemo_canary.build(aed_cfg, aed_cfg.n_mels, work)
            name = f"nemo-canary/{layout}"
            log(f"{name}: {sum(q.numel() for q in model.parameters()):,} parameters (aed: {aed_params:,})")
            nemo_canary.transcribe_groups(model, [[by_length[0]], [by_length[-1]]], 4)  # warm-up
            rows[name] = {}
            for bs in args.batch_sizes:
                reset_peak_memory(device)
                r = nemo_canary.transcribe_groups(model, groups[bs], args.tokens)
                rows[name][f"batch{bs}"] = result(short_s, r["wall_s"], r["encoder_s"], r["decoder_s"], r["tokens"],
                                                  peak_memory_gb(device))
            log(f"{name}: {rows[name]}")
            del model
            release_memory()

        if peers and "files" in args.parts:
            size = args.whisper or COMPARABLE[layout]
            from faster_whisper import WhisperModel

            ct2_dir = random_whisper(size, work)
            for compute in ("float32", "int8"):
                name = f"faster-whisper-{'fp32' if compute == 'float32' else compute}/{size}"
                if name in rows:
                    continue
                model = WhisperModel(str(ct2_dir), device="cpu", compute_type=compute, cpu_threads=args.threads)
                short_new, long_new = fw_new_tokens(model, args.tokens), fw_new_tokens(model, window_tokens)
                log(f"{name}: max_new_tokens {short_new} per short file, {long_new} per window")
                run_whisper_files(model, [[by_length[-1]]], 1, 4, 1.0, device)  # warm-up
                rows[name] = {f"batch{bs}": run_whisper_files(model, groups[bs], bs, short_new, short_s, device)
                              for bs in args.batch_sizes}
                log(f"{name}: {rows[name]}")
                long_rows[name] = {f"batch{bs}": run_whisper_long(model, long_path, bs, long_new, args.long_seconds,
                                                                  device)
                                   for bs in sorted({1, long_batch})}
                log(f"{name} long file: {long_rows[name]}")
                del model
                release_memory()

    # --- report: RTFx compares like with like only where every system decoded the same tokens
    for table, expected in ((rows, args.tokens * len(paths)), (long_rows, round(rate * args.long_seconds))):
        for n, by_batch in table.items():
            for b, r in by_batch.items():
                if abs(r["tokens"] - expected) > 0.05 * expected:
                    log(f"WARNING: {n} {b} decoded {r['tokens']} tokens, not ~{expected}: its RTFx is not comparable")
    print()
    print_table([("system", "<38"), ("batch", "5d"), ("RTFx", "8.1f"), ("wall s", "8.1f"), ("encoder s", "10.1f"),
                 ("decoder s", "10.1f"), ("tokens", "7d"), ("peak GB", "8.2f")],
                [[n, int(b[5:]), r["rtfx"], r["wall_s"], r["encoder_s"], r["decoder_s"], r["tokens"], r["peak_gb"]]
                 for n, by_batch in rows.items() for b, r in by_batch.items()])
    print(f"\nlong file ({args.long_seconds:.0f} s, {WINDOW_S:.0f} s windows of {window_tokens} tokens)")
    print_table([("system", "<38"), ("batch", "5d"), ("RTFx", "8.1f"), ("wall s", "8.1f"), ("encoder s", "10.1f"),
                 ("decoder s", "10.1f"), ("tokens", "7d"), ("peak GB", "8.2f")],
                [[n, int(b[5:]), r["rtfx"], r["wall_s"], r["encoder_s"], r["decoder_s"], r["tokens"], r["peak_gb"]]
                 for n, by_batch in long_rows.items() for b, r in by_batch.items()])
    if "step" in args.parts:
        print(f"\ndecoder step, ms ({args.step_frames} encoder frames); weight GB/s at batch 1"
              + (f" (CPU read bandwidth {read_gbs} GB/s)" if read_gbs else ""))
        print_table([("system", "<38")] + [(f"batch {bs}", "9.2f") for bs in args.batch_sizes] + [("GB/s", "6.1f")],
                    [[n] + [s[f"batch{bs}"] for bs in args.batch_sizes] + [weight_gbs.get(n, math.nan)]
                     for n, s in steps.items()])
    print(f"\nwarm-up and compilation seconds: {compile_s}")

    def ratio(a, b):
        return round(a / b, 2) if b else None

    first = args.layouts[0]
    summary = {"device": str(device), "threads": args.threads, "load": load_avg(), "utterances": len(paths),
               "short_audio_s": round(short_s, 1), "tokens": args.tokens, "long_file_s": args.long_seconds,
               "window_tokens": window_tokens, "systems": rows, "long_form": long_rows, "decoder_step_ms": steps,
               "decoder_step_weight_gbs_batch1": weight_gbs, "cpu_read_gbs": read_gbs,
               "warmup_s": compile_s}
    files, stepped = "files" in args.parts, "step" in args.parts
    if "aed-compiled" in systems and "aed-eager" in systems and 1 in args.batch_sizes:
        if stepped:
            summary["compiled_vs_eager_decoder_step"] = {
                f"{layout}/batch{bs}": ratio(steps[f"aed-eager/{layout}"][f"batch{bs}"],
                                             steps[f"aed-compiled/{layout}"][f"batch{bs}"])
                for layout in args.layouts for bs in args.batch_sizes}
        # the decoder's seconds in the pipeline at batch 1 (the encoder is the same eager one in both),
        # else the step timing's
        summary["compiled_vs_eager_batch1"] = (
            ratio(rows[f"aed-eager/{first}"]["batch1"]["decoder_s"], rows[f"aed-compiled/{first}"]["batch1"]["decoder_s"])
            if files else summary["compiled_vs_eager_decoder_step"][f"{first}/batch1"])
    if "aed-int8" in systems and "aed-eager" in systems and 1 in args.batch_sizes and stepped:
        by_layout = {layout: ratio(steps[f"aed-eager/{layout}"]["batch1"], steps[f"aed-int8/{layout}"]["batch1"])
                     for layout in args.layouts}
        summary["int8_vs_eager_decoder_step_batch1"] = min(by_layout.values())  # the target holds for every layout
        summary["int8_vs_eager_decoder_step_batch1_by_layout"] = by_layout
    if peers and files:
        size = args.whisper or COMPARABLE[first]

        def best(table, prefix):
            return max(r["rtfx"] for n, by_batch in table.items() if n.startswith(prefix) for r in by_batch.values())

        summary["vs_faster_whisper"] = {  # best aed system of the first layout vs the best faster-whisper at its size
            "layout": first, "whisper": size,
            "short_utterances": ratio(max(best(rows, f"{s}/{first}") for s in systems), best(rows, "faster-whisper")),
            "long_form": ratio(max(best(long_rows, f"{s}/{first}") for s in systems), best(long_rows, "faster-whisper"))}
    else:
        summary["vs_faster_whisper"] = {"skipped": peers_missing or "--no-peers, --parts without files, or not on the CPU"}
    if args.nemo and files and "aed-eager" in systems and device.type == "cpu":  # aed's eager fp32 against NeMo's
        summary["vs_nemo"] = nemo_missing or {f"{layout}/batch{bs}": ratio(
            rows[f"aed-eager/{layout}"][f"batch{bs}"]["rtfx"], rows[f"nemo-canary/{layout}"][f"batch{bs}"]["rtfx"])
            for layout in args.layouts for bs in args.batch_sizes}
    if files and "aed-eager" in systems and long_batch in args.batch_sizes:
        summary["long_file_vs_short_files"] = ratio(long_rows[f"aed-eager/{first}"][f"batch{long_batch}"]["rtfx"],
                                                    rows[f"aed-eager/{first}"][f"batch{long_batch}"]["rtfx"])
    summary["targets"] = {"int8_vs_eager_decoder_step_batch1": 4.0, "compiled_vs_eager_batch1": 1.0,
                          "vs_faster_whisper_short_utterances": 5.0, "vs_faster_whisper_long_form": 2.0,
                          "long_file_vs_short_files": 0.8}
    print_json(summary)


if __name__ == "__main__":
    main()
