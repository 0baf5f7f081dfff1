"""One model, one generation at a time: a worker thread owns the LLMRunner.

Requests become Jobs in a bounded queue (`submit` raises QueueFull when it is full); the
worker takes them in order and streams Events back to the request's event loop. A job
whose client went away is cancelled: skipped if still queued, stopped before its next
prefill chunk or at its next text piece if generating. Each job starts by keeping the
longest start of the KV cache its prompt shares (LLMRunner.reuse_prefix), so the next turn
of a conversation prefills only its new tokens.
"""
from __future__ import annotations

import asyncio
import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

from execupy.llm.runner import LLMRunner
from execupy.llm.sampler import Sampler, SamplerConfig

from .protocol import ApiError, GenerationRequest, Usage

# What the runner's stop reasons are called in OpenAI's finish_reason.
FINISH_REASONS = {"eos": "stop", "stop_string": "stop", "max_new_tokens": "length", "context": "length"}


class QueueFull(Exception):
    pass


class _Cancelled(Exception):
    """Raised inside the runner's text callback to stop a generation whose client left."""


@dataclass
class Event:
    kind: str  # "start" (usage so far), "text", "done" (finish_reason, usage) or "error"
    text: str = ""
    finish_reason: str = ""
    usage: Optional[Usage] = None
    error: Optional[ApiError] = None


@dataclass
class Job:
    request: GenerationRequest
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)
    client_checked: float = 0.0  # when the request last checked that its client is still there

    def emit(self, event: Event) -> None:
        """From the worker thread to the request's event loop."""
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    def cancel(self) -> None:
        self.cancelled.set()


class StopFilter:
    """Streams text but holds back what could be the start of a stop string, and cuts the
    text before the first stop string (OpenAI leaves the stop string out)."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.pending = ""
        self.stopped = False

    def feed(self, piece: str) -> str:
        """The text that can be streamed now that `piece` has come."""
        if self.stopped:
            return ""
        self.pending += piece
        found = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if found:
            self.stopped = True
            out, self.pending = self.pending[:min(found)], ""
            return out
        split = len(self.pending) - self._could_begin_a_stop()
        out, self.pending = self.pending[:split], self.pending[split:]
        return out

    def _could_begin_a_stop(self) -> int:
        """How many trailing characters of the pending text could begin a stop string."""
        return max((k for s in self.stops for k in range(len(s) - 1, 0, -1) if self.pending.endswith(s[:k])),
                   default=0)

    def flush(self) -> str:
        out, self.pending = ("" if self.stopped else self.pending), ""
        return out


class Engine:
    def __init__(self, runner: LLMRunner, model_name: str, queue_size: int = 32, default_max_tokens: int = 256):
        self.runner = runner
        self.model_name = model_name
        self.default_max_tokens = default_max_tokens
        if queue_size < 1:
            raise ValueError(f"queue_size must be at least 1, got {queue_size}")
        self.jobs: queue.Queue[Job] = queue.Queue(maxsize=queue_size)
        self.busy = False
        self.created = int(time.time())
        self._worker = threading.Thread(target=self._work, name="execupy-serve-worker", daemon=True)
        self._worker.start()

    @property
    def context_length(self) -> int:
        return self.runner.meta.max_seq_len

    def submit(self, job: Job) -> None:
        """Queue a job; QueueFull when queue_size jobs are already waiting."""
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            raise QueueFull from None

    def waiting(self) -> int:
        return self.jobs.qsize()

    # ------------------------------------------------------------------ the worker thread

    def _work(self) -> None:
        while True:
            job = self.jobs.get()
            if job.cancelled.is_set():
                continue  # the client left while it waited
            self.busy = True
            try:
                self._run(job)
            except _Cancelled:
                pass
            except ApiError as e:
                job.emit(Event("error", error=e))
            except Exception as e:  # a bug or a kernel failure: the server stays up, the client is told
                print(f"execupy serve: generation failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
                job.emit(Event("error", error=ApiError(500, f"generation failed: {type(e).__name__}: {e}",
                                                       type="server_error")))
            finally:
                self.busy = False

    def _prompt_tokens(self, request: GenerationRequest) -> list[int]:
        tok = self.runner.tokenizer
        if request.kind == "completion":
            return tok.encode(request.prompt)
        if not tok.chat_template:
            raise ApiError(400, "this model has no chat template; use /v1/completions with a raw prompt",
                           param="messages")
        return tok.encode_chat(request.messages)

    def _run(self, job: Job) -> None:
        runner, request = self.runner, job.request
        tokens = self._prompt_tokens(request)
        limit = self.context_length
        if len(tokens) > limit:
            raise ApiError(400, f"the prompt has {len(tokens)} tokens, more than this model's context of {limit} "
                           f"tokens (prompt plus completion must fit in {limit})", param="messages"
                           if request.kind == "chat" else "prompt", code="context_length_exceeded")
        cached = runner.reuse_prefix(tokens)
        job.emit(Event("start", usage=Usage(len(tokens), 0, cached)))
        config = SamplerConfig(temperature=request.temperature, top_p=request.top_p, seed=request.seed)
        stops = StopFilter(request.stop)

        def check_client() -> None:
            if job.cancelled.is_set():
                raise _Cancelled

        def on_text(piece: str) -> None:
            check_client()
            text = stops.feed(piece)
            if text:
                job.emit(Event("text", text))

        max_tokens = request.max_tokens or self.default_max_tokens
        # A long prefill takes seconds: the client is checked between its chunks too.
        new = runner.generate_tokens(tokens[cached:], max_tokens, Sampler(config), callback=on_text, stop=request.stop,
                                     before_chunk=check_client)
        rest = stops.flush()
        if rest:
            job.emit(Event("text", rest))
        finish = FINISH_REASONS.get(runner.stats.stop_reason, "stop")
        job.emit(Event("done", finish_reason=finish, usage=Usage(len(tokens), len(new), cached)))
