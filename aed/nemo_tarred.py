"""NeMo tarred audio datasets, read in place:

    {manifest_filepath: "data/bucket1/sharded_manifests/manifest__OP_0..127_CL_.json",
     tarred_audio_filepaths: "data/bucket1/audio__OP_0..127_CL_.tar", weight: 1}

The layout is written by NeMo's `scripts/speech_recognition/convert_to_tarred_audio_dataset.py`
(facts gathered in /work/shared/notes/data-formats.md): per shard k, `audio_k.tar` and a JSONL
manifest `sharded_manifests/manifest_k.json` whose rows keep their fields (Canary's `source_lang`,
`target_lang`, `pnc`, `taskname`, or `answer` and `lang`) and name their tar member in
`audio_filepath`. The rules followed here are NeMo's:

- Paths: `_OP_` / `_CL_` (and `(`, `[`, `<` / `)`, `]`, `>`) stand for braces, then brace expansion
  (`{0..127}`, `{a,b}`); a list of such strings is expanded item by item.
- Shards are paired by the id in their names (`manifest*_<k>*.json`, `audio*_<k>*.tar`), the
  n-th manifest with id k going with the n-th tar with id k, so several buckets' `audio_0.tar`
  do not collide; names without ids pair by position. One manifest for many tars (NeMo's
  `shard_manifests: false`, e.g. `tarred_audio_manifest.json`) sends each row to its `shard_id`.
- A file several rows name (segments, with `offset`) is stored once per shard; later rows name it
  `<base>-sub<N><ext>`: the stem without `-sub<N>` finds the member. Members are matched by stem,
  as the converter's --force_codec changes the extension but not the rows.

Reading, resume and faults: aed/tar_source.py. Durations come from the manifests (`metadata()`).
"""

import json
import re
from collections import defaultdict
from pathlib import Path

from aed.data import manifest_lines
from aed.tar_source import StemMatchedTarSource

MANIFEST_ID = re.compile(r"manifest[^/]*_(\d+)[^/]*\.json$")
TAR_ID = re.compile(r"audio[^/]*_(\d+)[^/]*\.tar$")
SUB_SUFFIX = re.compile(r"-sub\d+$")
OPEN, CLOSE = ("_OP_", "(", "[", "<"), ("_CL_", ")", "]", ">")


def expand_braces(s: str) -> list[str]:
    """Brace expansion, innermost group first: `a{0..2}` -> a0 a1 a2 (`{00..10}` keeps the width, `{0..10}` not),
    `{x,y}` -> x y."""
    m = re.search(r"\{([^{}]*)\}", s)
    if m is None:
        return [s]
    body, head, tail = m.group(1), s[: m.start()], s[m.end() :]
    if r := re.fullmatch(r"(\d+)\.\.(\d+)", body):
        lo, hi = r.groups()
        padded = any(len(b) > 1 and b.startswith("0") for b in (lo, hi))  # bash's rule: {00..10}, not {0..10}
        width = max(len(lo), len(hi)) if padded else 0
        step = 1 if int(hi) >= int(lo) else -1
        items = [str(i).zfill(width) for i in range(int(lo), int(hi) + step, step)]
    elif "," in body:
        items = body.split(",")
    else:
        raise ValueError(f"{s}: cannot expand {{{body}}} (expected a..b or a,b,...)")
    out = []
    for item in items:
        for x in expand_braces(head + item + tail):
            if x not in out:
                out.append(x)
    return out


def expand_paths(spec) -> list[str]:
    """NeMo's path syntax (a string, or a list of them) -> the paths it names, in order."""
    out = []
    for s in [spec] if isinstance(spec, str) else spec:
        for o in OPEN:
            s = s.replace(o, "{")
        for c in CLOSE:
            s = s.replace(c, "}")
        out += expand_braces(s)
    return out


def pair_shards(manifests: list[str], tars: list[str]) -> list[tuple[str, str]]:
    """(manifest, tar) per shard, matched by (shard id, occurrence) as NeMo does, else by position."""
    def keyed(paths, pattern):
        seen, keys = defaultdict(int), []
        for p in paths:
            m = pattern.search(Path(p).name)
            if m is None:
                return None
            k = int(m.group(1))
            keys.append((k, seen[k]))
            seen[k] += 1
        return dict(zip(keys, paths))

    by_manifest, by_tar = keyed(manifests, MANIFEST_ID), keyed(tars, TAR_ID)
    if by_manifest is not None and by_tar is not None:
        if set(by_manifest) != set(by_tar):
            lonely = sorted(set(by_manifest) ^ set(by_tar))[:3]
            raise ValueError(f"NeMo tarred set: manifests and tars name different shards, e.g. (id, occurrence) "
                             f"{lonely}: {len(manifests)} manifests, {len(tars)} tars")
        return [(by_manifest[k], by_tar[k]) for k in by_manifest]
    if len(manifests) != len(tars):
        raise ValueError(f"NeMo tarred set: {len(manifests)} manifests but {len(tars)} tars, and their names "
                         "carry no shard ids (manifest_<k>.json, audio_<k>.tar) to pair them by")
    return list(zip(manifests, tars))


def member_stem(name: str) -> str:
    """The stem shared by a member and the rows naming it: no extension, no `-sub<N>`."""
    stem = name.rpartition(".")[0] or name
    return SUB_SUFFIX.sub("", stem)


class NemoTarredSource(StemMatchedTarSource):
    """Examples streamed from one NeMo tarred set (one bucket); see the module docstring. One
    manifest for many tars (NeMo's `shard_manifests: false`, e.g. `tarred_audio_manifest.json`) is
    read once, its rows going to the tar named by their `shard_id`."""

    def __init__(self, manifest_filepath, tarred_audio_filepaths, shuffle_shards: bool = True):
        manifests, tars = expand_paths(manifest_filepath), expand_paths(tarred_audio_filepaths)
        self._one_manifest = None  # shard_id -> rows grouped by stem, when one manifest serves every tar
        if len(manifests) == 1 and len(tars) > 1:
            ids = [TAR_ID.search(Path(t).name) for t in tars]
            if None in ids:
                raise ValueError(f"NeMo tarred set: one manifest for {len(tars)} tars, but a tar name carries no "
                                 f"shard id (audio_<k>.tar) to match the rows' shard_id: {tars[ids.index(None)]}")
            self._tar_ids = [int(m.group(1)) for m in ids]
            shards = [(manifests[0], t) for t in tars]
        else:
            shards = pair_shards(manifests, tars)
        super().__init__(shards, f"NeMo tarred set {tarred_audio_filepaths}", shuffle_shards)

    def _member(self, name: str) -> tuple[str, str]:
        return member_stem(name), "audio"

    def _load_rows(self, shard: int) -> dict:
        path = self.shards[shard][0]
        if not hasattr(self, "_tar_ids"):
            return self._parse(path)
        if self._one_manifest is None:
            self._one_manifest = self._parse(path, by_shard_id=True)
        return self._one_manifest.get(self._tar_ids[shard], {})

    def _parse(self, path: str, by_shard_id: bool = False) -> dict:
        """A manifest's rows grouped by member stem; by_shard_id: {shard_id: such groups}."""
        out = defaultdict(lambda: defaultdict(list)) if by_shard_id else defaultdict(list)
        for where, line in manifest_lines(path):
            try:
                d = json.loads(line)
                name = d["audio_filepath"]
                if not isinstance(name, str):
                    raise TypeError(f"audio_filepath is {type(name).__name__}")
                groups = out[int(d["shard_id"])] if by_shard_id else out
            except (ValueError, KeyError, TypeError) as e:
                self.faults.skip("invalid_row", where, f"not a JSON object with an audio_filepath"
                                 f"{' and a shard_id' if by_shard_id else ''} ({e!r})")
                continue
            ex = self.faults.fields(d, where)
            groups[member_stem(name)].append((where, ex and {**ex, "audio_filepath": name}))
        return out
