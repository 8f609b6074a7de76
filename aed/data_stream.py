"""What every streamed reader shares (aed/data_shards.py, aed/data_tarred.py, aed/data_parquet.py;
`sampler.py` describes the streamed-source protocol they follow):

- `shard_order`: the shards a rank reads in a pass, disjoint across ranks, reshuffled every pass.
- `MixedSource`: several sources mixed by weight, endlessly, resumable to the example.
- `decode_audio` / `ShardDataset`: an example's encoded audio bytes -> the item training pads,
  decoded in DataLoader workers.

Examples are dicts: the checked fields of `aed.data_manifest.example_fields`, `audio` (the encoded
bytes of the file that holds the utterance), `offset` (seconds into that audio where it starts)
and `where` (a stable id naming the shard and member or row, for messages and `inspect_data`).
Compressed audio is small, so the sampler's buffer holds it (as Lhotse Shar does).

    source = MixedSource([ShardSource("shards/en"), ShardSource("shards/de")], weights=[2, 1])
    sampler = BucketingSampler(source, bins, batch_sizes=sizes, infinite=True)
    loader = DataLoader(ShardDataset(tokenizer, LogMel(cfg)), batch_sampler=sampler, collate_fn=Collate(pad))
"""

import io
import random
import zlib
from bisect import bisect_right
from itertools import accumulate

import numpy as np
import soundfile as sf
import torch
import torchaudio.functional as AF
from torch.utils.data import Dataset

from aed.data_audio import AudioError
from aed.data_manifest import Utterance, make_item



def shard_order(num_shards: int, seed: int, rank: int, world_size: int, shuffle: bool, what: str) -> list:
    """Shard indices this rank reads in the pass seeded by `seed`: every rank shuffles with the
    same seed and takes every world_size-th, so ranks read disjoint shards and all of them."""
    if num_shards < world_size:
        raise ValueError(f"{what}: {num_shards} shards cannot feed {world_size} readers: use fewer ranks "
                         "or write the data in more shards")
    order = list(range(num_shards))
    if shuffle:
        random.Random(seed).shuffle(order)
    return order[rank::world_size]


class MixedSource:
    """Several sources mixed by weight: each example comes from source i with probability
    weights[i] / sum(weights) (weights count examples, not hours). Every source is cycled in
    its own reshuffled passes, so the mix is endless: use the sampler with infinite=True.

    Keys are (source index, *source key); the cursor is (examples drawn, per source (pass, cursor)),
    and the draws are a fixed function of (seed, rank, draw number), so a resume continues exactly.
    """

    BLOCK = 4096  # draws generated at a time

    def __init__(self, sources: list, weights: list):
        if len(sources) != len(weights) or not sources:
            raise ValueError(f"MixedSource: {len(sources)} sources but {len(weights)} weights")
        if any(not w > 0 for w in weights):
            raise ValueError(f"MixedSource: weights must be positive, got {weights}")
        self.sources = sources
        total = float(sum(weights))
        self.cum_weights = list(accumulate(w / total for w in weights))

    def read(self, seed: int, rank: int, world_size: int, cursor=None):
        n, subs = cursor or (0, [(0, None)] * len(self.sources))
        subs = [tuple(s) for s in subs]
        streams = [self._cycle(i, seed, rank, world_size, *subs[i]) for i in range(len(self.sources))]
        draws = None
        while True:
            if draws is None or n % self.BLOCK == 0:
                draws = np.random.default_rng([seed, rank, n // self.BLOCK]).random(self.BLOCK).tolist()
            i = min(bisect_right(self.cum_weights, draws[n % self.BLOCK]), len(self.sources) - 1)
            key, sub, ex = next(streams[i])
            subs[i] = sub
            n += 1
            yield (i, *key), (n, list(subs)), ex

    def _cycle(self, i: int, seed: int, rank: int, world_size: int, pass_idx: int, cursor):
        while True:
            got = 0
            pass_seed = random.Random(f"{seed}/{i}/{pass_idx}").getrandbits(64)
            for key, cur, ex in self.sources[i].read(pass_seed, rank, world_size, cursor):
                got += 1
                yield key, (pass_idx, cur), ex
            if got == 0 and cursor is None:
                raise ValueError(f"MixedSource: source {i} gave rank {rank} no example in a whole pass")
            pass_idx, cursor = pass_idx + 1, None

    def get(self, key) -> dict:
        return self.sources[key[0]].get(tuple(key[1:]))

    def describe(self, key) -> str:
        return self.sources[key[0]].describe(tuple(key[1:]))


def decode_audio(example: dict, sample_rate: int = 16000) -> torch.Tensor:
    """An example's audio bytes -> mono float32 (S,) at `sample_rate`: `duration` seconds from
    `offset` (default 0; a NeMo member shared by the segments of one file), the same samples
    `aed.data_audio.load_audio` gives for the original file (it needs a path)."""
    where = example.get("where", "example")
    try:
        with sf.SoundFile(io.BytesIO(example["audio"])) as f:
            start = round(example.get("offset", 0.0) * f.samplerate)
            if start >= f.frames > 0:
                raise AudioError(where, f"offset {example['offset']}s is beyond the end "
                                        f"({f.frames / f.samplerate:.3f}s)")
            if start:
                f.seek(start)
            data = f.read(round(example["duration"] * f.samplerate), dtype="float32", always_2d=True)
            file_rate = f.samplerate
    except AudioError:
        raise
    except (RuntimeError, ValueError, TypeError) as e:  # sf.LibsndfileError is a RuntimeError; TypeError: no bytes
        raise AudioError(where, f"cannot decode ({e})") from e
    if data.shape[0] == 0:
        raise AudioError(where, "no samples")
    wav = torch.from_numpy(data).mean(dim=1)  # average channels: (S, channels) -> (S,)
    if file_rate != sample_rate:
        wav = AF.resample(wav, file_rate, sample_rate)
    return wav


class ShardDataset(Dataset):
    """Decodes the example dicts of a streamed batch in DataLoader workers: use it with
    `DataLoader(..., batch_sampler=BucketingSampler(source, ...))`, which hands each example dict
    to `__getitem__`. Items are `aed.data_manifest.make_item`'s, as the per-file dataset's, so
    `aed.data_manifest.Collate` pads them; a bad audio comes back as {"error": ...}. Dither is seeded by
    (seed, example location), as the per-file dataset does by index.
    """

    def __init__(self, tokenizer, logmel, seed: int = 0):
        self.tokenizer, self.logmel, self.seed = tokenizer, logmel, seed

    def __getitem__(self, ex: dict) -> dict:
        where = ex["where"]
        try:
            wav = decode_audio(ex, self.logmel.cfg.sample_rate)
        except AudioError as e:
            return {"error": str(e), "audio_filepath": where}
        index = zlib.crc32(where.encode())  # stable across processes, unlike hash()
        return make_item(wav, as_utterance(ex), index, self.tokenizer, self.logmel, self.seed)


def as_utterance(ex: dict) -> Utterance:
    """A streamed example as the Utterance that tokenizing and `make_item` read. Its location
    (`where`) names it in batches and messages: its original file may not exist where training
    runs. Fields were validated by the reader (or when the shard was made)."""
    where = ex["where"]
    return Utterance(where, ex["duration"], ex["text"], ex["source_lang"], ex["target_lang"], ex["pnc"],
                     ex["taskname"], ex.get("offset", 0.0), where=where)
