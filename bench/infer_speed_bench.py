"""Inference speed, in four modes (`python bench/infer_speed_bench.py MODE --help` lists a mode's flags):

    systems (default)  aed eager / compiled / int8 against what users would pick: faster-whisper fp32 /
                       int8, and NeMo's own Canary; the Canary presets at full size
    rtfx               infer.py's pipeline for the layouts 24+24, 24+4 and 32+4 at one CPU-sized width,
                       greedy and beam, batch 1 and 16 (E3 of bench/report.py)
    decode             the same layouts' encoder time, and decoder ms per step with and without the KV
                       cache, on random features
    stream             how many real-time streams one machine decodes at once (aed/decode_stream.py), the
                       Canary Flash presets at full size, against offline decoding of the same audio

    python bench/infer_speed_bench.py                                  # systems, CPU, 2 threads
    python bench/infer_speed_bench.py --layouts canary-180m-flash --utterances 16 --long-seconds 300
    python bench/infer_speed_bench.py --device cuda --no-peers         # make gpu-check: eager vs compiled (CUDA graphs)
    python bench/infer_speed_bench.py rtfx                             # CPU-scaled: width 64
    python bench/infer_speed_bench.py rtfx --d-model 1024 --subsampling-channels 256 --utterances 200 \\
        --device cuda --dtype bf16
    python bench/infer_speed_bench.py decode                           # CPU-scaled: width 256, 30 s inputs
    python bench/infer_speed_bench.py decode --d-model 1024 --subsampling-channels 256 --batch 16 --device cuda
    python bench/infer_speed_bench.py stream                           # both Canary Flash presets, CPU, 2 threads
    python bench/infer_speed_bench.py stream --int8                    # int8 Linear weights, as infer.py --int8
    python bench/infer_speed_bench.py stream --ctc-weights 0 0.3 --repeats 3   # what joint CTC scores cost
    python bench/infer_speed_bench.py stream --presets canary-180m-flash --streams 1 2 4 8 16 --device cuda

Every model has random weights (speed does not depend on them, and a seed makes every run build the
same one), and every system or layout does the same decoding work: EOS is never chosen, so each
utterance decodes a fixed number of tokens. Each mode prints its tables, then its results as a JSON
object on the last line, with ratios against a baseline measured in the same run (aed eager, or the
24+24 layout). On a machine shared with other jobs absolute times are noisy: compare the ratios of
one run, and rerun a row that looks off (stream: offline decoding of the same audio is the baseline).

systems
-------
Peers (optional, never in requirements.txt): faster-whisper, CTranslate2 and transformers, the last only
to build a random Whisper that CTranslate2's own converter turns into a faster-whisper model:
    .venv/bin/pip install --target /tmp/aed-peers --no-deps -r bench/requirements-infer-peers.txt
    PYTHONPATH=/tmp/aed-peers .venv/bin/python bench/infer_speed_bench.py
Without them the aed rows are measured and the comparisons are left out (the JSON says why).
NeMo's own Canary at the same shapes (optional, its own install; bench/nemo_canary.py says how):
    PYTHONPATH=/tmp/nemo-peers .venv/bin/python bench/infer_speed_bench.py --nemo --no-peers --parts files

Every system gets the same audio, the same number of decoded tokens (every utterance decodes exactly
--tokens) and the same threads. Greedy search, fp32 activations. Three parts:

1. Decoder step: ms per step of the Canary layouts' decoders (both 4 x 1024; canary-180m-flash's encoder
   is 17 x 512, canary-1b-flash's 32 x 1024), 100 encoder frames, at batch 1 and 16: eager, compiled (the
   static cache, aed/model_static.py) and int8 weights (aed.model_checkpoint.quantize_int8); the systems
   take turns, the fastest of --repeats runs kept. GB/s: the weight bytes a batch-1 step reads per second,
   beside the CPU's read bandwidth (summing 512 MB), the rate a step bound by reading its weights cannot beat.
2. Short utterances: --utterances generated files of --min-seconds to --max-seconds through the real
   pipeline (aed.decode_transcribe.transcribe: files -> features -> encoder -> search), files sorted by
   length in groups of 1 and 16. faster-whisper: WhisperModel.transcribe per file (batch 1); batch 16 runs
   its own pieces the way its BatchedInferencePipeline does (features padded to 30 s, encode, generate),
   across files. Whisper pads every input to 30 s: that is its cost on short utterances. NeMo (--nemo):
   the same groups through NeMo's preprocessor, encoder and greedy search (bench/nemo_canary.py).
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
before the timed runs (its seconds are printed).

rtfx
----
The pipeline is the real one: generated 16 kHz WAV files on disk -> load -> log-mel -> encoder -> search,
at one shared, CPU-sized width; each layout keeps its layer counts (24+24, 24+4, 32+4), and every
utterance generates exactly --tokens tokens. Batches: utterances sorted by duration, cut into groups of
exactly --batch-sizes files.
- RTFx: audio seconds / wall seconds of transcribe() (load+features + encoder + decoder + planning).
- encoder-only RTFx: the same run without its decoder time, the ceiling a free decoder would reach.
Why width 64 on a CPU: the paper's ~3x (Table 3, GPU) exists because a GPU decoder step is latency-bound
(its small kernels cannot fill the device), so decode time grows with the number of decoder layers, not
their FLOPs. A narrow model reproduces that regime on a CPU at batch 1. At batch 16 a CPU decoder step is
compute-bound like the encoder, and per audio second the encoder does ~4x the decoder's FLOPs per layer
(12.5 frames/s vs ~3.6 tokens/s), so there the flash layout gains less (docs/REPORT.md, E3).

decode
------
Each layout keeps its layer counts (24+24, 32+4, 24+4) at one shared width, so the comparison is about
where the layers sit. Greedy decoding runs a fixed number of steps (no EOS).
- encoder: model.encode on a batch of --seconds-long inputs.
- decoder ms/step, cached: mean over --cache-tokens KV-cached greedy steps, and the single step that
  produces token number --cache-tokens (cache rewound to that position and the step repeated).
- decoder ms/step, recomputed: producing that same token without a cache, i.e. the full decoder over
  prompt + all previous tokens, self- and cross-attention keys/values recomputed.
- RTFx: audio seconds / (encoder + prompt + --tokens cached greedy steps), end to end.

stream
------
Each preset at full size (Canary's vocabulary and 128 mels) with random weights, streamed as
`infer.py --stream` streams (10 s left context, 1 s chunks, 0.5 s look-ahead, AlignAtt): speed does
not depend on the weights, and the work is fixed: EOS is never chosen, the AlignAtt threshold is 0
(its cross-attention is still read at every step), and every chunk commits --tokens-per-second
x chunk tokens, so the decoder re-reads about that many tokens per second of its left context.

B streams of --seconds of noise are fed a chunk at a time and decoded as one batch. The noise is
continuous by default, the worst case: a stream's sentence never ends at a pause, so its window fills
to left context + chunk + look-ahead, is cut at its quietest point and fills again. With --pauses the
noise comes in sentences of 3-8 s between pauses of 0.5 s, as speech does: each sentence ends at its
pause, and the window holds one sentence. Timed: every decoding step of the batch (chunks, and
sentence ends decoded to EOS); the real-time factor is their total over the seconds of audio, and a
batch of B streams is real time when it is <= 1. Baseline in the same run: offline decoding
(infer.py's transcribe, greedy, the same tokens per second) of the same audio, batch B, whose cost
per second of audio the streaming figure is set against (streaming re-encodes its buffer for every
chunk: up to 11x the encoder work of offline decoding at a 11.5 s buffer). The Canary presets have no
CTC head; `--ctc-weights 0 0.3` gives them one and times each batch with the attention decoder alone
and with the joint CTC scores that a model trained with a head streams with (the head's projection
of every frame, the prefix scores of each step's candidates), in turn, `--repeats` times each.
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
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import soundfile as sf
import torch
from common import (LAYOUTS, MINI_TOKENIZER, PRESETS, add_device_args, add_width_args, device_from_args,
                    fixed_work, load_avg, log, print_json, print_table, proc_status_bytes, random_aed, random_asr,
                    reset_peak_rss, run_modes, sync, timed)

from aed.data_tokenizer import Tokenizer
from aed.decode_search import DecodingOptions
from aed.decode_stream import StreamConfig, Streamer
from aed.decode_transcribe import Timings, transcribe
from aed.model import AED, count_parameters
from aed.model_checkpoint import LoadedModel, quantize_int8
from aed.model_encoder import subsampled_length
from aed.model_static import CompiledAED

WHISPER = {  # size: (d_model, layers of encoder and of decoder, heads), as in openai/whisper
    "base": (512, 6, 8), "small": (768, 12, 12), "medium": (1024, 24, 16)}
COMPARABLE = {"canary-180m-flash": "small", "canary-1b-flash": "medium"}  # 182M vs 244M; 883M vs 769M parameters
WINDOW_S = 30.0  # Whisper's window, and the chunk length both systems decode long audio in
SYSTEMS = ["aed-eager", "aed-compiled", "aed-int8"]  # in this order: int8, last, quantizes in place


# --- measuring ------------------------------------------------------------------------------------

def reset_peak_memory(device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        reset_peak_rss()


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
    return proc_status_bytes("VmHWM") / 2**30


def result(audio_s: float, wall_s: float, encoder_s: float, decoder_s: float, tokens: int, peak_gb: float) -> dict:
    return {"rtfx": round(audio_s / wall_s, 2), "audio_s": round(audio_s, 1), "wall_s": round(wall_s, 2),
            "encoder_s": round(encoder_s, 2), "decoder_s": round(decoder_s, 2), "tokens": tokens,
            "peak_gb": round(peak_gb, 2)}


def make_audio(directory: Path, n: int, min_s: float, max_s: float, seed: int = 0) -> list[str]:
    """n WAV files of uniform random duration: a gliding harmonic tone in syllable-rate bursts, plus noise."""
    rng = np.random.default_rng(seed)
    sr, paths = 16000, []
    for i in range(n):
        t = np.arange(int(rng.uniform(min_s, max_s) * sr)) / sr
        f0 = rng.uniform(90, 250) * (1 + 0.1 * np.sin(2 * np.pi * rng.uniform(0.2, 1.0) * t))
        phase = 2 * np.pi * np.cumsum(f0) / sr
        voice = sum(np.sin(k * phase) / k for k in range(1, 6))
        envelope = np.clip(np.sin(2 * np.pi * rng.uniform(3, 5) * t), 0, None)  # ~4 "syllables" per second
        wav = 0.1 * voice * envelope + 0.003 * rng.standard_normal(t.size)
        paths.append(str(directory / f"utt{i:04d}.wav"))
        sf.write(paths[-1], wav.astype(np.float32), sr, subtype="PCM_16")
    return paths


def add_timings(total: Timings, t: Timings, fields=("audio", "wall", "load_features", "encoder", "decoder")) -> None:
    for f in fields:
        setattr(total, f, getattr(total, f) + getattr(t, f))


# --- aed ------------------------------------------------------------------------------------------

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
        add_timings(total, t, ("audio", "wall", "encoder", "decoder"))
    return result(total.audio, total.wall, total.encoder, total.decoder, tokens, peak_memory_gb(device))


def decoder_step_ms(model, batch: int, frames: int, steps: int, device) -> float:
    """ms per greedy decoder step of `model` (an AED or CompiledAED), after a 5-token prompt."""
    memory = torch.randn(batch, frames, model.cfg.dec_d_model, device=device)
    memory_lens = torch.full((batch,), frames, device=device)
    prompt = torch.full((batch, 5), 3, device=device)
    with torch.inference_mode():
        cache = model.new_cache(memory, memory_lens, 5 + steps + 1)
        token = model.decode_step(prompt, cache).argmax(-1, keepdim=True)
        sync(device)
        start = time.perf_counter()
        for _ in range(steps):
            token = model.decode_step(token, cache).argmax(-1, keepdim=True)
        sync(device)
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


# --- systems: aed against faster-whisper and NeMo ---------------------------------------------------

def systems_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layouts", nargs="+", choices=list(PRESETS), default=list(PRESETS))
    p.add_argument("--systems", nargs="+", default=SYSTEMS, choices=SYSTEMS)
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


@dataclass
class Files:
    """The audio every system transcribes: the short files, in groups per batch size, and the long file."""

    paths: list
    short_s: float  # their audio seconds
    by_length: list  # longest first
    groups: dict  # batch size -> the files in groups of that size, by length
    rate: float  # decoded tokens per audio second of the short files, kept in the long file's windows
    window_tokens: int
    long_path: str


@dataclass
class Measured:
    """Every system's numbers, by table: {system/layout: {batchN: ...}}."""

    files: dict = field(default_factory=dict)  # short files: result()
    long_form: dict = field(default_factory=dict)  # the long file: result()
    steps: dict = field(default_factory=dict)  # decoder step: ms
    weight_gbs: dict = field(default_factory=dict)  # {system/layout: GB/s at batch 1}
    warmup_s: dict = field(default_factory=dict)  # warm-up and compilation seconds


@dataclass
class Peers:
    whisper: bool  # faster-whisper measured
    whisper_missing: str | None  # why it is not installed
    nemo: object  # the nemo_canary module, or None
    nemo_missing: str | None


def find_peers(args, device) -> Peers:
    whisper_missing = nemo_missing = nemo = None
    if args.peers:
        try:
            import faster_whisper  # noqa: F401
        except ImportError as e:
            whisper_missing = f"faster-whisper is not installed ({e}): see bench/requirements-infer-peers.txt"
            log(whisper_missing)
    if args.nemo:
        try:
            import nemo_canary as nemo
        except ImportError as e:
            nemo_missing = f"NeMo is not installed ({e}): see bench/requirements-nemo-peers.txt"
            log(nemo_missing)
    return Peers(args.peers and whisper_missing is None and device.type == "cpu", whisper_missing, nemo, nemo_missing)


def make_files(args, work: Path) -> Files:
    """The short files and the long one (the short ones repeated), removed at exit."""
    audio_dir = Path(tempfile.mkdtemp(dir=work))
    atexit.register(shutil.rmtree, audio_dir, ignore_errors=True)  # the converted models stay, the audio goes
    paths = make_audio(audio_dir, args.utterances, args.min_seconds, args.max_seconds)
    durations = {q: sf.info(q).duration for q in paths}
    short_s = sum(durations.values())
    by_length = sorted(paths, key=durations.get, reverse=True)
    rate = args.tokens * len(paths) / short_s
    long_path = str(audio_dir / "long.wav")
    wavs = [sf.read(q, dtype="float32")[0] for q in paths]
    long_wav = np.concatenate(wavs * math.ceil(args.long_seconds / short_s))[: int(args.long_seconds * 16000)]
    sf.write(long_path, long_wav, 16000, subtype="PCM_16")
    return Files(paths, short_s, by_length,
                 {bs: [by_length[i : i + bs] for i in range(0, len(paths), bs)] for bs in args.batch_sizes},
                 rate, round(WINDOW_S * rate), long_path)


def time_decoder_steps(base: LoadedModel, layout: str, systems: list, args, device, m: Measured) -> None:
    """1. The decoder step of every system: they take turns, and each keeps its fastest of --repeats runs,
    so that another job's burst of load does not land on one system only."""
    variants = {f"{system}/{layout}": aed_variant(base, system) for system in systems}
    for name, asr in variants.items():
        m.steps[name] = {}
        for bs in args.batch_sizes:
            start = time.perf_counter()
            decoder_step_ms(asr.compiled or asr.model, bs, args.step_frames, 3, device)  # warm-up; compiles
            m.warmup_s[f"{name} step batch{bs}"] = round(time.perf_counter() - start, 1)
    for _ in range(args.repeats):
        for name, asr in variants.items():
            for bs in args.batch_sizes:
                ms = decoder_step_ms(asr.compiled or asr.model, bs, args.step_frames, args.steps, device)
                m.steps[name][f"batch{bs}"] = round(min(ms, m.steps[name].get(f"batch{bs}", math.inf)), 2)
    for name in variants if 1 in args.batch_sizes else []:
        m.weight_gbs[name] = round(step_weight_bytes(base.model, name.split("/")[0]) / m.steps[name]["batch1"] / 1e6, 1)


def time_aed_files(base: LoadedModel, layout: str, systems: list, f: Files, args, device, m: Measured) -> None:
    """2. and 3., one system at a time with only its own model in memory (the peak GB column): each
    system is made again, and int8 (last) quantizes the fp32 model."""
    short_opts = DecodingOptions(max_new_tokens=args.tokens, max_repeats=0, max_tokens_per_second=None, ctc_weight=0.0)
    # the long file: tokens in proportion to a chunk's length
    long_opts = DecodingOptions(max_repeats=0, max_tokens_per_second=f.rate, ctc_weight=0.0)
    long_batch = max(args.batch_sizes)
    for system in systems:
        name = f"{system}/{layout}"
        asr = aed_variant(base, system, in_place=True)
        release_memory()  # the fp32 weights int8 replaced
        m.files[name] = {}
        for bs in args.batch_sizes:
            start = time.perf_counter()
            run_aed(asr, [f.groups[bs][0], f.groups[bs][-1]], short_opts, device)  # warm-up: longest, shortest bucket
            m.warmup_s[f"{name} batch{bs}"] = round(time.perf_counter() - start, 1)
            m.files[name][f"batch{bs}"] = run_aed(asr, f.groups[bs], short_opts, device)
            log(f"{name} batch {bs}: {m.files[name][f'batch{bs}']}")
        kwargs = dict(chunk_seconds=WINDOW_S, batch_duration=long_batch * WINDOW_S)  # 30 s chunks, batched
        if system == "aed-compiled":  # warm-up: every bucket of the file's batches compiles before the timed run
            run_aed(asr, [[f.long_path]], long_opts, device, **kwargs)
        m.long_form[name] = {f"batch{long_batch}": run_aed(asr, [[f.long_path]], long_opts, device, **kwargs)}
        log(f"{name} long file: {m.long_form[name]}")
        del asr


def time_nemo(nemo, aed_cfg, aed_params: int, layout: str, f: Files, args, work: Path, device, m: Measured) -> None:
    """NeMo's Canary at the layout's shapes on the short files."""
    model = nemo.build(aed_cfg, aed_cfg.n_mels, work)
    name = f"nemo-canary/{layout}"
    log(f"{name}: {sum(q.numel() for q in model.parameters()):,} parameters (aed: {aed_params:,})")
    nemo.transcribe_groups(model, [[f.by_length[0]], [f.by_length[-1]]], 4)  # warm-up
    m.files[name] = {}
    for bs in args.batch_sizes:
        reset_peak_memory(device)
        r = nemo.transcribe_groups(model, f.groups[bs], args.tokens)
        m.files[name][f"batch{bs}"] = result(f.short_s, r["wall_s"], r["encoder_s"], r["decoder_s"], r["tokens"],
                                             peak_memory_gb(device))
    log(f"{name}: {m.files[name]}")
    del model
    release_memory()


def time_whisper(layout: str, f: Files, args, work: Path, device, m: Measured) -> None:
    """faster-whisper fp32 and int8 at the layout's comparable size (or --whisper), once per size."""
    from faster_whisper import WhisperModel

    size = args.whisper or COMPARABLE[layout]
    ct2_dir = random_whisper(size, work)
    long_batch = max(args.batch_sizes)
    for compute in ("float32", "int8"):
        name = f"faster-whisper-{'fp32' if compute == 'float32' else compute}/{size}"
        if name in m.files:
            continue
        model = WhisperModel(str(ct2_dir), device="cpu", compute_type=compute, cpu_threads=args.threads)
        short_new, long_new = fw_new_tokens(model, args.tokens), fw_new_tokens(model, f.window_tokens)
        log(f"{name}: max_new_tokens {short_new} per short file, {long_new} per window")
        run_whisper_files(model, [[f.by_length[-1]]], 1, 4, 1.0, device)  # warm-up
        m.files[name] = {f"batch{bs}": run_whisper_files(model, f.groups[bs], bs, short_new, f.short_s, device)
                         for bs in args.batch_sizes}
        log(f"{name}: {m.files[name]}")
        m.long_form[name] = {f"batch{bs}": run_whisper_long(model, f.long_path, bs, long_new, args.long_seconds, device)
                             for bs in sorted({1, long_batch})}
        log(f"{name} long file: {m.long_form[name]}")
        del model
        release_memory()


def print_systems(m: Measured, f: Files, args, read_gbs) -> None:
    """The tables; RTFx compares like with like only where every system decoded the same tokens."""
    for table, expected in ((m.files, args.tokens * len(f.paths)), (m.long_form, round(f.rate * args.long_seconds))):
        for n, by_batch in table.items():
            for b, r in by_batch.items():
                if abs(r["tokens"] - expected) > 0.05 * expected:
                    log(f"WARNING: {n} {b} decoded {r['tokens']} tokens, not ~{expected}: its RTFx is not comparable")
    columns = [("system", "<38"), ("batch", "5d"), ("RTFx", "8.1f"), ("wall s", "8.1f"), ("encoder s", "10.1f"),
               ("decoder s", "10.1f"), ("tokens", "7d"), ("peak GB", "8.2f")]
    print()
    print_table(columns, [[n, int(b[5:]), r["rtfx"], r["wall_s"], r["encoder_s"], r["decoder_s"], r["tokens"],
                           r["peak_gb"]] for n, by_batch in m.files.items() for b, r in by_batch.items()])
    print(f"\nlong file ({args.long_seconds:.0f} s, {WINDOW_S:.0f} s windows of {f.window_tokens} tokens)")
    print_table(columns, [[n, int(b[5:]), r["rtfx"], r["wall_s"], r["encoder_s"], r["decoder_s"], r["tokens"],
                           r["peak_gb"]] for n, by_batch in m.long_form.items() for b, r in by_batch.items()])
    if "step" in args.parts:
        print(f"\ndecoder step, ms ({args.step_frames} encoder frames); weight GB/s at batch 1"
              + (f" (CPU read bandwidth {read_gbs} GB/s)" if read_gbs else ""))
        print_table([("system", "<38")] + [(f"batch {bs}", "9.2f") for bs in args.batch_sizes] + [("GB/s", "6.1f")],
                    [[n] + [s[f"batch{bs}"] for bs in args.batch_sizes] + [m.weight_gbs.get(n, math.nan)]
                     for n, s in m.steps.items()])
    print(f"\nwarm-up and compilation seconds: {m.warmup_s}")


def ratio(a, b):
    return round(a / b, 2) if b else None


def systems_summary(m: Measured, f: Files, args, systems: list, peers: Peers, read_gbs, device) -> dict:
    """The JSON line: every table, and the ratios against aed eager of the same run."""
    first, long_batch = args.layouts[0], max(args.batch_sizes)
    summary = {"device": str(device), "threads": args.threads, "load": load_avg(), "utterances": len(f.paths),
               "short_audio_s": round(f.short_s, 1), "tokens": args.tokens, "long_file_s": args.long_seconds,
               "window_tokens": f.window_tokens, "systems": m.files, "long_form": m.long_form,
               "decoder_step_ms": m.steps, "decoder_step_weight_gbs_batch1": m.weight_gbs, "cpu_read_gbs": read_gbs,
               "warmup_s": m.warmup_s}
    files, stepped = "files" in args.parts, "step" in args.parts
    if "aed-compiled" in systems and "aed-eager" in systems and 1 in args.batch_sizes:
        if stepped:
            summary["compiled_vs_eager_decoder_step"] = {
                f"{layout}/batch{bs}": ratio(m.steps[f"aed-eager/{layout}"][f"batch{bs}"],
                                             m.steps[f"aed-compiled/{layout}"][f"batch{bs}"])
                for layout in args.layouts for bs in args.batch_sizes}
        # the decoder's seconds in the pipeline at batch 1 (the encoder is the same eager one in both),
        # else the step timing's
        summary["compiled_vs_eager_batch1"] = (
            ratio(m.files[f"aed-eager/{first}"]["batch1"]["decoder_s"],
                  m.files[f"aed-compiled/{first}"]["batch1"]["decoder_s"])
            if files else summary["compiled_vs_eager_decoder_step"][f"{first}/batch1"])
    if "aed-int8" in systems and "aed-eager" in systems and 1 in args.batch_sizes and stepped:
        by_layout = {layout: ratio(m.steps[f"aed-eager/{layout}"]["batch1"], m.steps[f"aed-int8/{layout}"]["batch1"])
                     for layout in args.layouts}
        summary["int8_vs_eager_decoder_step_batch1"] = min(by_layout.values())  # the target holds for every layout
        summary["int8_vs_eager_decoder_step_batch1_by_layout"] = by_layout
    if peers.whisper and files:
        def best(table, prefix):
            return max(r["rtfx"] for n, by_batch in table.items() if n.startswith(prefix) for r in by_batch.values())

        summary["vs_faster_whisper"] = {  # best aed system of the first layout vs the best faster-whisper at its size
            "layout": first, "whisper": args.whisper or COMPARABLE[first],
            "short_utterances": ratio(max(best(m.files, f"{s}/{first}") for s in systems),
                                      best(m.files, "faster-whisper")),
            "long_form": ratio(max(best(m.long_form, f"{s}/{first}") for s in systems),
                               best(m.long_form, "faster-whisper"))}
    else:
        summary["vs_faster_whisper"] = {"skipped": peers.whisper_missing
                                        or "--no-peers, --parts without files, or not on the CPU"}
    if args.nemo and files and "aed-eager" in systems and device.type == "cpu":  # aed's eager fp32 against NeMo's
        summary["vs_nemo"] = peers.nemo_missing or {
            f"{layout}/batch{bs}": ratio(m.files[f"aed-eager/{layout}"][f"batch{bs}"]["rtfx"],
                                         m.files[f"nemo-canary/{layout}"][f"batch{bs}"]["rtfx"])
            for layout in args.layouts for bs in args.batch_sizes}
    if files and "aed-eager" in systems and long_batch in args.batch_sizes:
        summary["long_file_vs_short_files"] = ratio(m.long_form[f"aed-eager/{first}"][f"batch{long_batch}"]["rtfx"],
                                                    m.files[f"aed-eager/{first}"][f"batch{long_batch}"]["rtfx"])
    summary["targets"] = {"int8_vs_eager_decoder_step_batch1": 4.0, "compiled_vs_eager_batch1": 1.0,
                          "vs_faster_whisper_short_utterances": 5.0, "vs_faster_whisper_long_form": 2.0,
                          "long_file_vs_short_files": 0.8}
    return summary


def systems_mode(args) -> None:
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    systems = [s for s in SYSTEMS if s in args.systems and not (s == "aed-int8" and device.type != "cpu")]  # int8: CPU
    tokenizer = Tokenizer.load(MINI_TOKENIZER)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    peers = find_peers(args, device)
    f = make_files(args, work)
    print(f"device {device}, {args.threads} threads, load {load_avg()}; {len(f.paths)} files / {f.short_s:.0f} s, "
          f"{args.tokens} tokens each; long file {args.long_seconds:.0f} s in {WINDOW_S:.0f} s windows of "
          f"{f.window_tokens} tokens")
    m = Measured()
    read_gbs = round(read_bandwidth_gbs(), 1) if device.type == "cpu" and "step" in args.parts else None
    for layout in args.layouts:
        base = random_asr(layout, tokenizer, device)
        aed_params = sum(q.numel() for q in base.model.parameters())
        log(f"{layout}: {aed_params / 1e6:.0f}M parameters")
        if "step" in args.parts:
            time_decoder_steps(base, layout, systems, args, device, m)
        log(f"{layout}: decoder step ms {m.steps}")
        release_memory()  # the step's variants
        if "files" in args.parts:
            time_aed_files(base, layout, systems, f, args, device, m)
        aed_cfg = base.model.cfg
        del base  # the peers' peak GB counts their own model only
        release_memory()
        if args.nemo and peers.nemo is not None and "files" in args.parts and device.type == "cpu":
            time_nemo(peers.nemo, aed_cfg, aed_params, layout, f, args, work, device, m)
        if peers.whisper and "files" in args.parts:
            time_whisper(layout, f, args, work, device, m)
    print_systems(m, f, args, read_gbs)
    print_json(systems_summary(m, f, args, systems, peers, read_gbs, device))
# --- rtfx: infer.py's pipeline for the Canary layouts at a CPU-sized width ----------------------------

def rtfx_flags(p: argparse.ArgumentParser) -> None:
    add_width_args(p, d_model=64, subsampling_channels=16)  # why 64: the module docstring
    p.add_argument("--utterances", type=int, default=48, help="generated files (the issue suggests 200 on a GPU)")
    p.add_argument("--min-seconds", type=float, default=2.0)
    p.add_argument("--max-seconds", type=float, default=20.0)
    p.add_argument("--tokens", type=int, default=40, help="generated tokens per utterance (~11 s of speech)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    p.add_argument("--beams", type=int, nargs="+", default=[1, 4], help="1 = greedy")
    add_device_args(p)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")


def run_groups(asr: LoadedModel, groups: list[list[str]], beam_size: int, args) -> Timings:
    """transcribe() once per group (one batch each); the timings summed."""
    total = Timings()
    for group in groups:
        _, t = transcribe(asr, group, DecodingOptions(beam_size=beam_size, max_new_tokens=args.tokens),
                          batch_duration=math.inf, dtype=torch.bfloat16 if args.dtype == "bf16" else None)
        add_timings(total, t)
    return total


def rtfx_row(name: str, beam: int, bs: int, t: Timings) -> dict:
    row = {"layout": name, "search": "greedy" if beam == 1 else f"beam{beam}", "batch": bs,
           "audio_s": round(t.audio, 1), "wall_s": round(t.wall, 3), "load_features_s": round(t.load_features, 3),
           "encoder_s": round(t.encoder, 3), "decoder_s": round(t.decoder, 3), "rtfx": round(t.rtfx, 2),
           "encoder_only_rtfx": round(t.audio / (t.wall - t.decoder), 2)}
    return row | {"rtfx_of_encoder_only": round(row["rtfx"] / row["encoder_only_rtfx"], 3)}


def rtfx_mode(args) -> None:
    device = device_from_args(args)
    tokenizer = Tokenizer.load(MINI_TOKENIZER)
    with tempfile.TemporaryDirectory() as tmp:
        paths = make_audio(Path(tmp), args.utterances, args.min_seconds, args.max_seconds)
        durations = {p: sf.info(p).duration for p in paths}
        by_length = sorted(paths, key=durations.get, reverse=True)
        audio_s = sum(durations.values())
        print(f"device {device}, threads {torch.get_num_threads()}, width {args.d_model}, {args.dtype}, "
              f"{len(paths)} files / {audio_s:.0f} s of audio, {args.tokens} tokens each")
        rows = []
        for name, (enc_layers, dec_layers) in LAYOUTS.items():
            asr = fixed_work(random_aed(args, enc_layers, dec_layers).to(device).eval(), tokenizer)
            run_groups(asr, [by_length[-2:]], 1, args)  # warm-up: first-call allocations and kernel selection
            for beam in args.beams:
                for bs in args.batch_sizes:
                    start = time.perf_counter()
                    t = run_groups(asr, [by_length[i: i + bs] for i in range(0, len(paths), bs)], beam, args)
                    rows.append(rtfx_row(name, beam, bs, t))
                    log(f"done {name} {rows[-1]['search']} batch {bs}: RTFx {rows[-1]['rtfx']} "
                        f"({time.perf_counter() - start:.0f} s)")

    def row(layout, search, bs):
        return next(r for r in rows if r["layout"].startswith(layout) and r["search"] == search and r["batch"] == bs)

    for r in rows:
        r["rtfx_vs_canary_1b"] = round(r["rtfx"] / row("canary-1b ", r["search"], r["batch"])["rtfx"], 2)
    print_table([("layout", "<24"), ("search", ">7"), ("batch", "5d"), ("wall s", "8.2f"), ("load+feat s", "11.2f"),
                 ("encoder s", "10.2f"), ("decoder s", "10.2f"), ("RTFx", "8.1f"), ("enc-only", "9.1f"),
                 ("of enc", "7.2f"), ("vs 24+24", "9.2f")],
                [[r["layout"], r["search"], r["batch"], r["wall_s"], r["load_features_s"], r["encoder_s"],
                  r["decoder_s"], r["rtfx"], r["encoder_only_rtfx"], r["rtfx_of_encoder_only"], r["rtfx_vs_canary_1b"]]
                 for r in rows])
    flash = {f"{r['search']}/{r['batch']}": r["rtfx_vs_canary_1b"] for r in rows if "flash" in r["layout"]}
    summary = {"device": str(device), "threads": torch.get_num_threads(), "d_model": args.d_model, "dtype": args.dtype,
               "utterances": len(paths), "audio_s": round(audio_s, 1), "tokens": args.tokens, "rows": rows,
               "flash_rtfx_vs_canary_1b": flash,  # by "search/batch"
               "targets": {"flash_rtfx_vs_canary_1b": 2.5, "flash_rtfx_of_encoder_only_greedy_16": 0.5}}
    if 1 in args.beams and 16 in args.batch_sizes:
        summary["flash_rtfx_of_encoder_only_greedy_16"] = row("canary-1b-flash", "greedy", 16)["rtfx_of_encoder_only"]
        summary["met"] = {
            "flash_2.5x_greedy_1": flash.get("greedy/1", 0.0) >= 2.5,
            "flash_2.5x_greedy_16": flash["greedy/16"] >= 2.5,
            "flash_50pct_of_encoder_only_greedy_16": summary["flash_rtfx_of_encoder_only_greedy_16"] >= 0.5,
        }
    print_json(summary)


# --- decode: encoder time and the decoder step with and without the KV cache -------------------------

def decode_flags(p: argparse.ArgumentParser) -> None:
    add_width_args(p, d_model=256, subsampling_channels=64)
    p.add_argument("--batch", type=int, default=2, help="utterances per batch")
    p.add_argument("--seconds", type=float, default=30.0, help="duration of each input")
    p.add_argument("--tokens", type=int, default=100, help="generated tokens per utterance for RTFx (~30 s of speech)")
    p.add_argument("--cache-tokens", type=int, default=50, help="n: compare cached vs recomputed at the n-th token")
    p.add_argument("--repeats", type=int, default=2, help="take the best of this many runs")
    add_device_args(p)


def greedy_cached(model, memory, memory_lens, prompt, steps):
    """Prefill the prompt, then `steps` argmax steps with the KV cache (EOS ignored: fixed work)."""
    cache = model.new_cache(memory, memory_lens, prompt.size(1) + steps)
    logits = model.decode_step(prompt, cache)
    for _ in range(steps):
        logits = model.decode_step(logits.argmax(-1, keepdim=True), cache)
    return logits


def recompute_step(model, memory, memory_lens, tokens):
    """One new token without a cache: the whole decoder over the prefix, logits of the last position."""
    return model.decoder.output_proj(model.decoder(tokens, memory, memory_lens)[:, -1]).float()


def decode_layout(name, enc_layers, dec_layers, args, device) -> dict:
    model = random_aed(args, enc_layers, dec_layers).to(device).eval()
    frames = int(args.seconds * 100)  # 10 ms feature hop
    feats = torch.randn(args.batch, frames, 128, device=device)
    feat_lens = torch.full((args.batch,), frames, device=device)
    prompt = torch.randint(10, 5000, (args.batch, 5), device=device)  # the 5-token Canary prompt
    with torch.inference_mode():
        enc_s, (memory, memory_lens) = timed(lambda: model.encode(feats, feat_lens), device, args.repeats)

        n = args.cache_tokens
        prefill_s, _ = timed(lambda: greedy_cached(model, memory, memory_lens, prompt, 0), device, args.repeats)
        cached_s, _ = timed(lambda: greedy_cached(model, memory, memory_lens, prompt, n), device, args.repeats)
        cached_mean_ms = (cached_s - prefill_s) / n * 1e3

        # The step that produces token n: its input is token n-1 at position P+n-2 (positions count from 0).
        tokens = torch.cat([prompt, torch.randint(10, 5000, (args.batch, n - 1), device=device)], dim=1)
        cache = model.new_cache(memory, memory_lens, tokens.size(1))
        model.decode_step(tokens[:, :-1], cache)

        def cached_step():
            cache.length = tokens.size(1) - 1  # rewind: every repeat rewrites the same cache slot
            return model.decode_step(tokens[:, -1:], cache)

        cached_ms = timed(cached_step, device, args.repeats + 2)[0] * 1e3
        recompute_ms = timed(lambda: recompute_step(model, memory, memory_lens, tokens), device,
                             args.repeats + 2)[0] * 1e3

        e2e_s, _ = timed(
            lambda: greedy_cached(model, *model.encode(feats, feat_lens), prompt, args.tokens), device, args.repeats
        )
    return {
        "layout": name,
        "params_m": round(count_parameters(model) / 1e6, 2),
        "encoder_s": round(enc_s, 4),
        "dec_ms_per_step_cached_mean": round(cached_mean_ms, 3),
        "dec_ms_at_token_n_cached": round(cached_ms, 3),
        "dec_ms_at_token_n_recomputed": round(recompute_ms, 3),
        "kv_cache_speedup_at_token_n": round(recompute_ms / cached_ms, 2),
        "end_to_end_s": round(e2e_s, 4),
        "rtfx": round(args.batch * args.seconds / e2e_s, 2),
    }


def decode_mode(args) -> None:
    device = device_from_args(args)
    print(f"device {device}, threads {torch.get_num_threads()}, width {args.d_model}, "
          f"batch {args.batch} x {args.seconds:g} s ({subsampled_length(int(args.seconds * 100))} encoder frames), "
          f"{args.tokens} tokens for RTFx")
    rows = []
    for name, (enc_layers, dec_layers) in LAYOUTS.items():
        rows.append(decode_layout(name, enc_layers, dec_layers, args, device))
        log(f"done {name}: rtfx {rows[-1]['rtfx']}")
    for r in rows:
        r["rtfx_vs_canary_1b"] = round(r["rtfx"] / rows[0]["rtfx"], 2)
    n = args.cache_tokens
    print_table([("layout", "<24"), ("params M", "9.2f"), ("encoder s", "10.3f"), ("cached ms/step", "15.2f"),
                 (f"cached ms @{n}", "15.2f"), (f"recomp ms @{n}", "15.2f"), ("cache x", "8.1f"), ("e2e s", "8.2f"),
                 ("RTFx", "8.1f"), ("vs 24+24", "9.2f")],
                [[r["layout"], r["params_m"], r["encoder_s"], r["dec_ms_per_step_cached_mean"],
                  r["dec_ms_at_token_n_cached"], r["dec_ms_at_token_n_recomputed"], r["kv_cache_speedup_at_token_n"],
                  r["end_to_end_s"], r["rtfx"], r["rtfx_vs_canary_1b"]] for r in rows])
    flash = next(r for r in rows if "flash" in r["layout"])
    print_json({"device": str(device), "threads": torch.get_num_threads(), "d_model": args.d_model,
                "batch": args.batch, "seconds": args.seconds, "tokens": args.tokens, "cache_tokens": args.cache_tokens,
                "rows": rows, "min_kv_cache_speedup_at_token_n": min(r["kv_cache_speedup_at_token_n"] for r in rows),
                "flash_rtfx_vs_canary_1b": flash["rtfx_vs_canary_1b"],
                "targets": {"kv_cache_speedup_at_token_n": 5.0, "flash_rtfx_vs_canary_1b": 2.5}})


# --- stream: concurrent real-time streams against offline decoding -----------------------------------

def stream_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--presets", nargs="+", default=["canary-180m-flash", "canary-1b-flash"])
    p.add_argument("--streams", nargs="+", type=int, default=[1, 2, 4, 8], help="batch sizes: concurrent streams")
    p.add_argument("--seconds", type=float, default=30.0, help="audio per stream")
    p.add_argument("--pauses", action="store_true", help="sentences of 3-8 s between pauses, not continuous noise")
    p.add_argument("--tokens-per-second", type=float, default=4.0,
                   help="tokens committed per second of audio (Canary's tokenizers: about 4 on real speech)")
    p.add_argument("--chunk", type=float, default=StreamConfig.chunk)
    p.add_argument("--left", type=float, default=StreamConfig.left)
    p.add_argument("--right", type=float, default=StreamConfig.right)
    p.add_argument("--int8", action="store_true", help="int8 Linear weights (CPU only; as infer.py --int8)")
    p.add_argument("--ctc-weights", nargs="+", type=float, default=[0.0],
                   help="decode with each of these CTC weights in turn (> 0: the preset gets a CTC head, and streams "
                        "decode joint with it, as a model trained with one does; 0: the attention decoder alone)")
    p.add_argument("--repeats", type=int, default=1, help="time each batch this many times per weight: the fastest is kept")
    p.add_argument("--max-rtf", type=float, default=2.0,
                   help="stop growing the batch once a batch's real-time factor passes this")
    add_device_args(p, threads=2)


def stream_batch(streamer: Streamer, wavs: list[torch.Tensor]) -> float:
    """Seconds of processing of the batch of streams fed `wavs` (all of equal length), every step."""
    streams = [streamer.open("en") for _ in wavs]
    n = wavs[0].numel()
    for start in range(0, n, streamer.chunk):
        for s, w in zip(streams, wavs):
            s.push(w[start: start + streamer.chunk])
        streamer.run(streams)
    streamer.run(streams, final=True)
    return sum(streams[0].chunk_compute)


def noise(seconds: float, pauses: bool, gen: torch.Generator, rate: int = 16000) -> torch.Tensor:
    """Noise at 0.01 of full scale: continuous, or in bursts of 3-8 s between 0.5 s of silence."""
    wav = 0.01 * torch.randn(round(seconds * rate), generator=gen)
    if pauses:
        t = 0
        while t < wav.numel():
            t += round(float(torch.empty(1).uniform_(3, 8, generator=gen)) * rate)
            wav[t: t + rate // 2] = 0.0
            t += rate // 2
    return wav


def offline(loaded, wavs: list[torch.Tensor], options: DecodingOptions) -> float:
    """RTFx of transcribing the same audio offline as one batch."""
    with tempfile.TemporaryDirectory() as tmp:
        paths = []
        for i, w in enumerate(wavs):
            paths.append(f"{tmp}/{i}.wav")
            sf.write(paths[-1], w.numpy(), 16000, subtype="FLOAT")
        _, timings = transcribe(loaded, paths, options, batch_duration=1e9)
    return timings.rtfx


def stream_mode(args) -> None:
    device = device_from_args(args)
    tokenizer = Tokenizer.load(MINI_TOKENIZER)
    config = StreamConfig(chunk=args.chunk, left=args.left, right=args.right, alignatt_threshold=0.0)
    weights = args.ctc_weights
    options = {w: DecodingOptions(ctc_weight=w, max_repeats=0, max_tokens_per_second=args.tokens_per_second)
               for w in weights}
    gen = torch.Generator().manual_seed(0)
    rows, out = [], {}
    with torch.inference_mode():
        for preset in args.presets:
            # One model for every weight: with a CTC head where any weight uses one (weight 0 leaves it unused).
            loaded = random_asr(preset, tokenizer, device, ctc_loss_weight=max(weights))
            if args.int8:
                loaded = aed_variant(loaded, "aed-int8", in_place=True)
            streamers = {w: Streamer(loaded, config, options[w]) for w in weights}
            first = streamers[weights[0]]
            chunk_s = first.chunk / first.rate
            result = {"chunk_s": chunk_s, "buffer_s": (first.left + first.chunk + first.right) / first.rate,
                      "ctc_weights": {}}
            for streamer in streamers.values():
                stream_batch(streamer, [noise(4, args.pauses, gen)])  # warm-up
            found = {w: {"batches": {}, "realtime_streams": 0} for w in weights}
            for b in args.streams:
                wavs = [noise(args.seconds, args.pauses, gen) for _ in range(b)]
                log(f"{preset}: {b} stream(s) of {args.seconds:g} s, CTC weight(s) {' '.join(map(str, weights))} "
                    f"in turn, {args.repeats} time(s)")
                best = {w: math.inf for w in weights}
                for _ in range(args.repeats):  # the weights in turn: each meets the same load
                    for w in weights:
                        best[w] = min(best[w], stream_batch(streamers[w], wavs) / args.seconds)
                for w in weights:
                    rtf = best[w]
                    ms = 1000 * rtf * chunk_s  # processing per chunk of audio, all steps counted
                    offline_rtfx = offline(loaded, wavs, options[w])
                    # per second of audio: streaming's processing over offline decoding's
                    cost = (ms / 1000 / (b * chunk_s)) * offline_rtfx
                    found[w]["batches"][b] = {"ms_per_chunk": ms, "rtf": rtf, "offline_rtfx": offline_rtfx,
                                              "cost_vs_offline": cost, "vs_first_weight": rtf / best[weights[0]]}
                    rows.append([preset, w, b, ms, rtf, "yes" if rtf <= 1 else "no", offline_rtfx, cost,
                                 rtf / best[weights[0]]])
                    if rtf <= 1:
                        found[w]["realtime_streams"] = b  # the largest measured batch at real-time factor <= 1
                if min(best.values()) > args.max_rtf:
                    break
            result["ctc_weights"] = found
            out[preset] = result
    print_table([("preset", "<20"), ("CTC", ">4.1f"), ("streams", ">7d"), ("ms/chunk", ">9.0f"), ("RTF", ">6.2f"),
                 ("real time", ">9"), ("offline RTFx", ">12.1f"), ("cost vs offline", ">15.1f"),
                 (f"vs CTC {weights[0]:g}", ">9.2f")], rows)
    print_json({"device": str(device), "threads": args.threads, "int8": args.int8, "pauses": args.pauses,
                "repeats": args.repeats, "load_avg": load_avg(), "tokens_per_second": args.tokens_per_second,
                "presets": out})


MODES = {  # name: (its flags, its run, what it measures)
    "systems": (systems_flags, systems_mode, "aed eager / compiled / int8 against faster-whisper and NeMo"),
    "rtfx": (rtfx_flags, rtfx_mode, "infer.py's pipeline for the layouts 24+24, 24+4, 32+4 at a CPU-sized width"),
    "decode": (decode_flags, decode_mode, "encoder time and decoder ms/step with and without the KV cache"),
    "stream": (stream_flags, stream_mode, "concurrent real-time streams of the Canary Flash presets vs offline"),
}


def main(argv: list[str] | None = None) -> None:
    run_modes(__doc__, MODES, "systems", argv)


if __name__ == "__main__":
    main()
