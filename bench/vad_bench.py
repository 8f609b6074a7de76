"""How well speech detectors find the speech in long recordings as rooms make them, frame by frame.

    python bench/vad_bench.py                      # the digits dev set, and the Asterisk prompts where installed
    python bench/vad_bench.py --manifest data/mini/dev.jsonl --conditions clean pink --detectors energy
    pip install silero-vad                         # adds the `silero` detector

For each manifest and each of --conditions, tools/make_long_audio.py builds --files long files of
--seconds (its default pauses of 0.3-0.9 s, seeded; `room-tone` adds its 45 s gap; --transient a
knock in a pause), and each detector judges every 10 ms frame of each file:
    speech kept %   of the frames in the middle half of each utterance, those called speech (what a
                    cutter keeps of the words: higher is better)
    pause called %  of the frames between utterances, 0.1 s or more from both, those called speech
                    (what it feeds the decoder that holds no speech: lower is better)
    cpu s           the detector's CPU time (this process, --threads threads) over the condition's files
Then audio with no speech at all, as a stream would meet it: 60 s of room tone at -50 dBFS, and 20 s
of steady white noise at -60 dBFS, with the % of frames called speech.

Detectors (DETECTORS: a name -> (wav (S,) float tensor, sample rate) -> (S // hop,) bool at 10 ms),
aed's own (aed.data_speech.speech_detector, what infer.py --vad picks), on the audio at 16 kHz:
    energy       the energy rule, with gaps shorter than aed.decode_timing.PAUSE filled: the
                 stretches that long-form decoding cuts into segments
    silero       Silero VAD (`pip install silero-vad`; used where it imports), gaps filled alike
    energy-raw, silero-raw   the frames as the detector judged them, no gap filled
Without --manifest: data/mini/digits/dev.jsonl, and the Asterisk prompts in English, Spanish and
French where Debian's asterisk-core-sounds-{en,es,fr}-wav are installed (made into manifests by
tools/manifest_from_prompts.py). A table, then the JSON line.
"""

import argparse
import importlib.util
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import soundfile as sf
import torch
import torchaudio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, log, manifest_rows, print_json, print_table  # noqa: E402

sys.path.insert(0, str(ROOT / "tools"))
import make_long_audio  # noqa: E402
import manifest_from_prompts  # noqa: E402

from aed.data_speech import FRAME, speech_detector  # noqa: E402
from aed.decode_timing import speech_runs  # noqa: E402

DEFAULT_MANIFEST = ROOT / "data" / "mini" / "digits" / "dev.jsonl"
PROMPT_LANGUAGES = ("en", "es", "fr")  # Debian's asterisk-core-sounds-*-wav
EDGE_MARGIN = 0.1  # s: frames this close to an utterance are neither its speech nor the pause
STREAM_RATE = 16000  # what the detectors run at


# --- detectors ---------------------------------------------------------------------------------

def judged(name: str, wav: torch.Tensor, rate: int) -> torch.Tensor:
    """wav (S,) -> (S // hop,) bool: aed's detector `name` (aed.data_speech.speech_detector) on the
    whole file, as infer.py --vad NAME judges it (at 16 kHz, where Silero runs)."""
    if rate != STREAM_RATE:
        wav = torchaudio.functional.resample(wav, rate, STREAM_RATE)
    detector = speech_detector(name, STREAM_RATE)
    return detector.speech(detector.scores(wav, final=True))


def regions(speech: torch.Tensor) -> torch.Tensor:
    """(frames,) bool: the speech with every gap shorter than a pause filled, the regions that
    long-form cutting (aed.decode_timing.plan_segments) decodes."""
    filled = torch.zeros_like(speech)
    for stretch in speech_runs(speech):
        filled[stretch[0][0]:stretch[-1][1]] = True
    return filled


def detector(name: str, raw: bool):
    def detect(wav: torch.Tensor, rate: int) -> torch.Tensor:
        speech = judged(name, wav, rate)
        return speech if raw else regions(speech)
    detect.__name__ = name + "-raw" * raw
    return detect


DETECTORS = {name + "-raw" * raw: detector(name, raw) for name in ("energy", "silero") for raw in (False, True)}


def silero_installed() -> bool:
    return importlib.util.find_spec("silero_vad") is not None


# --- what a detector gets right ----------------------------------------------------------------

def frame_range(start: float, end: float) -> slice:
    """The 10 ms frames lying wholly within [start, end) s."""
    return slice(math.ceil(start / FRAME - 1e-6), max(0, math.floor(end / FRAME + 1e-6)))


def judged_frames(parts: list, frames: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(frames,) bool masks of a long file with utterances `parts` (start, end s): the middle half
    of each utterance, and its pauses less EDGE_MARGIN at either side."""
    middle, pause = torch.zeros(frames, dtype=torch.bool), torch.zeros(frames, dtype=torch.bool)
    for part in parts:
        quarter = (part["end"] - part["start"]) / 4
        middle[frame_range(part["start"] + quarter, part["end"] - quarter)] = True
    for before, after in zip(parts, parts[1:]):
        pause[frame_range(before["end"] + EDGE_MARGIN, after["start"] - EDGE_MARGIN)] = True
    return middle, pause


def measure(detect, files: list) -> dict:
    """A detector over long files [(wav (S,), rate, parts)]: % of utterance middles and of pauses
    called speech, and its CPU seconds."""
    kept = spoken = paused = called = 0
    cpu = 0.0
    for wav, rate, parts in files:
        t0 = time.process_time()
        speech = detect(wav, rate)
        cpu += time.process_time() - t0
        frames = wav.numel() // round(rate * FRAME)
        assert speech.shape == (frames,), f"{detect.__name__}: {tuple(speech.shape)} frames, not ({frames},)"
        middle, pause = judged_frames(parts, frames)
        kept, spoken = kept + int(speech[middle].sum()), spoken + int(middle.sum())
        called, paused = called + int(speech[pause].sum()), paused + int(pause.sum())
    return {"speech_kept_pct": round(100 * kept / max(spoken, 1), 2),
            "pause_called_pct": round(100 * called / max(paused, 1), 2), "cpu_s": round(cpu, 3),
            "speech_frames": spoken, "pause_frames": paused}


# --- inputs ------------------------------------------------------------------------------------

def default_manifests(work: Path) -> list[tuple[str, str]]:
    """(name, path) of the digits dev set and of the Asterisk prompts that are installed."""
    sets = [("digits", str(DEFAULT_MANIFEST))]
    for lang in PROMPT_LANGUAGES:
        audio = manifest_from_prompts.ASTERISK_AUDIO.format(lang=lang)
        if not os.path.isdir(audio):
            log(f"no Asterisk prompts in {lang} ({audio}): apt-get install asterisk-core-sounds-{lang}-wav to add them")
            continue
        path = work / f"asterisk_{lang}.jsonl"
        manifest_from_prompts.main(["--lang", lang, "-o", str(path)])
        sets.append((f"asterisk-{lang}", str(path)))
    return sets


def long_files(manifest: str, condition: str, out: Path, args) -> list:
    """make_long_audio's files of `manifest` under `condition`: [(wav (S,), rate, parts)]."""
    made = ["--manifest", manifest, "-o", str(out), "--condition", condition, "--seconds", str(args.seconds),
            "--files", str(args.files), "--seed", str(args.seed), "--talker-db", str(args.talker_db)
            ] + ["--transient"] * args.transient
    log(f"tools/make_long_audio.py {' '.join(made)}")
    make_long_audio.main(made)
    files = []
    for row in manifest_rows(out / "manifest.jsonl"):
        wav, rate = sf.read(row["audio_filepath"], dtype="float32")
        files.append((torch.from_numpy(wav), rate, row["parts"]))
    return files


def no_speech_streams(args) -> dict:
    """{name: (wav (S,), rate)}: audio without speech that a stream meets between talks."""
    tone = make_long_audio.room_tone(np.random.default_rng([args.seed, 1]), 60 * STREAM_RATE, STREAM_RATE)
    hiss = np.random.default_rng([args.seed, 2]).standard_normal(20 * STREAM_RATE)
    return {"room tone -50 dBFS, 60 s": torch.from_numpy(10 ** (-50 / 20) * tone).float(),
            "white noise -60 dBFS, 20 s": torch.from_numpy(10 ** (-60 / 20) * hiss).float()}


def cpu_name() -> str:
    with open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown CPU")


# --- the bench ---------------------------------------------------------------------------------

def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--manifest", nargs="+", metavar="[NAME=]PATH", help="utterance manifests to build long files "
                   "from (default: the digits dev set, and the Asterisk prompts where installed)")
    p.add_argument("--conditions", nargs="+", choices=make_long_audio.CONDITIONS, default=make_long_audio.CONDITIONS)
    p.add_argument("--detectors", nargs="+", choices=list(DETECTORS), help="default: all (silero where installed)")
    p.add_argument("--seconds", type=float, default=90.0, help="length of each long file (room-tone's adds 45 s)")
    p.add_argument("--files", type=int, default=4, help="long files per manifest and condition")
    p.add_argument("--transient", action="store_true", help="a 30 ms knock in a pause of every file")
    p.add_argument("--talker-db", type=float, default=24.0, help="talkers: how much quieter the far talker is "
                   "(dB, default 24)")
    p.add_argument("--no-streams", action="store_true", help="skip the audio without speech")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="CPU threads; 1 avoids thrashing a shared machine")
    p.add_argument("--work-dir", help="where the long files go (default: a temporary folder, removed)")
    args = p.parse_args(argv)
    detectors = args.detectors or [d for d in DETECTORS if not d.startswith("silero") or silero_installed()]
    if any(d.startswith("silero") for d in detectors) and not silero_installed():
        p.error("--detectors silero: pip install silero-vad")
    torch.set_num_threads(args.threads)
    if any(d.startswith("silero") for d in detectors):
        speech_detector("silero", STREAM_RATE)  # loaded once before any timing

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work_dir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        sets = [tuple(m.split("=", 1)) if "=" in m else (Path(m).stem, m) for m in args.manifest or []]
        sets = sets or default_manifests(work)
        result = {"cpu": cpu_name(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                  "threads": args.threads, "seconds": args.seconds, "files": args.files, "seed": args.seed,
                  "transient": args.transient, "talker_db": args.talker_db, "detectors": detectors, "sets": {}, "streams": {}}
        rows, quiet_rows = [], []
        for name, manifest in sets:
            found = result["sets"][name] = {"manifest": manifest}
            for condition in args.conditions:
                files = long_files(manifest, condition, work / name / condition, args)
                found[condition] = {"audio_s": round(sum(w.numel() / r for w, r, _ in files), 1)}
                for detector in detectors:
                    stat = found[condition][detector] = measure(DETECTORS[detector], files)
                    rows.append([name, condition, detector, stat["speech_kept_pct"], stat["pause_called_pct"],
                                 stat["cpu_s"]])
                    log(f"{name} {condition} {detector}: {stat}")
        for stream, wav in ({} if args.no_streams else no_speech_streams(args)).items():
            for detector in detectors:
                t0 = time.process_time()
                called = round(100 * float(DETECTORS[detector](wav, STREAM_RATE).float().mean()), 2)
                stat = {"called_pct": called, "cpu_s": round(time.process_time() - t0, 3)}
                result["streams"].setdefault(stream, {})[detector] = stat
                quiet_rows.append([stream, detector, called, stat["cpu_s"]])
    print_table([("set", "<16"), ("condition", "<10"), ("detector", "<11"), ("speech kept %", ">14.1f"),
                 ("pause called %", ">15.1f"), ("cpu s", ">7.3f")], rows)
    if quiet_rows:
        print()
        print_table([("no speech at all", "<27"), ("detector", "<11"), ("called speech %", ">16.1f"),
                     ("cpu s", ">7.3f")], quiet_rows)
    print(f"{result['cpu']} ({result['cpu_capability']}), {args.threads} thread(s)")
    print_json(result)


if __name__ == "__main__":
    main()
