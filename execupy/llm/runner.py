"""Run an exported LLM (.pte from ``execupy.llm.export``) with the numpy runtime (torch-free).

    runner = LLMRunner("smollm2.pte")          # finds smollm2.tokenizer.json next to it
    text = runner.generate("The capital of France is", max_new_tokens=32, callback=print)
    print(runner.stats.report())

The program's ``forward(tokens [1, T], input_pos [1])`` keeps the KV cache in its mutable
buffers, so the runner only tracks ``pos``, the number of tokens the cache holds. A prompt
longer than the program's max prefill length is fed in chunks. ``chat`` appends each turn
after the previous ones, reusing the cache (input_pos continues); ``reset`` starts over.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import numpy as np

from execupy.errors import InvalidInputError
from execupy.llm.sampler import Sampler, SamplerConfig
from execupy.runtime import Module, TensorInfo, collector
from execupy.runtime.heap import page_out_compiler, trim_heap

if TYPE_CHECKING:
    from execupy.llm.tokenizer import StreamDecoder


class ContextLengthError(InvalidInputError):
    """The prompt plus the tokens to generate do not fit the program's context."""


def peak_memory_mb() -> float:
    """Peak resident set size of this process in MiB (0 where the OS does not tell)."""
    try:
        import resource
    except ImportError:  # Windows
        return 0.0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1 << 20) if sys.platform == "darwin" else peak / 1024  # bytes on macOS, KiB on Linux


@dataclass
class GenerationStats:
    load_s: float = 0.0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_s: float = 0.0  # the prompt's forward calls
    time_to_first_token_s: float = 0.0  # from the start of generate() to the first new token
    decode_s: float = 0.0  # every forward call after the first new token
    stop_reason: str = ""  # "eos", "stop_string", "max_new_tokens" or "context"
    peak_memory_mb: float = 0.0  # the process's peak resident memory so far

    @property
    def prompt_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        # The first new token comes from the prefill; each later one costs one decode call.
        steps = max(self.generated_tokens - 1, 0)
        return steps / self.decode_s if self.decode_s else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "prompt_tokens_per_s": self.prompt_tokens_per_s,
                "decode_tokens_per_s": self.decode_tokens_per_s}

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    def report(self) -> str:
        return (f"load {self.load_s:.2f} s | prompt {self.prompt_tokens} tokens in {self.prefill_s:.2f} s "
                f"({self.prompt_tokens_per_s:.1f} tok/s) | first token after {self.time_to_first_token_s:.2f} s | "
                f"generated {self.generated_tokens} tokens ({self.decode_tokens_per_s:.1f} tok/s decode) | "
                f"stop: {self.stop_reason} | peak memory {self.peak_memory_mb:.0f} MiB")


@dataclass
class ModelMetadata:
    max_seq_len: int
    max_prefill_len: int
    vocab_size: int
    bos_id: Optional[int]
    eos_ids: tuple[int, ...]
    add_bos: bool
    chat_template: Optional[str]
    extra: dict = field(default_factory=dict)


def read_metadata(module: Module) -> ModelMetadata:
    """The constant methods an LLM export writes (ours or ExecuTorch's ``export_llm``);
    absent ones get safe defaults."""
    names = set(module.method_names)

    def get(name: str, default):
        return module.run_method(name) if name in names else default

    if "forward" not in names:
        raise InvalidInputError("this program has no 'forward' method; is it an LLM export?")
    if not get("use_kv_cache", False):
        raise InvalidInputError("this program has no KV cache (use_kv_cache is false); the runner needs one")
    # ExecuTorch's export_llm writes the cache length as get_max_context_len; its
    # get_max_seq_len is the most tokens one call takes. Ours writes both as the cache length.
    max_seq_len = int(get("get_max_context_len", 0) or get("get_max_seq_len", 0))
    if max_seq_len <= 0:
        raise InvalidInputError("this program has no get_max_context_len or get_max_seq_len method; "
                                "is it an LLM export?")
    bos = int(get("get_bos_id", -1))
    return ModelMetadata(
        max_seq_len=max_seq_len,
        max_prefill_len=int(get("get_max_prefill_len", 0) or _tokens_per_call(module)),
        vocab_size=int(get("get_vocab_size", 0)),
        bos_id=bos if bos >= 0 else None,
        eos_ids=tuple(int(i) for i in get("get_eos_ids", [])),
        add_bos=bool(get("get_add_bos", False)),
        chat_template=get("get_chat_template", "") or None,
    )


def _tokens_per_call(module: Module) -> int:
    """The most tokens forward takes at once, read from its token input [1, T]: the upper
    bound of T when it is dynamic (ExecuTorch's export_llm writes no get_max_prefill_len), else
    1, which is always safe for a KV-cache program."""
    inputs = module.program.method_meta("forward").inputs
    tokens = inputs[0] if inputs else None
    if isinstance(tokens, TensorInfo) and tokens.dynamic and len(tokens.shape) == 2:
        return tokens.shape[1]
    return 1


def find_tokenizer(pte_path: str | os.PathLike) -> Path:
    """The tokenizer file the exporter writes next to the program."""
    pte_path = Path(pte_path)
    for suffix in (".tokenizer.json", ".tokenizer.model"):
        candidate = pte_path.with_name(pte_path.stem + suffix)
        if candidate.is_file():
            return candidate
    raise InvalidInputError(f"no tokenizer next to {pte_path} (looked for {pte_path.stem}.tokenizer.json/.model); "
                            "pass one with --tokenizer")


@dataclass(frozen=True)
class StopRule:
    """Why generation ends. One place decides, after each new token, in this order."""

    eos_ids: frozenset[int]  # empty with ignore_eos
    stop_strings: tuple[str, ...]
    max_new_tokens: int
    max_seq_len: int

    def why_stop(self, token: int, n_new: int, text: str, piece: str, cache_len: int) -> Optional[str]:
        """The stop reason once ``token``, the ``n_new``-th new one, has been sampled (its text
        ``piece`` ends ``text``), or None to go on. The cache holds ``cache_len`` tokens, not
        ``token`` yet."""
        if token in self.eos_ids:
            return "eos"
        if piece and self.stop_strings:
            recent = text[-(len(piece) + max(map(len, self.stop_strings))):]  # where a new match can be
            if any(s in recent for s in self.stop_strings):
                return "stop_string"
        if n_new >= self.max_new_tokens:
            return "max_new_tokens"
        if cache_len + 1 > self.max_seq_len:  # no room to feed ``token`` and decode another
            return "context"
        return None


class TextStream:
    """The generated text, sent to ``callback`` piece by piece as tokens come. Tokens in
    ``hidden`` (the EOS tokens that end generation) add no text."""

    def __init__(self, decoder: StreamDecoder, callback: Optional[Callable[[str], None]],
                 hidden: frozenset[int]) -> None:
        self.decoder, self.callback, self.hidden = decoder, callback, hidden
        self.text = ""

    def put(self, token: int) -> str:
        """Stream ``token``'s text (possibly '' while a UTF-8 character is incomplete); returns it."""
        piece = "" if token in self.hidden else self.decoder.put(token)
        self._emit(piece)
        return piece

    def flush(self) -> None:
        self._emit(self.decoder.flush())

    def _emit(self, piece: str) -> None:
        if piece:
            self.text += piece
            if self.callback is not None:
                self.callback(piece)


class LLMRunner:
    def __init__(self, pte_path: str | os.PathLike, tokenizer_path: str | os.PathLike | None = None,
                 event_tracer=None) -> None:
        """`event_tracer` (execupy.devtools.tracer.EventTracer) traces the forward calls only
        (not the metadata methods read here), so its Execute blocks are the model's calls."""
        from execupy.llm.tokenizer import load_tokenizer

        t0 = time.perf_counter()
        self.module = Module(str(pte_path))
        self.meta = read_metadata(self.module)
        m = self.meta
        self.forward = self.module.program.load_method("forward", event_tracer=event_tracer)
        page_out_compiler()  # the kernels the forward method calls are loaded: LLVM is done
        with collector.paused():  # a tokenizer.json is 100,000s of small objects (runtime/collector.py)
            self.tokenizer = load_tokenizer(tokenizer_path or find_tokenizer(pte_path), bos_id=m.bos_id,
                                            eos_ids=m.eos_ids, add_bos=m.add_bos, chat_template=m.chat_template)
        # Checking a tokenizer.json builds tens of MiB of Python objects, garbage once the
        # tokenizer is made (freed as their counts drop: a full collection here found none, in
        # 48 ms); glibc keeps freed memory mapped (SmolLM2: 31 MiB while generating) unless asked.
        trim_heap()
        # The weights' pages mapped in now, not faulted in by the first prompt, and not while the
        # tokenizer parses: the two at once made the peak (SmolLM2 fp32: 50 MiB of JSON objects on
        # top of the whole program). Joined: fp32's first prompt beside it ran ~10% slower (noisy)
        populating = self.module.program.populate_in_background()
        if populating is not None:
            populating.join()
        self.pos = 0  # tokens held by the KV cache
        self.history: list[int] = []  # those tokens, for the repetition penalty
        if event_tracer is None:  # (a traced run reports the calls the user made, no more)
            self._bind_decode_step()
        self.load_s = time.perf_counter() - t0
        self.pending: list[int] = []  # the last sampled token, not yet in the cache
        self.cached_text = ""  # the chat as rendered text, for what the cache holds
        self.messages: list[dict[str, str]] = []  # the chat so far
        self.stats = GenerationStats(load_s=self.load_s)

    def _bind_decode_step(self) -> None:
        """One token's call now, at load: the runtime binds a call shape's steps at its first
        call (kernels and arrays fixed once; SmolLM2: 40-70 ms, the call itself on the general
        path), which would otherwise fall inside the first generated token. The token goes into
        the cache's last slot, which only a query at that position reads, after writing it itself:
        every slot a prompt or a decode step can read still holds the program's initial value."""
        self.pos = self.meta.max_seq_len - 1
        self.forward_rows([self.meta.bos_id or 0])
        self.pos, self.history = 0, []

    # ------------------------------------------------------------------ low level

    def reset(self) -> None:
        """Forget the conversation. The cache need not be zeroed: the causal mask never lets a
        query see positions beyond its own, and those get rewritten before they are read."""
        self.pos = 0
        self.history = []
        self.pending = []
        self.cached_text = ""
        self.messages = []

    def _forward(self, tokens: Sequence[int]) -> np.ndarray:
        """One call: append ``tokens`` at ``self.pos``; the logits after the last one."""
        return self.forward_rows(tokens)[-1]

    def forward_rows(self, tokens: Sequence[int]) -> np.ndarray:
        """One call: append ``tokens`` at ``self.pos``; every row of logits the program returns,
        ``[T, vocab]`` from a program exported with ``generate_full_logits``, else ``[1, vocab]``
        (the last position's)."""
        inputs = [np.asarray([tokens], dtype=np.int64), np.asarray([self.pos], dtype=np.int64)]
        logits = self.forward.execute(inputs)[0]  # [1, T or 1, vocab]
        self.pos += len(tokens)
        self.history.extend(int(t) for t in tokens)
        return np.asarray(logits).reshape(-1, logits.shape[-1])

    @property
    def full_logits(self) -> bool:
        """Whether forward returns a row of logits per token fed (``generate_full_logits``):
        its output's token axis is as long as the most tokens a call takes."""
        out = self.module.program.method_meta("forward").outputs
        shape = out[0].shape if out and isinstance(out[0], TensorInfo) else ()
        return len(shape) == 3 and shape[1] == self.meta.max_prefill_len > 1

    def prefill(self, tokens: Sequence[int], before_chunk: Optional[Callable[[], None]] = None) -> np.ndarray:
        """Feed a prompt in chunks of at most max_prefill_len; the last position's logits.
        ``before_chunk`` runs before each chunk and may raise to stop a long prefill (a
        server whose client left)."""
        if not tokens:
            raise InvalidInputError("empty prompt: nothing to condition on")
        self._check_room(len(tokens))
        trim_heap()  # before the weights come in: what was freed since loading (a released encoder)
        step = self.meta.max_prefill_len
        logits = None
        for start in range(0, len(tokens), step):
            if before_chunk is not None:
                before_chunk()
            logits = self._forward(tokens[start:start + step])
        trim_heap()
        return logits

    def reuse_prefix(self, tokens: Sequence[int]) -> int:
        """Keep the longest start of the KV cache that ``tokens`` also starts with (the usual
        next turn of a conversation), forget the rest, and return its length: the caller
        then feeds ``tokens[n:]`` only. At least one token is always left to feed, since
        the next token's logits come from feeding one."""
        limit = min(len(self.history), len(tokens) - 1)
        n = 0
        while n < limit and self.history[n] == tokens[n]:
            n += 1
        self.pos, self.history, self.pending = n, self.history[:n], []
        self.cached_text, self.messages = "", []  # chat()'s view of the cache no longer holds
        return n

    def _check_room(self, n: int) -> None:
        if self.pos + n > self.meta.max_seq_len:
            raise ContextLengthError(
                f"context length exceeded: {self.pos} tokens already in the cache + {n} new > "
                f"the program's max_seq_len {self.meta.max_seq_len} (re-export with a larger --max-seq-len, "
                "or shorten the prompt)")

    # ------------------------------------------------------------------ generation

    def generate_tokens(
        self,
        prompt_tokens: Sequence[int],
        max_new_tokens: int = 128,
        sampler: Sampler | SamplerConfig | None = None,
        ignore_eos: bool = False,
        callback: Optional[Callable[[str], None]] = None,
        stop: Sequence[str] = (),
        special_text: bool = False,
        before_chunk: Optional[Callable[[], None]] = None,
    ) -> list[int]:
        """Prefill ``prompt_tokens`` after what the cache holds (the previous call's last
        sampled token first, which was not fed yet), then forward-and-sample one token at a
        time until ``StopRule`` says why not (eos, stop string, max_new_tokens, context).
        ``callback`` gets each decoded text piece as it comes; special tokens give no text
        unless ``special_text``. An EOS token that ends generation is kept in the cache (the
        chat template expects it) but not in the text. A stop string has been streamed by
        the time generation ends on it. ``before_chunk`` goes to ``prefill``."""
        if not isinstance(sampler, Sampler):
            sampler = Sampler(sampler or SamplerConfig())
        prompt_tokens = self.pending + list(prompt_tokens)
        self.pending = []
        stats = self.stats = GenerationStats(load_s=self.load_s, prompt_tokens=len(prompt_tokens),
                                             stop_reason="max_new_tokens")
        rule = StopRule(eos_ids=frozenset() if ignore_eos else frozenset(self.meta.eos_ids), stop_strings=tuple(stop),
                        max_new_tokens=max_new_tokens, max_seq_len=self.meta.max_seq_len)
        text = TextStream(self.tokenizer.stream_decoder(special=special_text), callback, hidden=rule.eos_ids)
        new: list[int] = []
        t0 = time.perf_counter()
        logits = self.prefill(prompt_tokens, before_chunk)
        stats.prefill_s = time.perf_counter() - t0
        if max_new_tokens > 0:  # (with 0, the prompt only fills the cache)
            token = sampler.sample(logits, self.history)  # the first new token comes from the prefill
            t_first = time.perf_counter()
            stats.time_to_first_token_s = t_first - t0
            new, stats.stop_reason = self._decode_until_stop(token, sampler, rule, text)
            stats.decode_s = time.perf_counter() - t_first
            self.pending = [new[-1]]  # sampled but not fed: the next call starts with it
        text.flush()
        stats.generated_tokens = len(new)
        stats.peak_memory_mb = peak_memory_mb()
        return new

    def _decode_until_stop(self, token: int, sampler: Sampler, rule: StopRule,
                           text: TextStream) -> tuple[list[int], str]:
        """From the first sampled token on: stream it, ask ``rule`` whether to stop, else
        decode the next one. Returns the new tokens and why generation stopped."""
        new = [token]
        while True:
            piece = text.put(token)
            reason = rule.why_stop(token, len(new), text.text, piece, cache_len=self.pos)
            if reason:
                return new, reason
            token = self._decode_one_token(token, sampler)
            new.append(token)

    def _decode_one_token(self, token: int, sampler: Sampler) -> int:
        """Feed the last sampled token, sample the next one."""
        return sampler.sample(self._forward([token]), self.history)

    def encode_prompt(self, prompt: str, chat: bool = False) -> list[int]:
        """The prompt's token ids: as a user message in the chat template when ``chat``; else the
        text as written, special tokens in it (such as ``<|im_start|>``) included."""
        if chat:
            return self.tokenizer.encode_chat([{"role": "user", "content": prompt}])
        return self.tokenizer.encode_raw(prompt)

    def generate(self, prompt: str, max_new_tokens: int = 128, sampler: Sampler | SamplerConfig | None = None,
                 chat: bool = False, ignore_eos: bool = False, callback: Optional[Callable[[str], None]] = None,
                 stop: Sequence[str] = (), special_text: bool = False) -> str:
        """One-shot completion of ``prompt`` (see ``encode_prompt``) from an empty cache.
        Returns the generated text (what ``callback`` got, piece by piece)."""
        self.reset()
        new = self.generate_tokens(self.encode_prompt(prompt, chat), max_new_tokens, sampler, ignore_eos, callback,
                                   stop, special_text)
        if self.stats.stop_reason == "eos":
            new = new[:-1]  # the token that ended generation is not part of the text
        return self.tokenizer.decode(new, skip_special=not special_text)

    def chat(self, user_message: str, max_new_tokens: int = 256, sampler: Sampler | SamplerConfig | None = None,
             callback: Optional[Callable[[str], None]] = None) -> str:
        """One chat turn. The conversation is re-rendered with the chat template; when its
        text starts with the text already in the KV cache, only the rest is tokenized and
        fed (the sampled reply tokens stay as they were, rather than being re-tokenized).
        Otherwise (a template that rewrites earlier turns) the conversation is replayed."""
        tok = self.tokenizer
        if not tok.chat_template:
            raise InvalidInputError("this model has no chat template; use generate (--raw) instead")
        self.messages.append({"role": "user", "content": user_message})
        text = tok.apply_chat_template(self.messages)
        if self.history and text.startswith(self.cached_text):
            tokens = tok.encode(text[len(self.cached_text):], bos=False, allow_special=True)
        else:
            self.pos, self.history, self.pending = 0, [], []
            tokens = tok.encode_chat(self.messages)
        new = self.generate_tokens(tokens, max_new_tokens, sampler, callback=callback)
        eos = set(self.meta.eos_ids)
        reply = tok.decode([t for t in new if t not in eos])
        # What the cache (plus the pending last token) now holds, as text.
        self.cached_text = text + reply + (tok.token_text(new[-1]) if new and new[-1] in eos else "")
        self.messages.append({"role": "assistant", "content": reply})
        return reply
