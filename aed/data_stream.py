"""What every streamed reader shares (aed/data_shards.py, aed/data_tarred.py, aed/data_parquet.py;
`sampler.py` describes the streamed-source protocol they follow):

- `shard_order`: the shards a rank reads in a pass, disjoint across ranks, reshuffled every pass;
  `resume_shards`: that order walked from a resume cursor, the one loop every reader's `read` uses.
- `MixedSource`: several sources mixed by weight, endlessly, resumable to the example.

Examples are dicts: the checked fields of `aed.data_manifest.example_fields`, `audio` (the encoded
bytes of the file that holds the utterance), `offset` (seconds into that audio where it starts)
and `where` (a stable id naming the shard and member or row, for messages and `inspect_data`).
Compressed audio is small, so the sampler's buffer holds it (as Lhotse Shar does), and DataLoader
workers decode it (`aed.data_batch.ExampleDataset`).

    source = MixedSource([ShardSource("shards/en"), ShardSource("shards/de")], weights=[2, 1])
    sampler = BucketingSampler(source, bins, batch_sizes=sizes, infinite=True)
    loader = DataLoader(ExampleDataset(None, tokenizer, LogMel(cfg)), batch_sampler=sampler, collate_fn=Collate(pad))
"""

import random
from bisect import bisect_right
from itertools import accumulate

import numpy as np

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


def resume_shards(num_shards: int, seed: int, rank: int, world_size: int, shuffle: bool, what: str,
                  cursor, start: tuple):
    """Yields (position in this rank's shard order, shard, where in it to start) for the pass seeded
    by `seed`, from a resume `cursor` on. Every reader's cursor is (position, shard, *inner), its
    own inner part saying where in the shard to go on (`start`: the beginning of a shard); the
    resumed shard starts at the cursor's inner part, every later one at `start`. A cursor whose
    shard is not at its position in this order (shards or ranks changed) raises ValueError."""
    order = shard_order(num_shards, seed, rank, world_size, shuffle, what)
    pos, shard, *inner = cursor or (0, None, *start)
    if shard is not None and (pos >= len(order) or order[pos] != shard):
        raise ValueError(f"resume cursor {cursor} does not match the shard order of {what}: the shards or "
                         "the number of readers changed since the checkpoint")
    for p in range(pos, len(order)):
        yield p, order[p], tuple(inner)
        inner = start


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


