"""Tokenizers for LLMs, torch-free: one interface over five on-disk formats.

``load_tokenizer(path)`` accepts:

- an HF ``tokenizer.json`` (or a folder holding one, with ``tokenizer_config.json``),
  run by the `tokenizers` library;
- a ``.gguf`` file whose metadata embeds the vocabulary: ``tokenizer.ggml.model`` is
  ``gpt2`` (byte-level BPE: rebuilt as a `tokenizers` BPE with llama.cpp's
  pre-tokenizer regexes for ``tokenizer.ggml.pre``) or ``llama`` (SentencePiece BPE:
  rebuilt as a SentencePiece model proto and run by `sentencepiece`);
- a SentencePiece ``.model`` (Llama 2, TinyLlama), run by `sentencepiece`;
- a tiktoken-format ``tokenizer.model`` (Llama 3: base64 token + rank per line), run by
  `tiktoken` with Llama 3's split pattern and special tokens;
- a llama2.c ``tokenizer.bin`` (scores + pieces), converted to a SentencePiece proto.

Every tokenizer has ``encode(text, bos, eos, allow_special)``, ``decode(ids)``,
``decode_token(id)`` (streaming: a UTF-8 character split across tokens comes out whole
once its last byte arrives), ``bos_id``, ``eos_ids``, ``special_tokens`` and
``apply_chat_template(messages)``.

Special tokens written in the text (such as ``<|im_start|>``) become their ids only with
``allow_special=True``; otherwise they are tokenized as plain text, as llama.cpp does
without ``parse_special``.

A malformed file raises TokenizerError naming the file and the fault (CheckpointError for
a GGUF whose own structure is broken). Each format is checked before its library sees it
(tokenizer.json's ids, merges and added tokens; a .model's protobuf; tiktoken ranks;
llama2.c record lengths; GGUF vocabulary lists and special ids), so what the libraries
still reject is rare; that is wrapped too.
"""

from __future__ import annotations

import base64
import codecs
import json
import os
import re
import struct
from abc import ABC, abstractmethod
from array import array
from collections.abc import Iterator
from contextlib import contextmanager
from itertools import accumulate
from pathlib import Path
from typing import Any, Sequence

from execupy.errors import TokenizerError
from execupy.fileio import atomic_write
from execupy.llm.config import naming, read_json_object, read_json_text


# GGUF / SentencePiece token types (the same enum in both formats).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Texts llama.cpp treats as end-of-generation whatever the metadata says (llama-vocab.cpp).
_EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<EOT>",
              "<|eom_id|>", "<｜end▁of▁sentence｜>")


class StreamDecoder:
    """Turns a stream of token ids into text pieces that never split a UTF-8 character."""

    def __init__(self, tokenizer: "Tokenizer", special: bool = False) -> None:
        self._tokenizer = tokenizer
        self._special = special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def put(self, token_id: int) -> str:
        """The text that token completes ('' while a multi-byte character is still open)."""
        return self._utf8.decode(self._tokenizer.token_bytes(token_id, special=self._special))

    def flush(self) -> str:
        """Whatever is left (an unfinished character comes out as U+FFFD)."""
        return self._utf8.decode(b"", final=True)


class Tokenizer(ABC):
    """Common interface; subclasses wrap one tokenizer library."""

    bos_id: int | None = None
    eos_ids: tuple[int, ...] = ()
    add_bos: bool = False  # whether the model expects BOS in front of a prompt
    chat_template: str | None = None
    special_tokens: dict[str, int]

    @property
    @abstractmethod
    def vocab_size(self) -> int: ...

    @abstractmethod
    def _encode(self, text: str, allow_special: bool) -> list[int]: ...

    @abstractmethod
    def token_bytes(self, token_id: int, special: bool = False) -> bytes:
        """The bytes a token stands for; special tokens give b'' unless ``special``."""

    def release_encoder(self) -> None:
        """Free what only encoding needs, when no more text will be encoded (``execupy
        generate`` encodes one prompt, then only streams token bytes). Everything still works
        afterwards; a tokenizer that can load it again does so when asked to encode. Most
        keep everything: their tables are small."""

    @abstractmethod
    def save(self, path: str | os.PathLike) -> None:
        """Write the vocabulary as one file ``load_tokenizer`` reads back (tokenizer.json for
        `tokenizers`-based ones, a SentencePiece .model, a tiktoken file). BOS/EOS/chat template
        travel separately (the program's metadata) and are passed to ``load_tokenizer``."""

    def encode(self, text: str, bos: bool | None = None, eos: bool = False, allow_special: bool = False) -> list[int]:
        """Token ids of ``text``; ``bos=None`` adds BOS when the model expects it."""
        ids = self._encode(text, allow_special)
        if (self.add_bos if bos is None else bos) and self.bos_id is not None:
            ids = [self.bos_id] + ids
        if eos and self.eos_ids:
            ids = ids + [self.eos_ids[0]]
        return ids

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        data = b"".join(self.token_bytes(i, special=not skip_special) for i in ids)
        return data.decode("utf-8", errors="replace")

    def stream_decoder(self, special: bool = False) -> StreamDecoder:
        """A fresh streaming decoder (one per generation)."""
        return StreamDecoder(self, special)

    def decode_token(self, token_id: int) -> str:
        """Streaming decode on this tokenizer's own decoder; see ``reset_stream``."""
        if not hasattr(self, "_stream"):
            self._stream = self.stream_decoder()
        return self._stream.put(token_id)

    def reset_stream(self) -> str:
        """End the current stream: returns any held-back text and starts afresh."""
        rest = self._stream.flush() if hasattr(self, "_stream") else ""
        self._stream = self.stream_decoder()
        return rest

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    @property
    def _special_ids(self) -> set[int]:
        if not hasattr(self, "_special_id_set"):
            self._special_id_set = set(self.special_tokens.values())
        return self._special_id_set

    def token_text(self, token_id: int) -> str:
        """Text of a single token, special tokens included (for display)."""
        return self.token_bytes(token_id, special=True).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """Render a conversation with the model's chat template (jinja2, as HF does)."""
        if not self.chat_template:
            raise TokenizerError("this tokenizer has no chat template")
        return render_chat_template(
            self.chat_template, messages, add_generation_prompt,
            bos_token=self.token_text(self.bos_id) if self.bos_id is not None else "",
            eos_token=self.token_text(self.eos_ids[0]) if self.eos_ids else "",
        )

    def encode_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """Render and tokenize a conversation (see ``encode_raw``)."""
        return self.encode_raw(self.apply_chat_template(messages, add_generation_prompt))

    def encode_raw(self, text: str) -> list[int]:
        """Tokenize a prompt as written, special tokens in it included (as a rendered chat
        template is); BOS is added only where the model expects one and the text lacks it."""
        bos_text = self.token_text(self.bos_id) if self.bos_id is not None else None
        has_bos = bool(bos_text) and text.startswith(bos_text)
        return self.encode(text, bos=self.add_bos and not has_bos, allow_special=True)

    def _split_special(self, text: str, allow_special: bool) -> list[str | int]:
        """Text fragments and special-token ids, in order (for libraries that cannot parse specials)."""
        if not allow_special or not self.special_tokens:
            return [text] if text else []
        if not hasattr(self, "_special_re"):
            names = sorted(self.special_tokens, key=len, reverse=True)  # longest match first
            self._special_re = re.compile("|".join(re.escape(n) for n in names))
        parts: list[str | int] = []
        pos = 0
        for m in self._special_re.finditer(text):
            if m.start() > pos:
                parts.append(text[pos : m.start()])
            parts.append(self.special_tokens[m.group()])
            pos = m.end()
        if pos < len(text):
            parts.append(text[pos:])
        return parts


def render_chat_template(template: str, messages: list[dict[str, str]], add_generation_prompt: bool,
                         **extra: Any) -> str:
    try:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as e:  # pragma: no cover - jinja2 is a dependency of the LLM runner
        raise TokenizerError("rendering a chat template needs the jinja2 package") from e

    def raise_exception(message: str) -> None:
        raise TokenizerError(f"chat template: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(messages=messages, add_generation_prompt=add_generation_prompt, **extra)


# ---------------------------------------------------------------------------------------
# `tokenizers` (HF tokenizer.json, GGUF gpt2-style BPE)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(printable, (chr(c) for c in chars)))


_BYTE_DECODER = {c: b for b, c in _bytes_to_unicode().items()}
_BYTE_ALPHABET = frozenset(_BYTE_DECODER)
_BYTE_TRANSLATION = str.maketrans({c: chr(b) for c, b in _BYTE_DECODER.items()})  # then latin-1: the bytes
_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


class HFTokenizer(Tokenizer):
    """A `tokenizers.Tokenizer` plus the model-level facts tokenizer.json does not hold."""

    def __init__(self, tok: Any, bos_id: int | None, eos_ids: Sequence[int], add_bos: bool,
                 chat_template: str | None, byte_level: bool, vocab_size: int, source: Path | None = None) -> None:
        """`vocab_size`: the largest id + 1, which the caller knows from the vocabulary it
        read (ids may leave gaps, which `tok.get_vocab_size` does not count; asking `tok` for
        its whole vocabulary to find the largest took 20 ms of SmolLM2's load)."""
        self._library: Any = tok  # None after release_encoder, until `_tok` loads it again
        self._source = source  # the tokenizer.json `tok` was read from, to read it again
        self._pieces: tuple[bytes, array] | None = None  # every token's bytes, once released
        self.bos_id = bos_id
        self.eos_ids = tuple(dict.fromkeys(eos_ids))
        self.add_bos = add_bos
        self.chat_template = chat_template
        self._byte_level = byte_level  # else SentencePiece-style pieces ("▁" and <0xXX>)
        added = tok.get_added_tokens_decoder()
        self.special_tokens = {t.content: i for i, t in added.items() if t.special}
        self._added = {i: t.content for i, t in added.items()}
        # Pieces are asked of `tok` when needed: a list of them all held 6.5 MiB (SmolLM2).
        self._vocab_size = vocab_size

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def _tok(self) -> Any:
        """The `tokenizers` object, read again from its file after `release_encoder`."""
        if self._library is None:
            self._library = load_hf_tokenizer(self._source)._library
        return self._library

    def release_encoder(self) -> None:
        """Drop the `tokenizers` object, whose vocabulary maps hold 9 MiB resident for
        SmolLM2's 49,152 tokens (beside 500 MiB of weights while generating); token bytes are
        read from then on from one table of them all (0.5 MiB, built here in 50 ms).
        Only a tokenizer read from a file releases: the file is read again when needed."""
        if self._source is None or self._library is None:
            return
        self._pieces = self._piece_table()
        self._library = None

    def _piece_table(self) -> tuple[bytes, array]:
        """Every token's bytes (b'' for added tokens, which `token_bytes` reads elsewhere),
        concatenated, and where each starts."""
        pieces = [b"" if i in self._added else self._piece_bytes(i) for i in range(self._vocab_size)]
        return b"".join(pieces), array("I", accumulate(map(len, pieces), initial=0))

    def save(self, path: str | os.PathLike) -> None:
        atomic_write(path, self._tok.to_str(pretty=True))  # what Tokenizer.save(path) writes

    def _encode(self, text: str, allow_special: bool) -> list[int]:
        self._tok.encode_special_tokens = not allow_special  # specials as plain text when not allowed
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special)

    def token_bytes(self, token_id: int, special: bool = False) -> bytes:
        if token_id in self._added:
            if token_id in self._special_ids and not special:
                return b""
            return self._added[token_id].encode()
        if not 0 <= token_id < self._vocab_size:
            raise TokenizerError(f"token id {token_id} is outside the vocabulary (0..{self._vocab_size - 1})")
        if self._pieces is not None:
            table, offsets = self._pieces
            return table[offsets[token_id]:offsets[token_id + 1]]
        return self._piece_bytes(token_id)

    def _piece_bytes(self, token_id: int) -> bytes:
        """The bytes of a vocabulary (not added) token, from its piece in the library."""
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        if self._byte_level:
            if _BYTE_ALPHABET.issuperset(piece):
                return piece.translate(_BYTE_TRANSLATION).encode("latin-1")
            return piece.encode()  # as the ByteLevel decoder does with a piece outside its alphabet
        m = _BYTE_PIECE.match(piece)
        return bytes([int(m.group(1), 16)]) if m else piece.replace("▁", " ").encode()


@contextmanager
def _library_errors(library: str) -> Iterator[None]:
    """What a tokenizer library raises on a vocabulary it rejects becomes a TokenizerError
    (`tokenizers` raises bare Exception, and a Rust panic arrives as a BaseException)."""
    try:
        yield
    except TokenizerError:
        raise
    except BaseException as e:
        if not isinstance(e, Exception) and type(e).__name__ != "PanicException":
            raise  # KeyboardInterrupt, SystemExit
        first_line = (str(e).splitlines() or [""])[0][:200]
        raise TokenizerError(f"{library} rejected the vocabulary ({type(e).__name__}: {first_line})") from e


_U32_LIMIT = 1 << 32
_F32_MAX = 3.4028234663852886e38
# Unused ids a vocabulary may leave between its tokens: the id -> piece table we build is
# as long as the largest id, so this keeps it in proportion to the file.
_ID_SLACK = 1 << 16


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < _U32_LIMIT


def _all_ids(values: Any) -> bool:
    """`_is_id` of every value, with C-level maps (SmolLM2's 49,152: ~2 ms against 36)."""
    values = list(values)
    return set(map(type, values)) <= {int} and (not values or (min(values) >= 0 and max(values) < _U32_LIMIT))


def check_tokenizer_json(spec: dict[str, Any]) -> int:
    """The parts of a tokenizer.json that `tokenizers` would reject with a bare Exception
    (or turn into a huge table): the model's vocabulary and merges, and the added tokens.
    Returns the vocabulary's size, its largest id + 1."""
    model = spec.get("model")
    if not isinstance(model, dict):
        raise TokenizerError("tokenizer.json has no \"model\" object")
    kind = model.get("type", "BPE")
    if kind == "Unigram":
        vocab = model.get("vocab")
        if not isinstance(vocab, list) or not all(
                isinstance(v, list) and len(v) == 2 and isinstance(v[0], str) and _is_number(v[1]) for v in vocab):
            raise TokenizerError("Unigram vocab must be a list of [piece, score] pairs")
        ids = range(len(vocab))
    elif kind in ("BPE", "WordPiece", "WordLevel"):
        vocab = model.get("vocab")
        if not isinstance(vocab, dict):
            raise TokenizerError(f"{kind} vocab must be an object mapping pieces to ids")
        if not _all_ids(vocab.values()):  # checked in bulk; the loop names the first that is not
            bad = next(k for k, v in vocab.items() if not _is_id(v))
            raise TokenizerError(f"vocab entry {bad!r:.60} has id {vocab[bad]!r:.60}, expected an integer in [0, 2**32)")
        ids = vocab.values()
        if len(set(ids)) != len(vocab):
            raise TokenizerError(f"{kind} vocab gives the same id to two pieces")
        if kind == "BPE":
            _check_merges(model.get("merges", []), vocab)
    else:
        raise TokenizerError(f"tokenizer model type {kind!r:.60} is not one of BPE, WordPiece, WordLevel, Unigram")
    added = spec.get("added_tokens") or []
    if not isinstance(added, list) or not all(_is_added_token(t) for t in added):
        raise TokenizerError(f"added_tokens must be a list of objects with an integer id, a string content "
                             f"and true/false {', '.join(_ADDED_TOKEN_FLAGS)}")
    all_ids = list(ids) + [t["id"] for t in added]
    largest = max(all_ids, default=-1)
    if largest >= len(all_ids) + _ID_SLACK:
        raise TokenizerError(f"token id {largest} is far beyond the {len(all_ids)} tokens defined")
    return largest + 1


_ADDED_TOKEN_FLAGS = ("single_word", "lstrip", "rstrip", "normalized", "special")


def _is_added_token(t: Any) -> bool:
    return (isinstance(t, dict) and _is_id(t.get("id")) and isinstance(t.get("content"), str)
            and all(isinstance(t.get(flag), bool) for flag in _ADDED_TOKEN_FLAGS))


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_merges(merges: Any, vocab: dict[str, int]) -> None:
    """Each merge is "a b" or [a, b] (one form throughout), with a, b and a+b all in the vocabulary."""
    if not isinstance(merges, list):
        raise TokenizerError("BPE merges must be a list")
    if len({isinstance(m, str) for m in merges}) > 1:
        raise TokenizerError("BPE merges mix the \"a b\" and [a, b] forms")
    if _merges_fit(merges, vocab):
        return  # the common case, checked in bulk; the loop below names what is wrong
    for i, m in enumerate(merges):
        pair = m.split(" ") if isinstance(m, str) else m
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(p, str) for p in pair)):
            raise TokenizerError(f"BPE merge {i} ({m!r:.60}) is not two pieces")
        missing = next((p for p in (*pair, pair[0] + pair[1]) if p not in vocab), None)
        if missing is not None:
            raise TokenizerError(f"BPE merge {i} ({m!r:.60}) uses {missing!r:.60}, which is not in the vocabulary")


def _merges_fit(merges: list, vocab: dict[str, int]) -> bool:
    """Every merge is two strings whose parts and join are in `vocab`, checked with C-level
    maps and set operations (SmolLM2's 48,900 merges: a few ms against tens in a loop)."""
    pairs = list(map(str.split, merges, [" "] * len(merges))) if merges and isinstance(merges[0], str) else merges
    if not set(map(type, pairs)) <= {list} or not set(map(len, pairs)) <= {2}:
        return False
    left, right = [p[0] for p in pairs], [p[1] for p in pairs]
    if not set(map(type, left)) | set(map(type, right)) <= {str}:
        return False
    return vocab.keys() >= set(left) | set(right) | set(map(str.__add__, left, right))


def _hf_special_content(value: Any) -> str | None:
    content = value.get("content") if isinstance(value, dict) else value
    return content if isinstance(content, str) else None


def _hf_ids(value: Any, what: str, vocab_size: int) -> list[int]:
    """An id or a list of ids from a config file, checked to be in the vocabulary."""
    ids = value if isinstance(value, list) else [] if value is None else [value]
    for i in ids:
        if not _is_id(i) or i >= vocab_size:
            raise TokenizerError(f"{what} {i!r:.60} is not a token id below the vocabulary size {vocab_size}")
    return ids


def load_hf_tokenizer(path: str | os.PathLike) -> HFTokenizer:
    """tokenizer.json (a file or its folder) with tokenizer_config/generation_config beside it."""
    from tokenizers import Tokenizer as _Tok

    path = Path(path)
    folder, file = (path, path / "tokenizer.json") if path.is_dir() else (path.parent, path)
    with naming(file):
        text, spec = read_json_text(file, TokenizerError)
        vocab_size = check_tokenizer_json(spec)
        with _library_errors("tokenizers"):
            tok = _Tok.from_str(text)  # the text just checked, not a re-serialisation (tens of ms)
    byte_level = "ByteLevel" in json.dumps(spec.get("decoder")) or "ByteLevel" in json.dumps(spec.get("pre_tokenizer"))
    cfg, gen, model_cfg = (_read_json(folder / name) for name in
                           ("tokenizer_config.json", "generation_config.json", "config.json"))
    with naming(folder):
        return _hf_tokenizer_with_config(tok, byte_level, vocab_size, cfg, gen, model_cfg, file)


def _hf_tokenizer_with_config(tok: Any, byte_level: bool, vocab_size: int, cfg: dict, gen: dict, model_cfg: dict,
                              file: Path | None = None) -> HFTokenizer:

    def token_id(value: Any) -> int | None:
        content = _hf_special_content(value)
        return tok.token_to_id(content) if content else None

    bos_id = token_id(cfg.get("bos_token"))
    if bos_id is None:
        bos = _hf_ids(gen.get("bos_token_id", model_cfg.get("bos_token_id")), "bos_token_id", vocab_size)
        bos_id = bos[0] if bos else None
    eos: list[int] = []
    for name, source in (("generation_config.json eos_token_id", gen.get("eos_token_id")),
                         ("config.json eos_token_id", model_cfg.get("eos_token_id"))):
        eos.extend(_hf_ids(source, name, vocab_size))
    eos.extend(_hf_ids(token_id(cfg.get("eos_token")), "eos_token", vocab_size))
    template = cfg.get("chat_template")
    if isinstance(template, list):  # newer configs: a list of named templates
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    if template is not None and not isinstance(template, str):
        raise TokenizerError(f"chat_template is {type(template).__name__}, expected a string")
    with _library_errors("tokenizers"):
        if "add_bos_token" in cfg:
            add_bos = bool(cfg["add_bos_token"])
        else:  # does the tokenizer's own post-processor put BOS in front?
            ids = tok.encode("a", add_special_tokens=True).ids
            add_bos = bos_id is not None and bool(ids) and ids[0] == bos_id
        return HFTokenizer(tok, bos_id, eos, add_bos, template, byte_level, vocab_size, source=file)


def _read_json(path: Path) -> dict:
    return read_json_object(path, TokenizerError) if path.is_file() else {}


# llama.cpp's pre-tokenizer regexes, by ``tokenizer.ggml.pre`` (llama-vocab.cpp). Each regex
# in a list splits the pieces the previous ones produced, keeping matches and gaps.
_GPT2_RE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_RE = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
              r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_RE = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
             r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_REGEXES: dict[str, list[str]] = {
    "default": [r"[\p{P}\$\+<=>\^~\|]+", _GPT2_RE, r"\p{N}+", r"[0-9][0-9][0-9]"],
    "gpt2": [_GPT2_RE],
    "llama3": [_LLAMA3_RE],
    "qwen2": [_QWEN2_RE],
    "starcoder": [r"\p{N}", _GPT2_RE],
    "falcon": [r"[\p{P}\$\+<=>\^~\|`]+", _GPT2_RE, r"[0-9][0-9][0-9]"],
}
_PRE_ALIASES = {
    "gpt-2": "gpt2", "phi-2": "gpt2", "mpt": "gpt2", "olmo": "gpt2", "jais": "gpt2",
    "llama-bpe": "llama3", "llama-v3": "llama3", "falcon3": "llama3", "pixtral": "llama3",
    "dbrx": "llama3", "smaug-bpe": "llama3", "chatglm-bpe": "llama3",
    "deepseek-r1-qwen": "qwen2", "stablelm2": "qwen2", "megrez": "qwen2",
    "smollm": "starcoder", "refact": "starcoder", "command-r": "starcoder", "codeshell": "starcoder",
    "exaone": "starcoder", "minerva-7b": "starcoder",
}
# Pre-tokenizer kinds for which llama.cpp takes a whole pre-token from the vocab if present.
_IGNORE_MERGES = ("llama3",)


def gguf_bpe_tokenizer(meta: dict[str, Any]) -> HFTokenizer:
    """Rebuild a GGUF's gpt2-style byte-level BPE vocabulary as a `tokenizers` BPE."""
    from tokenizers import AddedToken, decoders, models
    from tokenizers import Tokenizer as _Tok

    tokens, types, _ = gguf_vocab(meta)
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise TokenizerError("GGUF vocabulary has duplicate tokens")
    pre_name = _gguf_meta(meta, "tokenizer.ggml.pre", str, "default")
    pre = _PRE_ALIASES.get(pre_name, pre_name)
    if pre not in _PRE_REGEXES:
        raise TokenizerError(f"GGUF pre-tokenizer {pre_name!r} is not supported (have {sorted(_PRE_REGEXES)} "
                             f"and aliases {sorted(_PRE_ALIASES)})")
    merges = _gguf_merges(_gguf_meta(meta, "tokenizer.ggml.merges", list, []), vocab)
    bos_id, eos_ids = _gguf_special_ids(meta, tokens, types)
    add_bos = _gguf_meta(meta, "tokenizer.ggml.add_bos_token", bool, pre == "llama3")
    template = _gguf_meta(meta, "tokenizer.chat_template", str, None)
    with _library_errors("tokenizers"):
        tok = _Tok(models.BPE(vocab, merges, ignore_merges=pre in _IGNORE_MERGES))
        tok.pre_tokenizer = _gguf_pre_tokenizer(pre)
        tok.decoder = decoders.ByteLevel()
        # Control (and unknown) tokens are parsed only with allow_special; user-defined ones always.
        tok.add_tokens([AddedToken(tokens[i], special=t in (CONTROL, UNKNOWN), normalized=False)
                        for i, t in enumerate(types) if t in (CONTROL, UNKNOWN, USER_DEFINED)])
        return HFTokenizer(tok, bos_id, eos_ids, add_bos, template, byte_level=True, vocab_size=len(tokens))


def _gguf_pre_tokenizer(pre: str) -> Any:
    """The pre-tokenizer for a GGUF pre-tokenizer kind, in the form HF's own tokenizer.json files
    use where one exists (gpt2: ByteLevel with its regex; starcoder/smollm: Digits + ByteLevel).
    Other C++ readers of the saved file understand those forms: ExecuTorch's HF tokenizer keeps
    only the matches of a lone ``Split(\\p{N}, isolated)`` and would drop every non-digit."""
    from tokenizers import Regex, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre in ("gpt2", "starcoder"))
    if pre == "gpt2":
        return byte_level
    if pre == "starcoder":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in _PRE_REGEXES[pre]] + [byte_level])


def _gguf_merges(merges: list, vocab: dict[str, int]) -> list[tuple[str, str]]:
    """"a b" strings split as llama.cpp does (at the first space after the first character),
    each checked to join two tokens of the vocabulary into a third."""
    pairs = []
    for i, m in enumerate(merges):
        cut = m.find(" ", 1) if isinstance(m, str) else -1
        if cut < 0:
            raise TokenizerError(f"GGUF merge {i} ({m!r:.60}) is not two tokens separated by a space")
        a, b = m[:cut], m[cut + 1 :]
        missing = next((t for t in (a, b, a + b) if t not in vocab), None)
        if missing is not None:
            raise TokenizerError(f"GGUF merge {i} ({m!r:.60}) uses {missing!r:.60}, which is not in the vocabulary")
        pairs.append((a, b))
    return pairs


def _gguf_meta(meta: dict[str, Any], key: str, kind: type, default: Any) -> Any:
    """A tokenizer metadata value checked to be of ``kind`` (bool is not an int here)."""
    value = meta.get(key, default)
    if value is not default and (not isinstance(value, kind) or (kind is int and isinstance(value, bool))):
        raise TokenizerError(f"GGUF metadata {key} is a {type(value).__name__}, expected {kind.__name__}")
    return value


def gguf_vocab(meta: dict[str, Any]) -> tuple[list[str], list[int], list[float]]:
    """The tokens, their types and scores, checked to be lists of one length."""
    tokens = _gguf_meta(meta, "tokenizer.ggml.tokens", list, None)
    if not tokens or not all(isinstance(t, str) for t in tokens):
        raise TokenizerError("GGUF metadata tokenizer.ggml.tokens must be a non-empty list of strings")
    n = len(tokens)
    types = _gguf_meta(meta, "tokenizer.ggml.token_type", list, None) or [NORMAL] * n
    scores = _gguf_meta(meta, "tokenizer.ggml.scores", list, None) or [0.0] * n
    if len(types) != n or not all(isinstance(t, int) and not isinstance(t, bool) for t in types):
        raise TokenizerError(f"GGUF metadata tokenizer.ggml.token_type must be {n} integers, one per token")
    if len(scores) != n or not all(_is_number(x) and abs(x) <= _F32_MAX for x in scores):
        raise TokenizerError(f"GGUF metadata tokenizer.ggml.scores must be {n} float32 numbers, one per token")
    return tokens, types, scores


def _gguf_special_id(meta: dict[str, Any], key: str, n_tokens: int, default: int | None = None) -> int | None:
    value = _gguf_meta(meta, f"tokenizer.ggml.{key}_token_id", int, default)
    if value is not None and not 0 <= value < n_tokens:
        raise TokenizerError(f"GGUF metadata tokenizer.ggml.{key}_token_id {value} is not below the "
                             f"vocabulary size {n_tokens}")
    return value


def _gguf_special_ids(meta: dict[str, Any], tokens: list[str], types: list[int]) -> tuple[int | None, list[int]]:
    n = len(tokens)
    bos_id = _gguf_special_id(meta, "bos", n)
    eos = [_gguf_special_id(meta, k, n) for k in ("eos", "eot", "eom")]
    eos += [i for i, t in enumerate(tokens) if t in _EOG_TEXTS and types[i] in (CONTROL, USER_DEFINED)]
    return bos_id, [e for e in eos if e is not None]


# ---------------------------------------------------------------------------------------
# SentencePiece (.model, GGUF llama-style, llama2.c tokenizer.bin)


class SentencePieceTokenizer(Tokenizer):
    def __init__(self, sp: Any, eos_ids: Sequence[int] = (), add_bos: bool = True,
                 chat_template: str | None = None) -> None:
        self._sp = sp
        self.bos_id = sp.bos_id() if sp.bos_id() >= 0 else None
        eos = ([sp.eos_id()] if sp.eos_id() >= 0 else []) + list(eos_ids)
        self.eos_ids = tuple(dict.fromkeys(eos))
        self.add_bos = add_bos
        self.chat_template = chat_template
        n = sp.get_piece_size()
        self.special_tokens = {sp.id_to_piece(i): i for i in range(n) if sp.is_control(i) or sp.is_unknown(i)}
        self._bytes = [self._piece_bytes(i) for i in range(n)]
        # SentencePiece puts a space (the dummy prefix) before the text it encodes, unless told not to.
        self._dummy_prefix = sp.encode("a", out_type=str)[:1] in (["▁a"], ["▁"])

    def _piece_bytes(self, i: int) -> bytes:
        piece = self._sp.id_to_piece(i)
        if self._sp.is_byte(i):
            m = _BYTE_PIECE.match(piece)
            if m is None:
                raise TokenizerError(f"SentencePiece byte piece {i} is {piece!r:.60}, expected <0xXX>")
            return bytes([int(m.group(1), 16)])
        if self._sp.is_control(i) or self._sp.is_unknown(i):
            return piece.encode()
        return piece.replace("▁", " ").encode()

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    def save(self, path: str | os.PathLike) -> None:
        atomic_write(path, self._sp.serialized_model_proto())

    def _encode(self, text: str, allow_special: bool) -> list[int]:
        # sentencepiece never matches control pieces in text, so split them out first; each
        # text fragment gets SentencePiece's dummy-prefix space, as llama.cpp does after a special.
        ids: list[int] = []
        for part in self._split_special(text, allow_special):
            ids.extend([part] if isinstance(part, int) else self._sp.encode(part))
        return ids

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        if skip_special:
            return self._sp.decode([i for i in ids if not self.is_special(i)])
        text = super().decode(ids, skip_special=False)
        if self._dummy_prefix and ids and not self.is_special(ids[0]) and text.startswith(" "):
            text = text[1:]  # the dummy prefix, as sp.decode and llama.cpp's detokenizer drop it
        return text

    def token_bytes(self, token_id: int, special: bool = False) -> bytes:
        if not special and self.is_special(token_id):
            return b""
        return self._bytes[token_id]


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # negative int32 values are written as 10-byte two's complement
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _pb_len(field: int, data: bytes) -> bytes:
    return _varint(field << 3 | 2) + _varint(len(data)) + data


def _pb_int(field: int, value: int) -> bytes:
    return _varint(field << 3) + _varint(value)


def sentencepiece_model_proto(
    pieces: Sequence[tuple[str, float, int]], unk_id: int, bos_id: int | None, eos_id: int | None,
    add_dummy_prefix: bool = True,
) -> bytes:
    """Serialize a SentencePiece BPE ModelProto (sentencepiece_model.proto field numbers).

    ``pieces`` are (piece, score, type) with the GGUF/SentencePiece type enum. Written by
    hand so that no protobuf package is needed.
    """
    _check_sp_pieces(pieces)
    body = bytearray()
    for piece, score, kind in pieces:
        body += _pb_len(1, _pb_len(1, piece.encode()) + _varint(2 << 3 | 5) + struct.pack("<f", score)
                        + _pb_int(3, kind))
    byte_fallback = any(k == BYTE for _, _, k in pieces)
    trainer = (_pb_int(3, 2)  # model_type = BPE
               + _pb_int(4, len(pieces))
               + _pb_int(35, int(byte_fallback))
               + _pb_int(40, unk_id)
               + _pb_int(41, -1 if bos_id is None else bos_id)
               + _pb_int(42, -1 if eos_id is None else eos_id)
               + _pb_int(43, -1)
               + _pb_len(45, pieces[unk_id][0].encode()))
    if bos_id is not None:
        trainer += _pb_len(46, pieces[bos_id][0].encode())
    if eos_id is not None:
        trainer += _pb_len(47, pieces[eos_id][0].encode())
    normalizer = (_pb_len(1, b"identity") + _pb_int(3, int(add_dummy_prefix))
                  + _pb_int(4, 0) + _pb_int(5, 1))  # keep whitespace runs, escape spaces as ▁
    body += _pb_len(2, trainer) + _pb_len(3, normalizer)
    return bytes(body)


def _check_sp_pieces(pieces: Sequence[tuple[str, float, int]]) -> None:
    """What SentencePiece demands of pieces: non-empty, no NUL, and byte pieces spelled
    <0xXX>, all 256 of them or none (byte fallback needs every byte)."""
    for i, (piece, _, kind) in enumerate(pieces):
        if not piece or "\0" in piece:
            raise TokenizerError(f"piece {i} is {piece!r:.60}; pieces are non-empty, without NUL")
        if kind == BYTE and not _BYTE_PIECE.match(piece):
            raise TokenizerError(f"piece {i} ({piece!r:.60}) has the byte type but is not spelled <0xXX>")
    n_bytes = len({p for p, _, k in pieces if k == BYTE})
    if n_bytes not in (0, 256):
        raise TokenizerError(f"{n_bytes} distinct byte pieces; byte fallback needs all 256 (<0x00> to <0xFF>)")


def _read_varint(data: bytes, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= end or shift > 63:
            raise TokenizerError(f"protobuf varint at byte {pos} is cut off or longer than 10 bytes")
        byte = data[pos]
        value |= (byte & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
        if not byte & 0x80:
            return value, pos


def _protobuf_fields(data: bytes, start: int, end: int) -> Iterator[tuple[int, int, Any]]:
    """(field number, wire type, value) of a protobuf message in data[start:end]; the value of
    a length-delimited field is its (start, end) span. Every length is checked against end."""
    pos = start
    while pos < end:
        key, pos = _read_varint(data, pos, end)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _read_varint(data, pos, end)
        elif wire in (1, 5):
            size = 8 if wire == 1 else 4
            if pos + size > end:
                raise TokenizerError(f"protobuf field {field} at byte {pos} runs past its message")
            value, pos = data[pos : pos + size], pos + size
        elif wire == 2:
            n, pos = _read_varint(data, pos, end)
            if n > end - pos:
                raise TokenizerError(f"protobuf field {field} at byte {pos} says {n} bytes, {end - pos} are left")
            value, pos = (pos, pos + n), pos + n
        else:
            raise TokenizerError(f"protobuf field {field} before byte {pos} has wire type {wire}, "
                                 "which a SentencePiece model does not use")
        yield field, wire, value


# SentencePiece ModelProto: 1 pieces {1 piece, 2 score, 3 type}; 2 trainer_spec, 3 normalizer_spec,
# 4 self_test_data, 5 denormalizer_spec (messages whose wire format is checked, not their contents).
_SP_MESSAGES = (2, 3, 4, 5)


def check_sentencepiece_model(data: bytes) -> None:
    """The structure of a SentencePiece .model: well-formed protobuf, pieces that are
    non-empty distinct UTF-8 strings. What is left (the specs' values) SentencePiece checks."""
    seen: set[str] = set()
    for field, wire, value in _protobuf_fields(data, 0, len(data)):
        if field == 0:
            raise TokenizerError("SentencePiece model has a protobuf field numbered 0")
        if (field == 1 or field in _SP_MESSAGES) and wire != 2:
            raise TokenizerError(f"SentencePiece model field {field} has wire type {wire}, expected a message")
        if field == 1:
            piece = _sp_piece(data, *value, index=len(seen))
            if piece in seen:
                raise TokenizerError(f"SentencePiece piece {len(seen)} ({piece!r:.60}) appears twice")
            seen.add(piece)
        elif field in _SP_MESSAGES:
            for _ in _protobuf_fields(data, *value):
                pass
        # other fields are unknown to this version and skipped, as protobuf does
    if not seen:
        raise TokenizerError("SentencePiece model has no pieces")


def _sp_piece(data: bytes, start: int, end: int, index: int) -> str:
    piece = None
    for field, wire, value in _protobuf_fields(data, start, end):
        if field == 1 and wire == 2:
            try:
                piece = data[value[0] : value[1]].decode("utf-8")
            except UnicodeDecodeError as e:
                raise TokenizerError(f"SentencePiece piece {index} is not UTF-8 (byte {value[0] + e.start})") from e
    if not piece or "\0" in piece:
        raise TokenizerError(f"SentencePiece piece {index} is {piece!r:.60}; pieces are non-empty, without NUL")
    return piece


def _sp_tokenizer(proto: bytes, eos_ids: Sequence[int] = (), add_bos: bool = True,
                  chat_template: str | None = None) -> SentencePieceTokenizer:
    """A SentencePiece model from its serialized proto (what a .model file holds)."""
    import sentencepiece as spm

    with _library_errors("SentencePiece"):
        sp = spm.SentencePieceProcessor()
        sp.LoadFromSerializedProto(proto)
        return SentencePieceTokenizer(sp, eos_ids, add_bos, chat_template)


def gguf_spm_tokenizer(meta: dict[str, Any]) -> SentencePieceTokenizer:
    """Rebuild a GGUF's llama-style (SentencePiece BPE) vocabulary as a SentencePiece model."""
    tokens, types, scores = gguf_vocab(meta)
    if len(set(tokens)) != len(tokens):
        raise TokenizerError("GGUF vocabulary has duplicate pieces; SentencePiece cannot load it")
    n = len(tokens)
    unk = _gguf_special_id(meta, "unknown", n, min(0, n - 1))
    bos, eos = _gguf_special_id(meta, "bos", n, min(1, n - 1)), _gguf_special_id(meta, "eos", n, min(2, n - 1))
    proto = sentencepiece_model_proto(list(zip(tokens, scores, types)), unk, bos, eos, add_dummy_prefix=bool(
        _gguf_meta(meta, "tokenizer.ggml.add_space_prefix", bool, True)))
    _, eos_ids = _gguf_special_ids(meta, tokens, types)
    return _sp_tokenizer(proto, eos_ids, add_bos=_gguf_meta(meta, "tokenizer.ggml.add_bos_token", bool, True),
                         chat_template=_gguf_meta(meta, "tokenizer.chat_template", str, None))


def load_sentencepiece(path: str | os.PathLike) -> SentencePieceTokenizer:
    data = Path(path).read_bytes()
    check_sentencepiece_model(data)
    return _sp_tokenizer(data)


def read_llama2c_tokenizer(path: str | os.PathLike) -> list[tuple[str, float]]:
    """(piece, score) records of a llama2.c tokenizer.bin: int32 max_len, then per token
    float32 score, int32 length, bytes."""
    data = Path(path).read_bytes()
    pos, out = 4, []
    while pos < len(data):
        if pos + 8 > len(data):
            raise TokenizerError(f"{path}: truncated llama2.c tokenizer record at byte {pos}")
        score, length = struct.unpack_from("<fi", data, pos)
        pos += 8
        if not 0 <= length <= len(data) - pos:
            raise TokenizerError(f"{path}: token {len(out)} at byte {pos - 8} says it is {length} bytes long, "
                                 f"but {len(data) - pos} bytes are left")
        try:
            out.append((data[pos : pos + length].decode("utf-8"), score))
        except UnicodeDecodeError as e:
            raise TokenizerError(f"{path}: token {len(out)} at byte {pos} is not UTF-8") from e
        pos += length
    if len(out) < 3:
        raise TokenizerError(f"{path}: {len(out)} tokens; a llama2.c vocabulary starts with unk, bos and eos")
    return out


def load_llama2c(path: str | os.PathLike) -> SentencePieceTokenizer:
    """llama2.c's export of a SentencePiece vocabulary, converted back into one.

    llama2.c writes ``▁`` as a space and BOS/EOS as "\\n<s>\\n" / "\\n</s>\\n"; ids 0, 1, 2
    are unk, bos, eos, and pieces spelled <0xXX> are the byte-fallback tokens.
    """
    records = read_llama2c_tokenizer(path)
    pieces = []
    for i, (text, score) in enumerate(records):
        if i in (0, 1, 2):
            pieces.append((("<unk>", "<s>", "</s>")[i], score, (UNKNOWN, CONTROL, CONTROL)[i]))
        elif _BYTE_PIECE.match(text):
            pieces.append((text, score, BYTE))
        else:
            pieces.append((text.replace(" ", "▁"), score, NORMAL))
    return _sp_tokenizer(sentencepiece_model_proto(pieces, 0, 1, 2))


# ---------------------------------------------------------------------------------------
# tiktoken (Llama 3 tokenizer.model)

LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_NUM_SPECIAL = 256
LLAMA3_CHAT_TEMPLATE = (
    "{% for message in messages %}{% set content = '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)


def llama3_special_tokens() -> list[str]:
    """Llama 3.1's 256 special token names, in id order after the base vocabulary."""
    named = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
             "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|reserved_special_token_2|>",
             "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]
    return named + [f"<|reserved_special_token_{3 + i}|>" for i in range(LLAMA3_NUM_SPECIAL - len(named))]


class TiktokenTokenizer(Tokenizer):
    def __init__(self, ranks: dict[bytes, int], name: str = "llama3") -> None:
        import tiktoken

        self._ranks = ranks
        base = len(ranks)
        self.special_tokens = {t: base + i for i, t in enumerate(llama3_special_tokens())}
        with _library_errors("tiktoken"):
            self._enc = tiktoken.Encoding(name=name, pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks,
                                          special_tokens=self.special_tokens)
        self.bos_id = self.special_tokens["<|begin_of_text|>"]
        self.eos_ids = tuple(self.special_tokens[t] for t in ("<|end_of_text|>", "<|eot_id|>", "<|eom_id|>"))
        self.add_bos = True
        self.chat_template = LLAMA3_CHAT_TEMPLATE

    @property
    def vocab_size(self) -> int:
        return self._enc.n_vocab

    def save(self, path: str | os.PathLike) -> None:
        lines = (f"{base64.b64encode(t).decode()} {r}\n" for t, r in sorted(self._ranks.items(), key=lambda kv: kv[1]))
        atomic_write(path, "".join(lines))

    def _encode(self, text: str, allow_special: bool) -> list[int]:
        return self._enc.encode(text, allowed_special="all" if allow_special else set(), disallowed_special=())

    def token_bytes(self, token_id: int, special: bool = False) -> bytes:
        if not special and self.is_special(token_id):
            return b""
        return self._enc.decode_single_token_bytes(token_id)


def read_tiktoken_ranks(path: str | os.PathLike) -> dict[bytes, int]:
    """token -> rank, checked as byte-level BPE needs: distinct tokens ranked 0..n-1, every
    single byte among them (so any text can be encoded)."""
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(Path(path).read_bytes().splitlines(), 1):
        if not line:
            continue
        try:
            token, rank = line.split()
            token, rank = base64.b64decode(token, validate=True), int(rank)
        except ValueError as e:
            raise TokenizerError(f"{path}:{lineno}: not a tiktoken 'base64 rank' line") from e
        if not token or token in ranks:
            raise TokenizerError(f"{path}:{lineno}: token {token!r:.60} is empty or listed twice")
        ranks[token] = rank
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise TokenizerError(f"{path}: the ranks of the {len(ranks)} tokens are not 0..{len(ranks) - 1}, each once")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise TokenizerError(f"{path}: {len(missing)} single bytes (first {missing[0]:#04x}) have no token")
    return ranks


def _is_tiktoken_file(path: Path) -> bool:
    with open(path, "rb") as fh:
        first = fh.readline(512).split()
    try:
        return len(first) == 2 and int(first[1]) >= 0 and bool(base64.b64decode(first[0], validate=True))
    except ValueError:
        return False


# ---------------------------------------------------------------------------------------


def load_tokenizer(path: Any, *, bos_id: int | None = None, eos_ids: Sequence[int] | None = None,
                   add_bos: bool | None = None, chat_template: str | None = None) -> Tokenizer:
    """The tokenizer in a file or folder (see the module docstring), or embedded in a GGUF.

    ``path`` may also be an already opened ``execupy.llm.gguf_loader.GGUFFile``. The keyword
    arguments, when given, replace what the files say (a runner passes the values stored in
    the program's metadata).
    """
    with naming(path.path if hasattr(path, "metadata") else path):  # a GGUFFile or a path
        tok = _load_tokenizer(path)
    if bos_id is not None:
        tok.bos_id = bos_id
    if eos_ids is not None:
        tok.eos_ids = tuple(eos_ids)
    if add_bos is not None:
        tok.add_bos = add_bos
    if chat_template is not None:
        tok.chat_template = chat_template
    return tok


def _load_tokenizer(path: Any) -> Tokenizer:
    if hasattr(path, "metadata") and hasattr(path, "tensors"):  # an opened GGUFFile
        return tokenizer_from_gguf_metadata(path.metadata)
    path = Path(path)
    if path.is_dir():
        for name in ("tokenizer.json", "tokenizer.model", "tokenizer.bin"):
            if (path / name).is_file():
                return load_hf_tokenizer(path) if name == "tokenizer.json" else _load_tokenizer(path / name)
        raise TokenizerError(f"{path}: no tokenizer.json, tokenizer.model or tokenizer.bin")
    if not path.is_file():
        raise TokenizerError(f"{path}: no such tokenizer file")
    if path.suffix == ".gguf":
        from execupy.llm.gguf_loader import GGUFFile

        return tokenizer_from_gguf_metadata(GGUFFile(path, metadata_only=True).metadata)
    if path.suffix == ".json":
        return load_hf_tokenizer(path)
    if path.suffix == ".bin":
        return load_llama2c(path)
    if _is_tiktoken_file(path):
        return TiktokenTokenizer(read_tiktoken_ranks(path))
    return load_sentencepiece(path)


def tokenizer_from_gguf_metadata(meta: dict[str, Any]) -> Tokenizer:
    kind = _gguf_meta(meta, "tokenizer.ggml.model", str, None)
    if kind == "gpt2":
        return gguf_bpe_tokenizer(meta)
    if kind == "llama":
        return gguf_spm_tokenizer(meta)
    raise TokenizerError(f"GGUF tokenizer model {kind!r} is not supported (have 'gpt2' and 'llama')")
