"""`execupy chat` driven through a real pseudo-terminal, as a person at a terminal would.

The tiny random Llama from test_export_runner is exported once; `python -m execupy chat`
runs with stdin, stdout and stderr on one pty, as in a terminal (`input()` then writes its
prompt on stderr, and the --stats lines come there too).
Two turns, the second referring to the first, then /quit. With random weights the
replies are gibberish, so the test asserts structure: a prompt per turn, each turn's
printed reply equals what LLMRunner.chat gives for the same conversation (greedy), and
the second turn's prefill holds only the new tokens (the KV cache was kept).
Every read has a deadline, so a stuck REPL fails the test instead of hanging it.
"""
from __future__ import annotations

import os
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from execupy.llm.runner import LLMRunner
from tests.llm.test_export_runner import export_tiny

pty = pytest.importorskip("pty")  # POSIX only

REPO = Path(__file__).resolve().parents[2]
TURNS = ["my name is fox", "what is my name?"]
NEW_TOKENS = 6
PROMPT = "> "
DEADLINE_S = 60.0
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


@pytest.fixture(scope="module")
def pte(tmp_path_factory) -> Path:
    return export_tiny(tmp_path_factory.mktemp("chat_pty"))[0].pte_path


class Terminal:
    """A child process on a pty: write lines, read until a marker, with a deadline."""

    def __init__(self, argv: list[str]) -> None:
        self.master, slave = os.openpty()
        env = {**os.environ, "TERM": "dumb", "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, cwd=REPO, env=env,
                                     close_fds=True, start_new_session=True)
        os.close(slave)
        self.buffer = ""

    def read_until(self, marker: str, timeout: float = DEADLINE_S) -> str:
        """Everything up to and including the next `marker`; fails after `timeout` seconds."""
        end = time.monotonic() + timeout
        while marker not in self.buffer:
            left = end - time.monotonic()
            if left <= 0:
                pytest.fail(f"no {marker!r} within {timeout} s; got {self.buffer!r}")
            ready, _, _ = select.select([self.master], [], [], left)
            if ready:
                try:
                    chunk = os.read(self.master, 4096)
                except OSError:  # EIO: the child closed the terminal
                    chunk = b""
                if not chunk:
                    pytest.fail(f"terminal closed before {marker!r}; got {self.buffer!r}")
                self.buffer += ANSI.sub("", chunk.decode("utf-8", errors="replace"))
        text, _, self.buffer = self.buffer.partition(marker)
        return text + marker

    def send(self, line: str) -> None:
        os.write(self.master, (line + "\n").encode())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        os.close(self.master)


def _expected_turns(pte: Path) -> tuple[list[str], list[int], int]:
    """What the same conversation gives through LLMRunner directly: the replies, the
    prompt tokens fed per turn, and the length of turn 2's whole rendered conversation."""
    runner = LLMRunner(pte)
    replies, fed = [], []
    for line in TURNS:
        replies.append(runner.chat(line, NEW_TOKENS))
        fed.append(runner.stats.prompt_tokens)
    whole = len(runner.tokenizer.encode_chat(runner.messages[:3]))
    return replies, fed, whole


def test_chat_two_turns_in_a_terminal_keep_the_kv_cache(pte):
    term = Terminal([sys.executable, "-m", "execupy", "chat", str(pte), "--max-new-tokens", str(NEW_TOKENS),
                     "--stats"])
    try:
        assert term.read_until(PROMPT).startswith("loaded ")  # the banner, then the first prompt
        printed, stats = [], []
        for line in TURNS:
            term.send(line)
            answer = term.read_until(PROMPT)[: -len(PROMPT)].replace("\r\n", "\n")  # the tty writes \r\n
            # The terminal echoes the typed line; then the streamed reply, a newline, the stats line.
            assert answer.startswith(line + "\n") and answer.endswith("\n"), answer
            reply, _, stats_line = answer[len(line) + 1: -1].rpartition("\n")
            assert stats_line.startswith("load ") and "stop: " in stats_line, answer
            printed.append(reply)
            stats.append(int(re.search(r"prompt (\d+) tokens", stats_line).group(1)))
        term.send("/quit")
        assert term.proc.wait(timeout=DEADLINE_S) == 0
    finally:
        term.close()

    replies, fed, whole = _expected_turns(pte)
    assert printed == replies  # each turn answered, with what the runner says for that conversation
    assert all(reply.strip() for reply in printed)
    # Turn 2 fed only what the conversation added after the cache, not the whole of it again.
    assert stats == fed
    assert 0 < stats[1] < whole
