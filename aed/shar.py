"""Lhotse Shar directories, read in place: `{shar: DIR}`.

The layout is written by lhotse's `lhotse/shar/writers/` (facts in
/work/shared/notes/data-formats.md): per shard `cuts.000000.jsonl.gz` (one cut per line) and
`recording.000000.tar`, whose members come in pairs in cut order, `<cut_id>.<fmt>` (the cut's
own audio: flac by default, or wav, mp3, opus) then `<cut_id>.json` (its Recording); a cut with
no audio has `<cut_id>.nodata` + `<cut_id>.nometa`. Other fields' files are not needed here.

A cut becomes an example by the manifest's rules (aed/streaming.py `example_fields`): duration
from the cut; text from its supervisions (joined, in order) and the source language from the
first one's `language`; Canary's fields (`source_lang`, `target_lang`, `pnc`, `taskname`, or
NeMo's `answer` / `lang`) from the supervision's `custom` dict, overridden by the cut's (where
NeMo's converters put manifest keys). The stored audio is the cut itself, so it starts at 0.

Reading, resume and faults: aed/tar_source.py. Durations come from the cuts (`metadata()`).
"""

import json
import re
from collections import defaultdict
from pathlib import Path

from aed.data import manifest_lines
from aed.tar_source import StemMatchedTarSource

CUTS_NAME = re.compile(r"cuts\.(\d+)\.jsonl(\.gz)?$")
NOT_AUDIO = {"json", "nometa"}  # the Recording manifest beside each audio member; no data's pair


def cut_row(cut: dict) -> dict:
    """A Shar cut -> a row with manifest keys."""
    sups = cut.get("supervisions") or []
    first = sups[0] if sups else {}
    d = {"lang": first.get("language"), **(first.get("custom") or {}), **(cut.get("custom") or {})}
    texts = [s["text"] for s in sups if isinstance(s.get("text"), str) and s["text"].strip()]
    if texts:
        d["text"] = " ".join(texts)
    d["duration"], d["offset"] = cut.get("duration"), 0.0
    return d


class SharSource(StemMatchedTarSource):
    """Examples streamed from one Shar directory; see the module docstring."""

    def __init__(self, directory, shuffle_shards: bool = True):
        root = Path(directory)
        if not root.is_dir():
            raise FileNotFoundError(f"SharSource: no such directory {root}")
        cuts = sorted((p for p in root.iterdir() if CUTS_NAME.match(p.name)), key=lambda p: p.name)
        if not cuts:
            raise ValueError(f"SharSource: {root} has no cuts.NNNNNN.jsonl.gz")
        shards = [(str(c), str(root / f"recording.{CUTS_NAME.match(c.name).group(1)}.tar")) for c in cuts]
        super().__init__(shards, f"Shar directory {root}", shuffle_shards)

    def _member(self, name: str) -> tuple[str, str]:
        stem, _, ext = name.rpartition(".")
        return stem, "skip" if ext in NOT_AUDIO else "nodata" if ext == "nodata" else "audio"

    def _load_rows(self, shard: int) -> dict:
        path = self.shards[shard][0]
        groups = defaultdict(list)
        for where, line in manifest_lines(path):
            try:
                cut = json.loads(line)
                cut_id = cut["id"]
            except (ValueError, KeyError, TypeError) as e:
                self.faults.skip("invalid_row", where, f"not a cut ({e!r})")
                continue
            where = f"{path}:{cut_id}"
            ex = self.faults.fields(cut_row(cut), where)
            groups[cut_id].append((where, ex and {**ex, "audio_filepath": cut_id}))
        return groups
