"""Temperature-balanced mixing of sources and languages, and non-speech examples (aed/data_mixing.py):
the weights follow the formula, the realised proportions converge to them, non-speech targets are
prompt + EOS with a finite loss (CTC included), rates are honoured and a resumed run replays the
same examples. Manifests here name audio that is never read (check_audio off, no DataLoader)."""

import json
import logging
import math
import os

import numpy as np
import pytest
import torch

from aed.config import ConfigError
from aed.data_manifest import ManifestError
from aed.data_mixing import group_of, stream_size, stream_weights, temperature_shares
from aed.data_sources import ManifestEntry
from aed.data_tokenizer import Tokenizer
from aed.train_config import TrainSection, load_train_config
from aed.train_data import build_training_data, load_examples

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER = os.path.join(ROOT, "data", "mini", "tokenizer")


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.load(TOKENIZER)


def write(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def speech(n: int, lang: str, duration: float, target: str | None = None, name: str = "s") -> list:
    return [{"audio_filepath": f"{name}_{lang}_{i}.flac", "duration": duration, "text": "ja nein",
             "source_lang": lang, "target_lang": target or lang} for i in range(n)]


def section(manifests, **kw) -> TrainSection:
    return TrainSection(manifests=manifests, check_audio=False, **kw)


def entries(specs) -> list:
    """train.manifests entries as the config writes them -> ManifestEntry (checked, as training checks them)."""
    return [ManifestEntry.of(s) for s in specs]


def shares_by_group(utts, specs, weighted: bool = True) -> dict:
    """Each group's share of the audio of a pass: durations times the utterances' weights (expected
    copies per pass), or of the utterances as they come (weighted=False: a realised pass)."""
    by_path = {e.path: e for e in entries(specs)}
    hours = {}
    for u in utts:
        g = group_of(by_path[u.where.rsplit(":", 1)[0]], u)
        hours[g] = hours.get(g, 0.0) + u.duration * (u.weight if weighted else 1.0)
    return {g: h / sum(hours.values()) for g, h in hours.items()}


def pass_examples(data, passes: int) -> list[list]:
    """The example indices of the sampler's first `passes` passes (rank 0 of 1), each in its order."""
    return [data.sampler.data.order(0, k, None, 0, 1).tolist() for k in range(passes)]


# --- the formula ----------------------------------------------------------------------------------


def test_temperature_shares_follow_the_formula():
    hours = {"a": 900.0, "b": 90.0, "c": 10.0}
    assert temperature_shares(hours, 1.0) == pytest.approx({"a": 0.9, "b": 0.09, "c": 0.01})  # natural
    assert temperature_shares(hours, math.inf) == pytest.approx({g: 1 / 3 for g in hours})  # uniform
    assert temperature_shares(hours, 1e6) == pytest.approx({g: 1 / 3 for g in hours}, abs=1e-4)
    # By hand, T=2: sqrt(900)=30, sqrt(90)=9.4868, sqrt(10)=3.1623 over 42.6491.
    assert temperature_shares(hours, 2.0) == pytest.approx({"a": 0.70342, "b": 0.22244, "c": 0.07415}, abs=1e-5)
    with pytest.raises(ValueError):
        temperature_shares(hours, 0.0)


def test_in_memory_epoch_gives_each_source_and_language_its_share(tmp_path, tokenizer, caplog):
    """Two manifests, the first holding two languages: three (dataset, language) groups."""
    a = write(tmp_path / "a.jsonl", speech(60, "en", 2.0) + speech(15, "de", 2.0))
    b = write(tmp_path / "b.jsonl", speech(20, "fr", 1.0))
    specs = [{"path": a, "dataset": "big"}, {"path": b}]
    hours = {("big", "en"): 120.0, ("big", "de"): 30.0, (b, "fr"): 20.0}
    for temperature in (1.0, 2.0, math.inf):
        with caplog.at_level(logging.INFO, logger="aed.data_mixing"):
            utts, num_tokens = load_examples(entries(specs), section(specs, mix_temperature=temperature), tokenizer,
                                             0, 0, 1)
        target = temperature_shares(hours, temperature)
        assert shares_by_group(utts, specs) == pytest.approx(target, abs=1e-9), temperature
        assert len(utts) == 95 and len(num_tokens) == len(utts)  # every utterance once, weighted
        # a pass keeps the hours: sum of duration x expected copies
        assert sum(u.duration * u.weight for u in utts) == pytest.approx(sum(hours.values()))
        assert "big [de]" in caplog.text and "natural" in caplog.text and "target" in caplog.text
        caplog.clear()


# --- streamed sources: weights that count examples, proportions over a long draw --------------------


class FakeSource:
    """A streamed source of `n` examples of `duration` seconds each."""

    def __init__(self, name, n, duration):
        self.name, self.n, self.duration = name, n, duration

    def read(self, seed, rank, world_size, cursor=None):
        for i in range(cursor or 0, self.n):
            yield (i,), i + 1, self.get((i,))

    def get(self, key):
        return {"where": f"{self.name}#{key[0]}", "duration": self.duration}

    def describe(self, key):
        return f"{self.name}#{key[0]}"


def test_streamed_weights_converge_to_the_target_shares_within_the_binomial_error():
    from aed.data_mixing import MixedSource, Tagged

    specs = [{"shar": "en", "language": "en", "hours": 100.0, "examples": 36000},  # mean 10 s
             {"shar": "de", "language": "de", "hours": 10.0, "examples": 7200},  # mean 5 s
             {"shar": "de2", "dataset": "de", "language": "de", "hours": 10.0, "examples": 18000}]  # 2 s
    sources = [FakeSource(s["shar"], s["examples"], 3600 * s["hours"] / s["examples"]) for s in specs]
    weights, shares, groups = stream_weights(entries(specs), sources, 2.0)
    assert shares == pytest.approx(temperature_shares({("en", "en"): 100.0, ("de", "de"): 20.0}, 2.0))
    # Weights count examples: weight x mean duration is each entry's share of the audio.
    audio = np.array([w * src.duration for w, src in zip(weights, sources)])
    assert audio / audio.sum() == pytest.approx([shares[("en", "en")], shares[("de", "de")] / 2,
                                                 shares[("de", "de")] / 2])

    n = 40000
    mixed = MixedSource([Tagged(s, i) for i, s in enumerate(sources)], weights)
    drawn = [ex["mix_source"] for (_, _, ex), _ in zip(mixed.read(7, 0, 1), range(n))]
    counts = np.bincount(drawn, minlength=3)
    p = np.array(weights) / sum(weights)
    stderr = np.sqrt(p * (1 - p) / n)  # of each entry's drawn fraction (a binomial count)
    assert np.all(np.abs(counts / n - p) < 4 * stderr), (counts / n, p, stderr)


def test_stream_size_is_declared_or_read_from_a_shard_index(tmp_path):
    from aed.data_shards import ShardSource

    index = tmp_path / "shards.jsonl"
    write(index, [{"path": "shard-000000.tar", "count": 10, "duration": 1800.0},
                  {"path": "shard-000001.tar", "count": 30, "duration": 5400.0}])
    assert stream_size(ManifestEntry.of({"shards": str(tmp_path)}), ShardSource(tmp_path)) == (40, 2.0)
    declared = ManifestEntry.of({"shards": str(tmp_path), "hours": 5, "examples": 9})
    assert stream_size(declared, ShardSource(tmp_path)) == (9, 5.0)
    write(index, [{"path": "shard-000000.tar", "count": 10}])
    with pytest.raises(ConfigError, match="no per-shard 'duration'.*hours: H and examples: N"):
        stream_size(ManifestEntry.of({"shards": str(tmp_path)}), ShardSource(tmp_path))


# --- non-speech examples --------------------------------------------------------------------------


def nonspeech_setup(tmp_path, rate=0.2):
    s = write(tmp_path / "speech.jsonl", speech(30, "en", 2.0) + speech(10, "en", 2.0, target="de", name="t"))
    noise = write(tmp_path / "noise.jsonl",
                  [{"audio_filepath": f"noise_{i}.flac", "duration": 3.0} for i in range(6)]
                  + [{"audio_filepath": "music.flac", "duration": 4.0, "text": "", "lang": "fr"}])
    tagged = write(tmp_path / "silence.jsonl", [{"audio_filepath": "silence.flac", "duration": 1.0}])
    return [s, {"path": noise, "nonspeech": True, "rate": rate},
            {"path": tagged, "nonspeech": True, "rate": 0.05, "language": "es"}]


def test_nonspeech_targets_are_the_prompt_then_eos_at_the_configured_rate(tmp_path, tokenizer):
    from array import array

    specs = nonspeech_setup(tmp_path)
    utts, num_tokens = load_examples(entries(specs), section(specs), tokenizer, 0, 0, 1)
    noise = [u for u in utts if u.text == ""]
    per_pass = sum(u.weight for u in utts)
    for u, n in zip(utts, num_tokens):
        if u.text:
            continue
        ids = array("i", u.token_ids).tolist()
        task = "transcribe" if u.taskname == "asr" else "translate"
        assert ids == tokenizer.prompt_ids(u.source_lang, u.target_lang, u.pnc, task) + [tokenizer.eos]
        assert u.prompt_len == len(ids) - 1 == n - 1
    # Rates are fractions of a pass's examples (weights are expected copies per pass): 0.2 + 0.05 of them.
    from_noise = [u for u in noise if "noise" in u.where]
    assert sum(u.weight for u in from_noise) / per_pass == pytest.approx(0.2)
    assert sum(u.weight for u in noise) / per_pass == pytest.approx(0.25)
    # A line's own language wins, then the entry's tag; unmarked lines borrow speech prompts, both tasks.
    assert {(u.source_lang, u.taskname) for u in noise if "music" in u.audio_filepath} == {("fr", "asr")}
    assert {(u.source_lang, u.taskname) for u in noise if "silence" in u.where} == {("es", "asr")}
    borrowed = {(u.source_lang, u.target_lang) for u in noise if "noise_" in u.audio_filepath}
    assert borrowed == {("en", "en"), ("en", "de")}


def test_nonspeech_batch_has_a_finite_loss_with_ctc(tokenizer):
    from aed.model import AED, AEDConfig

    torch.manual_seed(0)
    cfg = AEDConfig(n_mels=16, vocab_size=tokenizer.padded_vocab_size, pad_id=tokenizer.pad, enc_d_model=32,
                    enc_layers=1, enc_heads=2, subsampling_channels=8, dec_d_model=32, dec_layers=1, dec_heads=2,
                    ctc_loss_weight=0.5, dec_max_len=64)
    model = AED(cfg)
    speech_ids, speech_prompt = tokenizer.encode_example("ja nein", "de", "de", True, "transcribe")
    rows = [tokenizer.encode_example("", "de", "de", True, "transcribe"),  # non-speech, CTC target empty
            tokenizer.encode_example("", "en", "de", True, "translate"),  # non-speech translation prompt
            (speech_ids, speech_prompt)]
    for batch_rows in (rows, rows[:2]):  # mixed, and non-speech alone (every CTC target empty)
        b = len(batch_rows)
        lens = torch.tensor([len(ids) for ids, _ in batch_rows])
        tokens = torch.full((b, int(lens.max())), tokenizer.pad)
        for i, (ids, _) in enumerate(batch_rows):
            tokens[i, : len(ids)] = torch.tensor(ids)
        prompt_lens = torch.tensor([p for _, p in batch_rows])
        transcribed = torch.tensor([True, False, True][:b])
        feats, feat_lens = torch.randn(b, 96, 16), torch.full((b,), 96)
        loss, n = model(feats, feat_lens, tokens, lens, prompt_lens, transcribed)
        loss.backward()
        assert torch.isfinite(loss) and int(n) == int((lens - 1).sum())
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        model.zero_grad()


# --- resume and the realised-mix log --------------------------------------------------------------


def mixed_setup(tmp_path, rate=0.1):
    specs = nonspeech_setup(tmp_path, rate=rate)
    specs[0] = {"path": specs[0], "dataset": "speech"}
    cfg = load_train_config(None, [f"run_dir={tmp_path}", "train.mix_temperature=2", "train.check_audio=false",
                                   "train.num_buckets=2", "train.sub_buckets=1", "train.max_duration=20",
                                   "train.buffer_size=64", "model.dec_max_len=64"])
    cfg.train.manifests = specs
    return cfg


def test_resume_replays_the_same_mixed_examples_and_the_mix_is_logged(tmp_path, tokenizer, caplog):
    cfg = mixed_setup(tmp_path)
    with caplog.at_level(logging.INFO, logger="aed.data_mixing"):
        data = build_training_data(cfg, tokenizer, 0, 1)
        first = iter(data.counter)
        for _ in range(5):
            next(first)
        state = data.sampler.state_dict()
        rest = [[(data.dataset.utterances[i].where, draw) for i, draw in next(first)] for _ in range(40)]
    assert "realised mix #1" in caplog.text and "speech [en-de]" in caplog.text and "[nonspeech]" in caplog.text
    assert "since the start" in caplog.text

    again = build_training_data(cfg, tokenizer, 0, 1)
    assert [u.where for u in again.dataset.utterances] == [u.where for u in data.dataset.utterances]
    again.sampler.load_state_dict(state)
    resumed = iter(again.counter)
    # the same examples, each with the same draw (the batch number that seeds its augmentation)
    assert [[(again.dataset.utterances[i].where, draw) for i, draw in next(resumed)] for _ in range(40)] == rest
    assert [draw for batch in rest for _, draw in batch[:1]] == list(range(6, 46))
    # a rank sees 1/world_size of each pass, so its log line comes after that many examples
    per_pass = sum(u.weight for u in data.dataset.utterances)
    assert data.counter.mix.every == round(per_pass)
    assert build_training_data(cfg, tokenizer, 0, 2).counter.mix.every == round(per_pass / 2)


def test_a_down_weighted_group_is_drawn_anew_each_pass_and_seen_whole(tmp_path, tokenizer):
    """Non-speech at rate 0.05 of a pass holds fewer examples than the clips there are: each pass
    takes another subset (all of them over a few passes), in its expected number, and the realised
    shares since the start, which metrics.jsonl gets, converge on the targets."""
    cfg = mixed_setup(tmp_path, rate=0.05)
    data = build_training_data(cfg, tokenizer, 0, 1)
    utts = data.dataset.utterances
    noise = {i for i, u in enumerate(utts) if "noise_" in u.audio_filepath}
    expected = sum(utts[i].weight for i in noise)
    assert expected < len(noise) / 1.5  # fewer than the clips: a subset per pass
    passes = pass_examples(data, 20)
    subsets = [frozenset(i for i in p if i in noise) for p in passes]
    assert all(abs(len(s) - expected) <= 1 for s in subsets)
    assert len(set(subsets)) > 1  # drawn anew each pass ...
    assert frozenset().union(*subsets) == noise  # ... so every clip is trained on
    # Groups up-weighted by the temperature repeat their examples, to their expected count.
    counts = np.bincount(np.concatenate(passes), minlength=len(utts)) / len(passes)
    assert counts == pytest.approx([u.weight for u in utts], abs=0.5)

    loader = iter(data.counter)
    for _ in range(60):
        next(loader)
    targets = {g: t for g, t in data.counter.mix.targets.items()}
    assert data.counter.mix.shares() == pytest.approx(targets, abs=0.06)
    values = data.counter.mix.values()
    assert set(values) == {"mix/speech/en", "mix/speech/en-de"} | {k for k in values if k.endswith("/nonspeech")}
    assert sum(values.values()) == pytest.approx(1.0)


# --- errors name the file and the field -----------------------------------------------------------


@pytest.mark.parametrize("entry, field", [
    ({"weight": -1}, "weight"),
    ({"language": 3}, "language"),
    ({"dataset": ""}, "dataset"),
    ({"rate": 0.1}, "rate"),
    ({"nonspeech": True, "rate": 1.5}, "rate"),
    ({"nonspeech": True}, "rate"),
    ({"nonspeech": True, "rate": 0.1, "weight": 2}, "weight"),
    ({"nonspeech": "yes", "rate": 0.1}, "nonspeech"),
])
def test_a_bad_tagged_entry_names_its_file_and_field(tmp_path, tokenizer, entry, field):
    path = write(tmp_path / "tagged.jsonl", speech(2, "en", 1.0))
    specs = [{"path": path, **entry}]
    with pytest.raises(ConfigError, match=f"{path}: field '{field}'"):
        load_examples(entries(specs), section(specs), tokenizer, 0, 0, 1)


def test_other_bad_mixes_are_clear_errors(tmp_path, tokenizer):
    path = write(tmp_path / "a.jsonl", speech(2, "en", 1.0))
    specs = [{"path": path, "weight": 2}]
    with pytest.raises(ConfigError, match=f"{path}: field 'weight': train.mix_temperature"):
        load_examples(entries(specs), section(specs, mix_temperature=2.0), tokenizer, 0, 0, 1)
    with pytest.raises(ConfigError, match="train.mix_temperature"):
        TrainSection(mix_temperature=0)
    with pytest.raises(ConfigError, match="'hours' and 'examples'"):
        load_examples(entries([{"shar": "x", "hours": 3}]), section([]), tokenizer, 0, 0, 1)
    noise = write(tmp_path / "noise.jsonl", [{"audio_filepath": "n.flac", "duration": 1.0, "text": "words"}])
    specs = [path, {"path": noise, "nonspeech": True, "rate": 0.1}]
    with pytest.raises(ManifestError, match=f"{noise}:1: field 'text'"):
        load_examples(entries(specs), section(specs, skip_invalid=False), tokenizer, 0, 0, 1)
    with pytest.raises(ConfigError, match=f"{noise}: a non-speech manifest with no usable line"):
        load_examples(entries(specs), section(specs), tokenizer, 0, 0, 1)  # its one line skipped
    specs = [path, {"path": noise, "nonspeech": True, "rate": 0.1}]
    with pytest.raises(ConfigError, match="min_tps"):
        load_examples(entries(specs), section(specs, min_tps=1.0), tokenizer, 0, 0, 1)


def test_streamed_sources_are_mixed_by_temperature_and_logged(tmp_path, tokenizer, caplog):
    """Two shard sets of the bundled audio (German and English lines): their weights come from the
    shard indexes' hours, and the realised mix is logged every mix_log_every examples."""
    import contextlib
    import io

    from bins import Bins
    from tools import make_shards

    rows = [json.loads(line) for line in open(os.path.join(ROOT, "data", "mini", "train.jsonl"))]
    specs = []
    for lang, n in (("de", 12), ("en", 4)):
        picked = [r | {"audio_filepath": os.path.join(ROOT, "data", "mini", r["audio_filepath"])}
                  for r in rows if r["source_lang"] == lang == r["target_lang"]][:n]
        manifest = write(tmp_path / f"{lang}.jsonl", picked)
        with contextlib.redirect_stderr(io.StringIO()):
            make_shards.main([manifest, "-o", str(tmp_path / lang), "--shard-size", "4"])
        specs.append({"shards": str(tmp_path / lang), "language": lang})
    Bins([10.0, 40.0], [[64], [64]]).save(tmp_path / "bins.json")
    cfg = load_train_config(None, [f"run_dir={tmp_path}", "train.mix_temperature=.inf", "train.mix_log_every=200",
                                   f"train.bins={tmp_path / 'bins.json'}", "train.batch_size=4",
                                   "train.buffer_size=16", "model.dec_max_len=64"])
    cfg.train.manifests = specs
    with caplog.at_level(logging.INFO, logger="aed.data_mixing"):
        data = build_training_data(cfg, tokenizer, 0, 1)
        batches = iter(data.counter)
        for _ in range(100):
            next(batches)
    assert "train.mix_temperature=inf (streamed)" in caplog.text
    lines = [m for m in caplog.messages if m.startswith("realised mix")]
    assert len(lines) == 2 and all("target 50.0%)" in m for m in lines), lines
    # The realised shares of the audio: 400 examples drawn at weights that give each language half of
    # it. The English clips are longer on average, so fewer of them: the shares are of seconds.
    shares = data.counter.mix.shares()
    assert len(shares) == 2 and sum(shares.values()) == pytest.approx(1.0)
    assert all(abs(share - 0.5) < 0.08 for share in shares.values()), shares  # ~3 binomial sigmas of 400 draws


@pytest.mark.slow(seconds=20)
def test_a_mixed_run_logs_its_realised_shares_in_metrics_jsonl(tmp_path):
    """train.py with a temperature mix and non-speech: every metrics.jsonl row of the progress line
    carries each group's realised share of the audio since the start, adding up to 1."""
    from test_train import train_in_process

    rows = [json.loads(line) for line in open(os.path.join(ROOT, "data", "mini", "digits", "train.jsonl"))][:4]
    noise = write(tmp_path / "noise.jsonl", [{"audio_filepath": os.path.join(ROOT, "data", "mini", "digits",
                                                                           r["audio_filepath"]),
                                              "duration": r["duration"]} for r in rows])
    manifests = f"[data/mini/digits/train.jsonl, {{path: {noise}, nonspeech: true, rate: 0.1}}]"
    p = train_in_process(["configs/tiny.yaml", f"run_dir={tmp_path / 'run'}", f"train.manifests={manifests}",
                          "train.mix_temperature=2", "max_steps=4", "log_every=2", "ckpt_every=4", "val.every=0",
                          "train.num_workers=0", "model.enc_layers=1", "model.dec_layers=1"])
    assert p.returncode == 0, p.stderr[-3000:]
    logged = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    progress = [row for row in logged if "train/loss" in row]
    assert [row["step"] for row in progress] == [2, 4]
    for row in progress:
        mix = {k: v for k, v in row.items() if k.startswith("mix/")}
        assert any(k.endswith("/nonspeech") for k in mix) and len(mix) >= 5, mix  # 4 languages + non-speech
        assert sum(mix.values()) == pytest.approx(1.0)
