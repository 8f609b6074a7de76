"""Tokenizer: special tokens + SentencePiece models in one id space, and Canary prompts.

The id space is a list of blocks laid end to end; each block owns ids [offset, offset + size):

- a special block is a plain list of token strings, id = offset + index;
- a SentencePiece block serves one language key ("en") or every language ("all"),
  id = offset + SentencePiece id.

Our own "single" layout is [special, "all"]. NeMo's aggregate layout, used by Canary-1B and the
Flash models, is [special, "en", "es", "de", "fr"] (canary-1b: 1152 + 4 x 1024 = 5248 ids). As in
NeMo's AggregateTokenizer, text of language L is encoded by L's model and shifted by L's offset,
and decoding maps every id back to the block that owns it. Canary-1B-v2's layout (NeMo's
CanaryBPETokenizer) is one "all" block whose SentencePiece model holds the special tokens itself,
as user-defined pieces: its pieces named <|...|> or <pad> are special tokens at their own ids.

A tokenizer directory holds `tokenizer.json` and one `.model` file per SentencePiece block:

    {"format_version": 1, "prompt_format": "canary", "languages": ["de", "en", "es", "fr"],
     "blocks": [{"kind": "special", "tokens": ["<unk>", "<pad>", ...]},
                {"kind": "sentencepiece", "lang": "all", "model": "all.model", "size": 1024}]}
"""

import bisect
import json
from dataclasses import dataclass
from pathlib import Path

import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2 as sp_model

FORMAT_VERSION = 1

UNK = "<unk>"
PAD = "<pad>"
EOS = "<|endoftext|>"
BOS = "<|startoftranscript|>"
TRANSCRIBE = "<|transcribe|>"
TRANSLATE = "<|translate|>"
PNC = "<|pnc|>"
NOPNC = "<|nopnc|>"
NOSPEECH = "<|nospeech|>"
# Only in the "canary2" prompt (the Flash models): the prompt fields our tasks leave at their defaults.
CONTEXT = "<|startofcontext|>"
EMO_UNDEFINED = "<|emo:undefined|>"
NOITN = "<|noitn|>"
NOTIMESTAMP = "<|notimestamp|>"
NODIARIZE = "<|nodiarize|>"
DEFAULT_LANGUAGES = ("en", "de", "fr", "es")


def lang_token(lang: str) -> str:
    return f"<|{lang}|>"


def default_special_tokens(languages) -> list[str]:
    """Special tokens of our own tokenizers: the tokens of both prompt formats, then one <|xx|> per
    language, sorted. Either prompt format can be chosen for the same list."""
    fixed = [UNK, PAD, EOS, BOS, TRANSCRIBE, TRANSLATE, PNC, NOPNC, NOSPEECH]
    canary2 = [CONTEXT, EMO_UNDEFINED, NOITN, NOTIMESTAMP, NODIARIZE]
    return fixed + canary2 + [lang_token(lang) for lang in sorted(set(languages))]


def inline_special_pieces(sp: spm.SentencePieceProcessor) -> dict[str, int]:
    """{piece: id} of the special tokens a SentencePiece model holds itself (NeMo's CanaryBPETokenizer):
    its user-defined or control pieces named <|...|> or <pad>, NeMo's own rule for special tokens."""
    proto = sp_model.ModelProto.FromString(sp.serialized_model_proto())
    kinds = (sp_model.ModelProto.SentencePiece.CONTROL, sp_model.ModelProto.SentencePiece.USER_DEFINED)
    return {p.piece: i for i, p in enumerate(proto.pieces)
            if p.type in kinds and (p.piece.startswith("<|") and p.piece.endswith("|>") or p.piece == PAD)}


@dataclass
class SpecialBlock:
    tokens: list[str]

    @property
    def size(self) -> int:
        return len(self.tokens)


@dataclass
class SentencePieceBlock:
    lang: str  # a language code, or "all"
    sp: spm.SentencePieceProcessor

    @property
    def size(self) -> int:
        return self.sp.get_piece_size()


# --- prompt formats: one function per format, (tokenizer, ...) -> prompt ids ---


def canary_prompt(tok: "Tokenizer", source_lang: str, target_lang: str, pnc: bool, task: str) -> list[int]:
    """<|startoftranscript|><|SRC|><|transcribe|or|translate|><|TGT|><|pnc|or|nopnc|> (NeMo's "canary")."""
    task_token = {"transcribe": TRANSCRIBE, "translate": TRANSLATE}[task]
    return [
        tok.bos,
        tok.lang_id(source_lang),
        tok.token_to_id(task_token),
        tok.lang_id(target_lang),
        tok.token_to_id(PNC if pnc else NOPNC),
    ]


def canary2_prompt(tok: "Tokenizer", source_lang: str, target_lang: str, pnc: bool, task: str) -> list[int]:
    """<|startofcontext|><|startoftranscript|><|emo:undefined|><|SRC|><|TGT|><|pnc|or|nopnc|><|noitn|><|notimestamp|><|nodiarize|>

    NeMo's "canary2" (Canary-1B-Flash, Canary-180M-Flash) with an empty decoder context. It has no
    task token: the model translates exactly when the target language differs from the source.
    """
    if task == "translate" and source_lang == target_lang:
        raise ValueError(f"prompt format 'canary2' has no task token: translation needs source_lang != "
                         f"target_lang, got {source_lang} -> {target_lang}")
    return [
        tok.token_to_id(CONTEXT),
        tok.bos,
        tok.token_to_id(EMO_UNDEFINED),
        tok.lang_id(source_lang),
        tok.lang_id(target_lang),
        tok.token_to_id(PNC if pnc else NOPNC),
        tok.token_to_id(NOITN),
        tok.token_to_id(NOTIMESTAMP),
        tok.token_to_id(NODIARIZE),
    ]


PROMPT_FORMATS = {"canary": canary_prompt, "canary2": canary2_prompt}


class Tokenizer:
    def __init__(self, blocks: list, languages: list[str], prompt_format: str = "canary"):
        if prompt_format not in PROMPT_FORMATS:
            raise ValueError(f"unknown prompt_format {prompt_format!r}; known: {sorted(PROMPT_FORMATS)}")
        self.blocks = blocks
        self.prompt_format = prompt_format
        self.languages = list(languages)

        self._offsets = []  # first id of every block, ascending, for bisect in _block_of
        self._special_ids = {}  # token string -> id, over all special blocks and inline special pieces
        self._inline_special = set()  # ids of special pieces inside SentencePiece blocks
        self._sp_blocks = {}  # language key -> (offset, SentencePieceBlock)
        offset = 0
        for block in blocks:
            self._offsets.append(offset)
            if isinstance(block, SpecialBlock):
                for i, token in enumerate(block.tokens):
                    if token in self._special_ids:
                        raise ValueError(f"special token {token!r} appears twice")
                    self._special_ids[token] = offset + i
            elif isinstance(block, SentencePieceBlock):
                if block.lang in self._sp_blocks:
                    raise ValueError(f"two SentencePiece blocks for language key {block.lang!r}")
                self._sp_blocks[block.lang] = (offset, block)
                for token, local in inline_special_pieces(block.sp).items():
                    if token in self._special_ids:
                        raise ValueError(f"special token {token!r} appears twice")
                    self._special_ids[token] = offset + local
                    self._inline_special.add(offset + local)
            else:
                raise TypeError(f"not a tokenizer block: {type(block).__name__}")
            offset += block.size
        self.vocab_size = offset
        # NeMo's CanaryBPETokenizer: no special block, the special tokens are pieces of the one model.
        self.specials_inline = bool(self._inline_special) and not any(isinstance(b, SpecialBlock) for b in blocks)

        for token in (BOS, EOS, PAD) + tuple(lang_token(lang) for lang in self.languages):
            if token not in self._special_ids:
                raise ValueError(f"special token {token!r} is missing from the special blocks")

    # --- ids of special tokens ---

    @property
    def bos(self) -> int:
        return self._special_ids[BOS]

    @property
    def eos(self) -> int:
        return self._special_ids[EOS]

    @property
    def pad(self) -> int:
        return self._special_ids[PAD]

    @property
    def padded_vocab_size(self) -> int:
        """vocab_size rounded up to a multiple of 8: the model's embedding/output size (faster matmuls)."""
        return (self.vocab_size + 7) // 8 * 8

    def lang_id(self, lang: str) -> int:
        if lang not in self.languages:
            raise ValueError(f"unknown language {lang!r}; this tokenizer has {self.languages}")
        return self._special_ids[lang_token(lang)]

    def is_special(self, i: int) -> bool:
        return isinstance(self.blocks[self._block_of(i)], SpecialBlock) or i in self._inline_special

    def token_to_id(self, token: str, lang: str | None = None) -> int:
        """Id of a special token, or of a SentencePiece piece in `lang`'s block (default: the "all" block)."""
        if token in self._special_ids:
            return self._special_ids[token]
        if lang is not None or "all" in self._sp_blocks:
            offset, block = self._sp_block(lang or "all")
            piece_id = block.sp.piece_to_id(token)
            # piece_to_id answers unk for unknown pieces; only "<unk>" itself may map there.
            if piece_id != block.sp.unk_id() or token == block.sp.id_to_piece(piece_id):
                return offset + piece_id
        raise KeyError(f"token {token!r} is not in this tokenizer (lang={lang!r})")

    def id_to_token(self, i: int) -> str:
        k = self._block_of(i)
        block, local = self.blocks[k], i - self._offsets[k]
        if isinstance(block, SpecialBlock):
            return block.tokens[local]
        return block.sp.id_to_piece(local)

    # --- text ---

    def encode(self, text: str, lang: str) -> list[int]:
        """Text -> ids with `lang`'s SentencePiece block (else the "all" block).

        Special-token strings in `text` stay ordinary text: SentencePiece never sees our special tokens.
        """
        offset, block = self._sp_block(lang)
        return [offset + i for i in block.sp.encode(text)]

    def decode(self, ids: list[int]) -> str:
        """Ids -> text, skipping special tokens. Runs of ids from one block are decoded together."""
        runs = []  # [block index, [local ids]]
        for i in ids:
            if self.is_special(i):
                continue
            k = self._block_of(i)
            if runs and runs[-1][0] == k:
                runs[-1][1].append(i - self._offsets[k])
            else:
                runs.append([k, [i - self._offsets[k]]])

        text = ""
        for k, local_ids in runs:
            sp = self.blocks[k].sp
            # SentencePiece drops the word-start marker of a run's first piece; between runs
            # that marker is a real space (NeMo joins all pieces and maps "▁" to " ").
            if text and sp.id_to_piece(local_ids[0]).startswith("▁"):
                text += " "
            text += sp.decode(local_ids)
        return text

    def text_ids(self, ids: list[int]) -> list[int]:
        """Generated ids -> those that carry text. The model's output layer has padded_vocab_size
        rows, so a model can generate an id past the tokenizer's; like special tokens, it has no text."""
        return [i for i in ids if i < self.vocab_size and not self.is_special(i)]

    def decode_hypothesis(self, ids: list[int]) -> str:
        """Generated ids -> text; unlike `decode`, ids of the padded vocabulary are skipped, not an error."""
        return self.decode(self.text_ids(ids))

    # --- prompts ---

    def prompt_ids(self, source_lang: str, target_lang: str, pnc: bool, task: str | None = None) -> list[int]:
        """Decoder prompt; task is "transcribe" or "translate", by default transcribe iff source == target."""
        if task is None:
            task = "transcribe" if source_lang == target_lang else "translate"
        if task not in ("transcribe", "translate"):
            raise ValueError(f"unknown task {task!r}; expected 'transcribe' or 'translate'")
        ids = PROMPT_FORMATS[self.prompt_format](self, source_lang, target_lang, pnc, task)
        if self.specials_inline:
            # NeMo encodes such a prompt as text with the one model, which puts its word-start piece
            # first where the model adds one (Canary-1B-v2: "▁" then the 9 tokens of "canary2").
            ids = self.encode("".join(map(self.id_to_token, ids)), target_lang)
        return ids

    def encode_example(
        self, text: str, source_lang: str, target_lang: str, pnc: bool, task: str | None = None
    ) -> tuple[list[int], int]:
        """Training target: prompt + text (in the target language) + eos, and the prompt length."""
        prompt = self.prompt_ids(source_lang, target_lang, pnc, task)
        return prompt + self.encode(text, target_lang) + [self.eos], len(prompt)

    # --- files ---

    def save(self, directory) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        blocks = []
        for block in self.blocks:
            if isinstance(block, SpecialBlock):
                blocks.append({"kind": "special", "tokens": block.tokens})
            else:
                model = f"{block.lang}.model"
                (directory / model).write_bytes(block.sp.serialized_model_proto())
                blocks.append({"kind": "sentencepiece", "lang": block.lang, "model": model, "size": block.size})
        config = {
            "format_version": FORMAT_VERSION,
            "prompt_format": self.prompt_format,
            "languages": self.languages,
            "blocks": blocks,
        }
        (directory / "tokenizer.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")

    @classmethod
    def load(cls, directory) -> "Tokenizer":
        path = Path(directory) / "tokenizer.json"
        try:
            config = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: cannot read tokenizer config: {e}") from e

        def field(obj, key, kind, where):
            if not isinstance(obj, dict) or key not in obj:
                raise ValueError(f"{path}: missing field '{where}'")
            if not isinstance(obj[key], kind):
                raise ValueError(f"{path}: field '{where}' must be {kind.__name__}, got {obj[key]!r}")
            return obj[key]

        version = field(config, "format_version", int, "format_version")
        if version != FORMAT_VERSION:
            raise ValueError(f"{path}: field 'format_version' is {version}, this code reads {FORMAT_VERSION}")
        prompt_format = field(config, "prompt_format", str, "prompt_format")
        if prompt_format not in PROMPT_FORMATS:
            raise ValueError(f"{path}: field 'prompt_format' is {prompt_format!r}; known: {sorted(PROMPT_FORMATS)}")
        languages = field(config, "languages", list, "languages")
        if not all(isinstance(lang, str) for lang in languages):
            raise ValueError(f"{path}: field 'languages' must be a list of strings, got {languages!r}")

        blocks = []
        for n, entry in enumerate(field(config, "blocks", list, "blocks")):
            where = f"blocks[{n}]"
            kind = field(entry, "kind", str, f"{where}.kind")
            if kind == "special":
                tokens = field(entry, "tokens", list, f"{where}.tokens")
                if not all(isinstance(t, str) for t in tokens):
                    raise ValueError(f"{path}: field '{where}.tokens' must be a list of strings")
                blocks.append(SpecialBlock(tokens))
            elif kind == "sentencepiece":
                lang = field(entry, "lang", str, f"{where}.lang")
                model = path.parent / field(entry, "model", str, f"{where}.model")
                size = field(entry, "size", int, f"{where}.size")
                try:
                    sp = spm.SentencePieceProcessor(model_file=str(model))
                except (OSError, RuntimeError) as e:
                    raise ValueError(f"{path}: field '{where}.model': cannot load {model}: {e}") from e
                if sp.get_piece_size() != size:
                    raise ValueError(
                        f"{path}: field '{where}.size' is {size} but {model} has {sp.get_piece_size()} pieces"
                    )
                blocks.append(SentencePieceBlock(lang, sp))
            else:
                raise ValueError(f"{path}: field '{where}.kind' is {kind!r}; expected 'special' or 'sentencepiece'")
        try:
            return cls(blocks, languages, prompt_format)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from e

    # --- internals ---

    def _block_of(self, i: int) -> int:
        if not 0 <= i < self.vocab_size:
            raise ValueError(f"token id {i} is outside the vocabulary [0, {self.vocab_size})")
        return bisect.bisect_right(self._offsets, i) - 1

    def _sp_block(self, lang: str) -> tuple[int, SentencePieceBlock]:
        if lang in self._sp_blocks:
            return self._sp_blocks[lang]
        if "all" in self._sp_blocks:
            return self._sp_blocks["all"]
        raise ValueError(
            f"no SentencePiece block for language {lang!r} and no 'all' block; blocks: {sorted(self._sp_blocks)}"
        )

    def __repr__(self) -> str:
        layout = ", ".join(
            f"special[{b.size}]" if isinstance(b, SpecialBlock) else f"{b.lang}[{b.size}]" for b in self.blocks
        )
        return f"Tokenizer({layout}; vocab_size={self.vocab_size}, prompt_format={self.prompt_format!r})"
