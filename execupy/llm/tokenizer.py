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
"""

from __future__ import annotations

import base64
import codecs
import json
import os
import re
import struct
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Sequence

from execupy.errors import TokenizerError  # noqa: F401  (re-exported)
from execupy.fileio import atomic_write


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
_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


class HFTokenizer(Tokenizer):
    """A `tokenizers.Tokenizer` plus the model-level facts tokenizer.json does not hold."""

    def __init__(self, tok: Any, bos_id: int | None, eos_ids: Sequence[int], add_bos: bool,
                 chat_template: str | None, byte_level: bool) -> None:
        self._tok = tok
        self.bos_id = bos_id
        self.eos_ids = tuple(dict.fromkeys(eos_ids))
        self.add_bos = add_bos
        self.chat_template = chat_template
        self._byte_level = byte_level  # else SentencePiece-style pieces ("▁" and <0xXX>)
        added = tok.get_added_tokens_decoder()
        self.special_tokens = {t.content: i for i, t in added.items() if t.special}
        self._added = {i: t.content for i, t in added.items()}
        self._pieces = [tok.id_to_token(i) for i in range(tok.get_vocab_size(with_added_tokens=True))]

    @property
    def vocab_size(self) -> int:
        return len(self._pieces)

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
        piece = self._pieces[token_id]
        if piece is None:
            return b""
        if self._byte_level:
            return bytes(_BYTE_DECODER[c] for c in piece)
        m = _BYTE_PIECE.match(piece)
        return bytes([int(m.group(1), 16)]) if m else piece.replace("▁", " ").encode()


def _hf_special_content(value: Any) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def load_hf_tokenizer(path: str | os.PathLike) -> HFTokenizer:
    """tokenizer.json (a file or its folder) with tokenizer_config/generation_config beside it."""
    from tokenizers import Tokenizer as _Tok

    path = Path(path)
    folder, file = (path, path / "tokenizer.json") if path.is_dir() else (path.parent, path)
    tok = _Tok.from_file(str(file))
    spec = json.loads(file.read_text())
    byte_level = "ByteLevel" in json.dumps(spec.get("decoder")) or "ByteLevel" in json.dumps(spec.get("pre_tokenizer"))
    cfg = _read_json(folder / "tokenizer_config.json")
    gen = _read_json(folder / "generation_config.json")
    model_cfg = _read_json(folder / "config.json")

    def token_id(value: Any) -> int | None:
        content = _hf_special_content(value)
        return tok.token_to_id(content) if content else None

    bos_id = token_id(cfg.get("bos_token"))
    if bos_id is None:
        bos_id = gen.get("bos_token_id", model_cfg.get("bos_token_id"))
    eos: list[int] = []
    for source in (gen.get("eos_token_id"), model_cfg.get("eos_token_id"), token_id(cfg.get("eos_token"))):
        eos.extend(source if isinstance(source, list) else [source] if source is not None else [])
    if "add_bos_token" in cfg:
        add_bos = bool(cfg["add_bos_token"])
    else:  # does the tokenizer's own post-processor put BOS in front?
        ids = tok.encode("a", add_special_tokens=True).ids
        add_bos = bos_id is not None and bool(ids) and ids[0] == bos_id
    template = cfg.get("chat_template")
    if isinstance(template, list):  # newer configs: a list of named templates
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return HFTokenizer(tok, bos_id, eos, add_bos, template, byte_level)


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


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
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as _Tok

    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    pre_name = meta.get("tokenizer.ggml.pre", "default")
    pre = _PRE_ALIASES.get(pre_name, pre_name)
    if pre not in _PRE_REGEXES:
        raise TokenizerError(f"GGUF pre-tokenizer {pre_name!r} is not supported (have {sorted(_PRE_REGEXES)} "
                             f"and aliases {sorted(_PRE_ALIASES)})")
    merges = []
    for m in meta.get("tokenizer.ggml.merges", []):
        cut = m.find(" ", 1)  # as llama.cpp: the first space after the first character
        merges.append((m[:cut], m[cut + 1 :]))
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = _Tok(models.BPE(vocab, merges, ignore_merges=pre in _IGNORE_MERGES))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in _PRE_REGEXES[pre]]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    # Control (and unknown) tokens are parsed only with allow_special; user-defined ones always.
    tok.add_tokens([AddedToken(tokens[i], special=t in (CONTROL, UNKNOWN), normalized=False)
                    for i, t in enumerate(types) if t in (CONTROL, UNKNOWN, USER_DEFINED)])
    bos_id, eos_ids = _gguf_special_ids(meta, tokens, types)
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", pre == "llama3"))
    return HFTokenizer(tok, bos_id, eos_ids, add_bos, meta.get("tokenizer.chat_template"), byte_level=True)


def _gguf_special_ids(meta: dict[str, Any], tokens: list[str], types: list[int]) -> tuple[int | None, list[int]]:
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    eos = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    eos += [i for i, t in enumerate(tokens) if t in _EOG_TEXTS and types[i] in (CONTROL, USER_DEFINED)]
    return (None if bos_id is None else int(bos_id)), [int(e) for e in eos if e is not None]


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
            return bytes([int(piece[3:5], 16)])
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
    body = bytearray()
    for piece, score, kind in pieces:
        body += _pb_len(1, _pb_len(1, piece.encode()) + _varint(2 << 3 | 5) + struct.pack("<f", score)
                        + _pb_int(3, kind))
    byte_fallback = sum(1 for _, _, k in pieces if k == BYTE) == 256
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


def _sp_from_proto(proto: bytes) -> Any:
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor()
    try:
        sp.LoadFromSerializedProto(proto)
    except (RuntimeError, OSError) as e:
        raise TokenizerError(f"SentencePiece rejected the vocabulary: {e}") from e
    return sp


def gguf_spm_tokenizer(meta: dict[str, Any]) -> SentencePieceTokenizer:
    """Rebuild a GGUF's llama-style (SentencePiece BPE) vocabulary as a SentencePiece model."""
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    types = meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    if len(set(tokens)) != len(tokens):
        raise TokenizerError("GGUF vocabulary has duplicate pieces; SentencePiece cannot load it")
    unk = int(meta.get("tokenizer.ggml.unknown_token_id", 0))
    bos, eos = meta.get("tokenizer.ggml.bos_token_id", 1), meta.get("tokenizer.ggml.eos_token_id", 2)
    proto = sentencepiece_model_proto(list(zip(tokens, scores, types)), unk, bos, eos,
                                      add_dummy_prefix=bool(meta.get("tokenizer.ggml.add_space_prefix", True)))
    _, eos_ids = _gguf_special_ids(meta, tokens, types)
    return SentencePieceTokenizer(_sp_from_proto(proto), eos_ids,
                                  add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", True)),
                                  chat_template=meta.get("tokenizer.chat_template"))


def load_sentencepiece(path: str | os.PathLike) -> SentencePieceTokenizer:
    import sentencepiece as spm

    return SentencePieceTokenizer(spm.SentencePieceProcessor(model_file=str(path)))


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
        out.append((data[pos : pos + length].decode("utf-8", errors="replace"), score))
        pos += length
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
    return SentencePieceTokenizer(_sp_from_proto(sentencepiece_model_proto(pieces, 0, 1, 2)))


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
    ranks = {}
    for lineno, line in enumerate(Path(path).read_bytes().splitlines(), 1):
        if not line:
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError as e:
            raise TokenizerError(f"{path}:{lineno}: not a tiktoken 'base64 rank' line") from e
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

        return tokenizer_from_gguf_metadata(GGUFFile(path).metadata)
    if path.suffix == ".json":
        return load_hf_tokenizer(path)
    if path.suffix == ".bin":
        return load_llama2c(path)
    if _is_tiktoken_file(path):
        return TiktokenTokenizer(read_tiktoken_ranks(path))
    return load_sentencepiece(path)


def tokenizer_from_gguf_metadata(meta: dict[str, Any]) -> Tokenizer:
    kind = meta.get("tokenizer.ggml.model")
    if kind == "gpt2":
        return gguf_bpe_tokenizer(meta)
    if kind == "llama":
        return gguf_spm_tokenizer(meta)
    raise TokenizerError(f"GGUF tokenizer model {kind!r} is not supported (have 'gpt2' and 'llama')")
