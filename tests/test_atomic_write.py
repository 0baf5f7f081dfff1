"""A save that fails midway leaves the user's previous file exactly as it was.

Every file execupy writes goes through `execupy.fileio.atomic_write`. The failures are made
by a disk that fills up (or a Ctrl-C that arrives) after some bytes of the write, and are
driven through the save APIs a user calls: `ExecutorchProgramManager.save`,
`LLMExportManager.save` and `execupy run --save`. After each, the old file is byte-identical
and nothing else (no partial file, no temporary) stands in the folder.
"""
from __future__ import annotations

import ast
import errno
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from execupy.cli import main as cli_main
from execupy.fileio import atomic_write
from execupy.runtime import Program

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "execupy" / "examples" / "mlp.pte"  # a good .pte a user already has


class FillingDisk:
    """Files opened with os.fdopen take `room` more bytes in all, then a write raises `error`."""

    def __init__(self, monkeypatch, room: int, error: BaseException):
        self.room, self.error, self.written = room, error, 0
        real_fdopen = os.fdopen
        monkeypatch.setattr(os, "fdopen", lambda fd, *a, **k: _Limited(real_fdopen(fd, *a, **k), self))


class _Limited:
    def __init__(self, f, disk: FillingDisk):
        self._f, self._disk = f, disk

    def write(self, data) -> int:
        data = memoryview(data).cast("B")
        n = min(len(data), self._disk.room)
        self._f.write(data[:n])  # the bytes that fit do reach the file, as on a real full disk
        self._disk.room -= n
        self._disk.written += n
        if n < len(data):
            raise self._disk.error
        return n

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


DISK_FULL = OSError(errno.ENOSPC, "No space left on device")
FAILURES = [pytest.param(DISK_FULL, id="disk-full"), pytest.param(KeyboardInterrupt(), id="ctrl-c")]


def folder_files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir()}


# ----------------------------------------------------------------------------- the helper


def test_atomic_write_takes_bytes_text_or_a_writer(tmp_path):
    atomic_write(tmp_path / "a.bin", b"\x00\x01")
    atomic_write(tmp_path / "b.txt", "héllo\n")
    atomic_write(tmp_path / "c.npz", lambda f: np.savez(f, out0=np.arange(3)))
    assert (tmp_path / "a.bin").read_bytes() == b"\x00\x01"
    assert (tmp_path / "b.txt").read_bytes() == "héllo\n".encode("utf-8")
    assert np.load(tmp_path / "c.npz")["out0"].tolist() == [0, 1, 2]
    assert sorted(folder_files(tmp_path)) == ["a.bin", "b.txt", "c.npz"]


def test_atomic_write_gives_the_mode_a_plain_open_gives(tmp_path):
    with open(tmp_path / "plain", "wb") as f:
        f.write(b"x")
    atomic_write(tmp_path / "atomic", b"x")
    assert (tmp_path / "atomic").stat().st_mode == (tmp_path / "plain").stat().st_mode


@pytest.mark.parametrize("failure", FAILURES)
def test_a_writer_that_fails_midway_leaves_the_old_file(tmp_path, failure):
    target = tmp_path / "out.bin"
    target.write_bytes(b"the old contents")

    def writer(f):
        f.write(b"half of the new")
        raise failure

    with pytest.raises(type(failure)):
        atomic_write(target, writer)
    assert folder_files(tmp_path) == {"out.bin": b"the old contents"}


def test_writing_over_a_folder_fails_and_leaves_no_temporary(tmp_path):
    (tmp_path / "model.pte").mkdir()
    with pytest.raises(OSError):
        atomic_write(tmp_path / "model.pte", b"x")
    assert [p.name for p in tmp_path.iterdir()] == ["model.pte"]


# ----------------------------------------------------------------------------- ExecutorchProgramManager.save


@pytest.fixture(scope="module")
def program():
    from execupy.exir import to_edge

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU())
    return to_edge(torch.export.export(model, (torch.randn(2, 64),))).to_executorch()


@pytest.mark.parametrize("failure", FAILURES)
def test_program_save_interrupted_keeps_the_previous_program(program, tmp_path, monkeypatch, failure):
    path = tmp_path / "model.pte"
    shutil.copyfile(EXAMPLE, path)
    before = folder_files(tmp_path)
    disk = FillingDisk(monkeypatch, room=len(program.buffer) // 2, error=failure)
    with pytest.raises(type(failure)):
        program.save(path)
    assert disk.written == len(program.buffer) // 2  # the failure did come midway through the .pte
    assert folder_files(tmp_path) == before
    Program.load(path).load_method("forward")  # still the user's working program


def test_program_save_replaces_the_file_whole(program, tmp_path):
    path = tmp_path / "model.pte"
    shutil.copyfile(EXAMPLE, path)
    program.save(path)
    assert folder_files(tmp_path) == {"model.pte": program.buffer}


# ----------------------------------------------------------------------------- LLMExportManager.save


@pytest.fixture(scope="module")
def llm_manager(tmp_path_factory):
    """A tiny random Llama with its byte-level BPE tokenizer, run through every stage but save."""
    from execupy.llm.export import LLMExportManager
    from tests.llm.test_export_runner import MAX_PREFILL, MAX_SEQ_LEN, _write_tiny_model

    torch.set_num_threads(1)
    folder = _write_tiny_model(tmp_path_factory.mktemp("tiny_llm") / "hf")
    manager = LLMExportManager.from_checkpoint(folder, max_seq_len=MAX_SEQ_LEN, max_prefill_len=MAX_PREFILL)
    return manager.export().to_edge().to_executorch()


def previous_export(folder: Path) -> dict[str, bytes]:
    """What an earlier export left in the folder: a good .pte and its tokenizer file."""
    shutil.copyfile(EXAMPLE, folder / "model.pte")
    (folder / "model.tokenizer.json").write_text('{"an": "older tokenizer"}')
    return folder_files(folder)


@pytest.mark.parametrize("failure", FAILURES)
def test_llm_save_interrupted_in_the_program_keeps_the_previous_program(llm_manager, tmp_path, tmp_path_factory,
                                                                        monkeypatch, failure):
    scratch = tmp_path_factory.mktemp("scratch") / "tokenizer.json"
    llm_manager.tokenizer.save(scratch)
    new_tokenizer = scratch.read_bytes()
    before = previous_export(tmp_path)
    disk = FillingDisk(monkeypatch, room=len(new_tokenizer) + 1000, error=failure)  # the .pte gets 1000 bytes
    with pytest.raises(type(failure)):
        llm_manager.set_output_dir(tmp_path).save("model.pte")
    assert disk.written == len(new_tokenizer) + 1000
    after = folder_files(tmp_path)
    assert set(after) == set(before)  # no partial file, no temporary
    assert after["model.pte"] == before["model.pte"]
    assert after["model.tokenizer.json"] == new_tokenizer  # written first, and whole
    Program.load(tmp_path / "model.pte").load_method("forward")


def test_llm_save_interrupted_in_the_tokenizer_keeps_both_previous_files(llm_manager, tmp_path, monkeypatch):
    before = previous_export(tmp_path)
    FillingDisk(monkeypatch, room=10, error=DISK_FULL)
    with pytest.raises(OSError, match="No space left"):
        llm_manager.set_output_dir(tmp_path).save("model.pte")
    assert folder_files(tmp_path) == before


def test_llm_save_after_a_failed_one_writes_a_program_that_runs(llm_manager, tmp_path, monkeypatch):
    from execupy.llm.runner import LLMRunner

    previous_export(tmp_path)
    with monkeypatch.context() as patch:
        FillingDisk(patch, room=10, error=KeyboardInterrupt())
        with pytest.raises(KeyboardInterrupt):
            llm_manager.set_output_dir(tmp_path).save("model.pte")
    result = llm_manager.save("model.pte")
    assert sorted(folder_files(tmp_path)) == ["model.pte", "model.tokenizer.json"]
    assert LLMRunner(result.pte_path).meta.max_seq_len == llm_manager.model.max_seq_len


# ----------------------------------------------------------------------------- execupy run --save


def test_run_save_interrupted_keeps_the_previous_outputs(tmp_path, monkeypatch, capsys):
    out = tmp_path / "out.npz"
    assert cli_main(["run", str(EXAMPLE), "--random-inputs", "--save", str(out)]) == 0
    before = folder_files(tmp_path)
    FillingDisk(monkeypatch, room=100, error=DISK_FULL)
    capsys.readouterr()
    assert cli_main(["run", str(EXAMPLE), "--random-inputs", "--save", str(out)]) == 1
    assert "error: [Errno 28] No space left on device" in capsys.readouterr().err
    assert folder_files(tmp_path) == before
    assert list(np.load(out)) == ["out0"]


# ----------------------------------------------------------------------------- no other way to write


WRITE_CALLS = {"write_bytes", "write_text", "save", "savez", "savez_compressed", "tofile", "dump"}


def _raw_writes(source: str, name: str) -> list[str]:
    """Calls in one module that write a file without atomic_write: open(..., 'w'/'a'/'x'),
    Path.write_bytes/write_text, np.save/savez, ndarray.tofile, json.dump/pickle.dump."""
    tree = ast.parse(source)
    inside_atomic_write = {id(n) for call in ast.walk(tree) if isinstance(call, ast.Call)
                           and getattr(call.func, "id", getattr(call.func, "attr", None)) == "atomic_write"
                           for arg in call.args for n in ast.walk(arg)}  # a writer given the temporary file
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or id(node) in inside_atomic_write:
            continue
        func = node.func
        if isinstance(func, ast.Name) and func.id == "open":
            mode = node.args[1] if len(node.args) > 1 else next((k.value for k in node.keywords if k.arg == "mode"), None)
            if isinstance(mode, ast.Constant) and set(str(mode.value)) & set("wax+"):
                found.append(f"{name}:{node.lineno} open(..., {mode.value!r})")
        elif isinstance(func, ast.Attribute) and func.attr in WRITE_CALLS:
            owner = func.value.id if isinstance(func.value, ast.Name) else ""
            if func.attr in {"save", "dump"} and owner not in {"np", "numpy", "json", "pickle", "torch"}:
                continue  # our own save() methods, which call atomic_write themselves
            found.append(f"{name}:{node.lineno} {owner or '...'}.{func.attr}(...)")
    return found


def test_every_file_execupy_writes_goes_through_atomic_write():
    modules = [p for p in sorted((REPO / "execupy").rglob("*.py")) if p.name != "fileio.py"]
    raw = [write for p in modules for write in _raw_writes(p.read_text(), str(p.relative_to(REPO)))]
    assert not raw, f"write these through execupy.fileio.atomic_write: {raw}"


def test_the_guard_sees_a_raw_write():
    sample = ("import numpy as np\nopen(p, 'wb').write(b'')\nnp.savez(p, a=1)\nq.write_text('x')\nself.save(p)\n"
              "atomic_write(p, lambda f: np.savez(f, a=1))\n")
    assert sorted(_raw_writes(sample, "m.py")) == ["m.py:2 open(..., 'wb')", "m.py:3 np.savez(...)", "m.py:4 q.write_text(...)"]
