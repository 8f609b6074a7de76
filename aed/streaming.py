"""What every streamed reader of data as researchers hold it shares (aed/nemo_tarred.py,
aed/shar.py, aed/hf_parquet.py; `sampler.py` describes the streamed-source protocol they follow):

- `shard_order`: the shards a rank reads in a pass, disjoint across ranks, reshuffled every pass.
- `example_fields`: a format's row (manifest keys, or keys mapped to them) -> the checked fields
  of a training example, by the same rules as a JSONL manifest line (aed/data.py).
- `Faults`: what a reader skips (a missing or truncated shard, an undecodable member, a member
  with no row, a row with no member, an invalid row), counted by kind and logged once each.

Examples are the dicts `aed.shards.ShardDataset` decodes: the fields below, `audio` (the encoded
bytes of the file that holds the utterance), `offset` (seconds into that audio where it starts)
and `where` (a stable id naming the shard and member or row, for messages and `inspect_data`).
"""

import logging
import random
from collections import Counter

from aed.data import ManifestError, seconds, text_and_task

log = logging.getLogger(__name__)


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


def example_fields(d: dict, where: str) -> dict:
    """duration, offset, text, source_lang, target_lang, pnc, taskname of a row with manifest keys
    (`answer` and `lang` accepted as in NeMo's manifests). Raises ManifestError naming `where`."""
    duration = seconds(d, "duration", where, positive=True, required=True)
    offset = seconds(d, "offset", where, positive=False) or 0.0
    text, source_lang, target_lang, pnc, taskname = text_and_task(d, where)
    return {"duration": duration, "offset": offset, "text": text, "source_lang": source_lang,
            "target_lang": target_lang, "pnc": pnc, "taskname": taskname}


class Faults:
    """Skipped data of one source, counted by kind; each (kind, where) is counted and logged once,
    however many passes meet it again (an infinite run rereads a bad shard every pass)."""

    KINDS = ("bad_shard", "undecodable", "member_without_row", "row_without_member", "invalid_row")

    def __init__(self):
        self.counts = Counter()
        self.seen = {}  # (kind, where) -> why, in the order met

    def skip(self, kind: str, where: str, why: str) -> None:
        assert kind in self.KINDS, kind
        if (kind, where) in self.seen:
            return
        self.seen[(kind, where)] = why
        self.counts[kind] += 1
        log.warning("skipped %s (%s): %s", where, kind.replace("_", " "), why)

    def fields(self, d: dict, where: str) -> dict | None:
        """example_fields(d, where), or None after counting the row as invalid."""
        try:
            return example_fields(d, where)
        except ManifestError as e:
            self.skip("invalid_row", where, str(e).removeprefix(f"{where}: "))
            return None
