import math
import shutil
import subprocess

import numpy as np
import pytest
import soundfile as sf
import torch

from aed.data_audio import (AudioError, FeatureConfig, LogMel, SpecAugment, SpecAugmentConfig, audio_seconds, load_audio,
                            num_frames)


def pcm16(n, seed=0):
    """Random int16 samples and the float32 values soundfile reads them back as."""
    ints = np.random.default_rng(seed).integers(-20000, 20000, size=n, dtype=np.int16)
    return ints, ints.astype(np.float32) / 32768


def tone(freq, sr, seconds):
    return (0.5 * np.sin(2 * np.pi * freq * np.arange(int(sr * seconds)) / sr)).astype(np.float32)


# --- loading ---------------------------------------------------------------------------------


@pytest.mark.parametrize("ext", ["wav", "flac"])
def test_load_wav_and_flac(tmp_path, ext):
    ints, expected = pcm16(8000)
    path = tmp_path / f"a.{ext}"
    sf.write(path, ints, 16000, subtype="PCM_16")
    wav = load_audio(path)
    assert wav.dtype == torch.float32 and wav.shape == (8000,)
    assert torch.equal(wav, torch.from_numpy(expected))


def test_offset_and_duration_read_the_right_samples(tmp_path):
    ints, expected = pcm16(16000)
    path = tmp_path / "a.flac"
    sf.write(path, ints, 16000, subtype="PCM_16")
    assert torch.equal(load_audio(path, offset=0.5, duration=0.25), torch.from_numpy(expected[8000:12000]))
    assert torch.equal(load_audio(path, offset=0.75), torch.from_numpy(expected[12000:]))
    # A duration past the end returns what is there.
    assert torch.equal(load_audio(path, offset=0.9, duration=1.0), torch.from_numpy(expected[14400:]))


@pytest.mark.parametrize("sr", [8000, 22050, 44100])
def test_resampling_keeps_length_and_tone(tmp_path, sr):
    path = tmp_path / "a.wav"
    sf.write(path, tone(1234, sr, 1.0), sr, subtype="FLOAT")
    wav = load_audio(path)
    assert wav.shape == (math.ceil(sr * 16000 / sr),) == (16000,)
    peak_hz = torch.fft.rfft(wav).abs().argmax().item()  # 1 s of audio: bin k is k Hz
    assert abs(peak_hz - 1234) <= 1, peak_hz


def test_resampled_segment_length(tmp_path):
    path = tmp_path / "a.wav"
    sf.write(path, tone(440, 44100, 1.0), 44100, subtype="FLOAT")
    wav = load_audio(path, offset=0.1, duration=0.3)
    assert wav.shape == (math.ceil(round(0.3 * 44100) * 16000 / 44100),)


def test_stereo_is_averaged(tmp_path):
    rng = np.random.default_rng(0)
    stereo = rng.uniform(-0.5, 0.5, size=(4000, 2)).astype(np.float32)
    path = tmp_path / "s.wav"
    sf.write(path, stereo, 16000, subtype="FLOAT")
    wav = load_audio(path)
    assert torch.allclose(wav, torch.from_numpy(stereo.mean(axis=1)), atol=1e-7)


def test_bad_files_raise_audio_error_naming_the_path(tmp_path):
    missing = tmp_path / "missing.wav"
    with pytest.raises(AudioError, match="missing.wav.*not found"):
        load_audio(missing)

    corrupt = tmp_path / "corrupt.wav"
    corrupt.write_bytes(b"RIFF\x00\x01garbage" + bytes(range(256)))
    with pytest.raises(AudioError, match="corrupt.wav") as e:
        load_audio(corrupt)
    assert e.value.path == str(corrupt)

    empty = tmp_path / "empty.wav"
    sf.write(empty, np.zeros(0, dtype=np.float32), 16000)
    with pytest.raises(AudioError, match="empty.wav.*no samples"):
        load_audio(empty)

    short = tmp_path / "short.wav"
    sf.write(short, np.zeros(1600, dtype=np.float32), 16000)
    with pytest.raises(AudioError, match="short.wav.*beyond the end"):
        load_audio(short, offset=0.2)


# --- log-mel features ------------------------------------------------------------------------


def slaney_mel_fb(sr, n_fft, n_mels):
    """Reference Slaney-scale, Slaney-area-normalised filterbank (librosa's default), (n_mels, n_fft//2+1)."""
    f_sp, min_log_hz = 200 / 3, 1000.0
    min_log_mel, logstep = min_log_hz / f_sp, math.log(6.4) / 27

    def hz_to_mel(f):
        return f / f_sp if f < min_log_hz else min_log_mel + math.log(f / min_log_hz) / logstep

    def mel_to_hz(m):
        return m * f_sp if m < min_log_mel else min_log_hz * math.exp(logstep * (m - min_log_mel))

    edges = [mel_to_hz(m) for m in np.linspace(hz_to_mel(0.0), hz_to_mel(sr / 2), n_mels + 2)]
    freqs = np.linspace(0, sr / 2, n_fft // 2 + 1)
    fb = np.zeros((n_mels, len(freqs)))
    for m in range(n_mels):
        lo, mid, hi = edges[m], edges[m + 1], edges[m + 2]
        rising, falling = (freqs - lo) / (mid - lo), (hi - freqs) / (hi - mid)
        fb[m] = np.maximum(0, np.minimum(rising, falling)) * 2 / (hi - lo)
    return fb


def reference_logmel(x, cfg):
    """Direct float64 numpy version of the whole pipeline for one utterance (no dither), (T, F)."""
    x = np.asarray(x, dtype=np.float64)
    y = np.concatenate([x[:1], x[1:] - cfg.preemph * x[:-1]])
    y = np.pad(y, cfg.n_fft // 2)  # centred frames, zero padded at both ends
    window = np.zeros(cfg.n_fft)
    left = (cfg.n_fft - cfg.win_length) // 2
    window[left : left + cfg.win_length] = np.hanning(cfg.win_length)  # np.hanning is symmetric
    T = len(x) // cfg.hop_length
    frames = np.stack([y[t * cfg.hop_length : t * cfg.hop_length + cfg.n_fft] * window for t in range(T)])
    power = np.abs(np.fft.rfft(frames, axis=1)) ** 2
    logmel = np.log(power @ slaney_mel_fb(cfg.sample_rate, cfg.n_fft, cfg.n_mels).T + cfg.log_guard)
    return (logmel - logmel.mean(0)) / (logmel.std(0, ddof=1) + 1e-5)


def speechlike(n, seed):
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(n) / 16000
    voiced = 0.3 * torch.sin(2 * math.pi * 300 * t) * torch.sin(2 * math.pi * 3 * t)  # a 300 Hz tone, 3 Hz envelope
    return voiced + 0.05 * torch.randn(n, generator=g)


def padded_batch(waves):
    lens = torch.tensor([len(w) for w in waves])
    batch = torch.zeros(len(waves), int(lens.max()))
    for i, w in enumerate(waves):
        batch[i, : len(w)] = w
    return batch, lens


RATE_16K = 16000


@pytest.mark.skipif(shutil.which("ffmpeg") is None, reason="needs the ffmpeg command (apt-get install ffmpeg)")
@pytest.mark.parametrize("ext,codec", [(".m4a", "aac"), (".webm", "libopus")])
def test_containers_soundfile_cannot_read_are_decoded_by_ffmpeg(tmp_path, ext, codec):
    """A stereo 44.1 kHz tone in a phone's m4a/AAC and a webm/Opus: length, rate and tone as from the
    FLAC it was encoded from (lossy codecs: the waveforms agree to a correlation, not sample by sample)."""
    t = np.arange(44100 * 2) / 44100
    tone = 0.3 * np.sin(2 * np.pi * 440 * t)
    sf.write(tmp_path / "a.flac", np.stack([tone, tone], axis=1), 44100)
    subprocess.run(["ffmpeg", "-v", "error", "-i", str(tmp_path / "a.flac"), "-c:a", codec, str(tmp_path / f"a{ext}")],
                   check=True)
    ref, wav = load_audio(tmp_path / "a.flac"), load_audio(tmp_path / f"a{ext}")
    assert audio_seconds(str(tmp_path / f"a{ext}")) == pytest.approx(2.0, abs=0.05)
    assert abs(wav.numel() - ref.numel()) <= 0.03 * RATE_16K
    n = min(wav.numel(), ref.numel()) - 4000
    lag = max(range(-1600, 1600, 8), key=lambda k: float((ref[2000: 2000 + n - 1600] * wav[2000 + k: 2000 + k + n - 1600]).sum()))
    a, b = ref[2000: 2000 + n - 1600], wav[2000 + lag: 2000 + lag + n - 1600]
    assert float(torch.corrcoef(torch.stack([a, b]))[0, 1]) > 0.95
    part = load_audio(tmp_path / f"a{ext}", offset=0.5, duration=1.0)
    assert abs(part.numel() - RATE_16K) <= 0.03 * RATE_16K


@pytest.mark.skipif(shutil.which("ffmpeg") is None, reason="needs the ffmpeg command (apt-get install ffmpeg)")
def test_a_file_inference_reads_passes_trainings_audio_check(tmp_path):
    """An m4a that load_audio decodes through ffmpeg: its header duration is read the same way by
    training's start-of-run check, which keeps it (a wrong duration is still found)."""
    from aed.data_manifest import Utterance, check_audio, header_seconds
    sf.write(tmp_path / "a.flac", 0.3 * np.sin(2 * np.pi * 440 * np.arange(32000) / 16000), 16000)
    subprocess.run(["ffmpeg", "-v", "error", "-i", str(tmp_path / "a.flac"), "-c:a", "aac", str(tmp_path / "a.m4a")],
                   check=True)
    path = str(tmp_path / "a.m4a")
    assert header_seconds(path) == audio_seconds(path) == pytest.approx(2.0, abs=0.05)
    utt = Utterance(path, 2.0, "a tone", "en", "en", True, "asr")
    assert check_audio([utt], tolerance=0.05) == []
    assert "lasts" in check_audio([Utterance(path, 3.0, "a tone", "en", "en", True, "asr")], tolerance=0.05)[0][1]


@pytest.mark.skipif(shutil.which("ffmpeg") is None, reason="needs the ffmpeg command (apt-get install ffmpeg)")
def test_an_m4a_member_of_a_shard_decodes_as_the_file_does(tmp_path):
    """Training reads streamed members (tar shards, parquet cells) as bytes, through the same reader
    as files: an m4a member decodes to the file's samples, whole and as a segment."""
    from aed.data_batch import decode_audio

    sf.write(tmp_path / "a.flac", 0.3 * np.sin(2 * np.pi * 440 * np.arange(32000) / 16000), 16000)
    subprocess.run(["ffmpeg", "-v", "error", "-i", str(tmp_path / "a.flac"), "-c:a", "aac", str(tmp_path / "a.m4a")],
                   check=True)
    member = (tmp_path / "a.m4a").read_bytes()
    whole = load_audio(tmp_path / "a.m4a")
    seconds = whole.numel() / RATE_16K
    assert torch.equal(decode_audio({"audio": member, "duration": seconds, "where": "shard-0.tar:a"}), whole)
    part = decode_audio({"audio": member, "duration": 0.5, "offset": 1.0, "where": "shard-0.tar:a"})
    assert torch.equal(part, load_audio(tmp_path / "a.m4a", offset=1.0, duration=0.5))


def test_without_ffmpeg_a_member_soundfile_cannot_read_names_ffmpeg_and_the_member(monkeypatch):
    from aed.data_batch import decode_audio

    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(AudioError, match=r"shard-3.tar:utt7: cannot decode .*ffmpeg"):
        decode_audio({"audio": b"\x00\x00\x00\x20ftypM4A " + bytes(200), "duration": 1.0, "where": "shard-3.tar:utt7"})
    with pytest.raises(AudioError, match="shard-3.tar:utt8: no audio"):
        decode_audio({"duration": 1.0, "where": "shard-3.tar:utt8"})


def test_without_ffmpeg_a_container_soundfile_cannot_read_names_ffmpeg(tmp_path, monkeypatch):
    (tmp_path / "a.m4a").write_bytes(b"\x00\x00\x00\x20ftypM4A " + bytes(200))
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(AudioError, match="ffmpeg"):
        load_audio(tmp_path / "a.m4a")
    from aed.data_manifest import header_seconds
    assert "ffmpeg" in header_seconds(str(tmp_path / "a.m4a"))  # training's check says what is missing


@pytest.mark.parametrize("n_mels", [128, 80])
def test_mel_filterbank_is_slaney(n_mels):
    cfg = FeatureConfig(n_mels=n_mels)
    fb = LogMel(cfg).mel_fb
    ref = slaney_mel_fb(cfg.sample_rate, cfg.n_fft, n_mels)
    assert fb.shape == ref.shape
    assert np.allclose(fb.numpy(), ref, rtol=1e-4, atol=1e-7)


def test_matches_numpy_reference():
    cfg = FeatureConfig(n_mels=80)
    x = speechlike(8123, seed=1)
    feats, lens = LogMel(cfg).eval()(x[None], torch.tensor([len(x)]))
    ref = reference_logmel(x.numpy(), cfg)
    assert lens.tolist() == [len(ref)] == [8123 // 160]
    assert np.allclose(feats[0].numpy(), ref, atol=1e-3), np.abs(feats[0].numpy() - ref).max()


def test_num_frames():
    assert num_frames(16000) == 100 and num_frames(159) == 0 and num_frames(12345) == 77
    assert num_frames(torch.tensor([16000, 12345])).tolist() == [100, 77]


def test_shapes_lengths_and_zero_padding():
    wav, lens = padded_batch([speechlike(n, seed=i) for i, n in enumerate([16000, 12345, 800])])
    feats, feat_lens = LogMel().eval()(wav, lens)
    assert feat_lens.tolist() == [100, 77, 5]
    assert feats.shape == (3, 100, 128) and feats.dtype == torch.float32
    assert torch.all(feats[1, 77:] == 0) and torch.all(feats[2, 5:] == 0)
    assert torch.all(feats[2, :5].abs().sum(-1) > 0)


def test_normalisation_uses_valid_frames_only():
    wav, lens = padded_batch([speechlike(9600, seed=0), speechlike(4000, seed=1)])
    logmel = LogMel(FeatureConfig(n_mels=80)).eval()
    feats, feat_lens = logmel(wav, lens)
    for i, n in enumerate(feat_lens.tolist()):
        valid = feats[i, :n].double()
        assert torch.allclose(valid.mean(0), torch.zeros(80, dtype=torch.float64), atol=1e-4)
        assert torch.allclose(valid.std(0), torch.ones(80, dtype=torch.float64), atol=1e-3)
    # Extra padding columns in the waveform change nothing.
    wider = torch.cat([wav, torch.zeros(2, 3000)], dim=1)
    feats_wider, _ = logmel(wider, lens)
    assert feats_wider.shape == feats.shape and torch.equal(feats_wider, feats)


def test_alone_equals_inside_padded_batch():
    short, long = speechlike(5000, seed=3), speechlike(13000, seed=4)
    logmel = LogMel().eval()
    alone, alone_lens = logmel(short[None], torch.tensor([5000]))
    wav, lens = padded_batch([short, long])
    wav[0, 5000:] = torch.randn(8000)  # even garbage in the padding must not leak
    batched, batched_lens = logmel(wav, lens)
    n = alone_lens.item()
    assert batched_lens[0].item() == n == 31
    assert torch.allclose(batched[0, :n], alone[0], atol=1e-5), (batched[0, :n] - alone[0]).abs().max()


def test_dither_only_in_training():
    wav, lens = padded_batch([speechlike(4000, seed=5), torch.zeros(3000)])  # second is digital silence
    logmel = LogMel(FeatureConfig(n_mels=80))
    logmel.eval()
    a, _ = logmel(wav, lens)
    b, _ = logmel(wav, lens)
    assert torch.equal(a, b)
    logmel.train()
    torch.manual_seed(0)
    c, _ = logmel(wav, lens)
    d, _ = logmel(wav, lens)
    assert not torch.equal(c, d) and not torch.equal(a, c)
    assert torch.isfinite(c).all()
    assert torch.all(c[1, 18:] == 0)  # dither never reaches the padding


def test_float32_under_autocast_and_no_persistent_buffers():
    wav, lens = padded_batch([speechlike(3200, seed=6)])
    logmel = LogMel(FeatureConfig(n_mels=80)).eval()
    plain, _ = logmel(wav, lens)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        auto, _ = logmel(wav, lens)
    assert auto.dtype == torch.float32 and torch.equal(auto, plain)
    assert logmel.state_dict() == {}  # window and filterbank are rebuilt, not checkpointed


# --- SpecAugment -----------------------------------------------------------------------------


def random_feats(lens, F=80, seed=0, pad_value=0.0):
    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor(lens)
    feats = torch.randn(len(lens), int(lens.max()), F, generator=g)
    feats[torch.arange(feats.shape[1]) >= lens[:, None]] = pad_value
    return feats, lens


def test_specaugment_masks_inside_valid_frames_only():
    feats, lens = random_feats([200, 120, 37], pad_value=-3.0)  # a pad value masks cannot produce
    aug = SpecAugment(generator=torch.Generator().manual_seed(0)).train()
    out = aug(feats, lens)
    changed = out != feats
    assert changed.any(), "training mode must mask something"
    assert torch.all(out[changed] == 0)
    for i, n in enumerate(lens.tolist()):
        assert changed[i, :n].any()
        assert torch.all(out[i, n:] == -3.0)


def test_specaugment_widths():
    feats, lens = random_feats([400, 100, 3000], seed=1)
    g = torch.Generator().manual_seed(1)
    for _ in range(20):
        time_only = SpecAugment(SpecAugmentConfig(freq_masks=0, time_masks=1), generator=g).train()(feats, lens)
        for i, n in enumerate(lens.tolist()):
            masked_frames = (time_only[i, :n] == 0).all(-1).sum()
            assert masked_frames <= int(n * 0.05), (n, masked_frames)
        freq_only = SpecAugment(SpecAugmentConfig(freq_masks=1, time_masks=0), generator=g).train()(feats, lens)
        for i, n in enumerate(lens.tolist()):
            masked_bins = (freq_only[i, :n] == 0).all(0)  # (F,) a freq mask spans every valid frame
            assert masked_bins.sum() <= 27
            assert torch.equal((freq_only[i, :n] == 0).any(0), masked_bins)


def test_specaugment_reproducible_and_identity_in_eval():
    feats, lens = random_feats([150, 90])
    first = SpecAugment(generator=torch.Generator().manual_seed(7)).train()(feats, lens)
    second = SpecAugment(generator=torch.Generator().manual_seed(7)).train()(feats, lens)
    assert torch.equal(first, second)
    assert torch.equal(SpecAugment().eval()(feats, lens), feats)


def test_freq_warp_stretches_each_utterance_mel_axis_and_leaves_padding():
    F = 80
    lens = torch.tensor([50, 30])
    feats = torch.arange(F, dtype=torch.float32).repeat(2, 50, 1)  # (B, T, F): every frame reads its bin index
    feats[1, 30:] = -torch.arange(F, dtype=torch.float32)  # padding that a warp would move
    cfg = SpecAugmentConfig(freq_masks=0, time_masks=0, freq_warp=0.1)
    out = SpecAugment(cfg, generator=torch.Generator().manual_seed(0)).train()(feats, lens)
    assert out.shape == feats.shape
    assert torch.equal(out[1, 30:], feats[1, 30:])
    for b in range(2):
        row = out[b, 0]
        assert torch.equal(out[b, : lens[b]], row.expand(int(lens[b]), F))  # one warp per utterance
        factor = 1 / row[1].item()  # bin 1 reads bin 1 / factor
        assert 0.9 <= factor <= 1.1 and abs(factor - 1) > 1e-4
        expected = (torch.arange(F) / factor).clamp(max=F - 1)
        assert torch.allclose(row, expected, atol=1e-4)
    assert not torch.equal(out[0, 0], out[1, 0])
    assert torch.equal(SpecAugment(cfg).eval()(feats, lens), feats)
