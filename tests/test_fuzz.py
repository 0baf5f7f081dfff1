"""Hostile input: mutated and truncated real programs never crash the runtime or `inspect`.

Every variant is a conformance (or design-sample) `.pte` with a few seeded damages (our
own exporter's programs always, ExecuTorch's too where ../shared is present):
bit flips, u32/u64 fields overwritten with extreme values, byte ranges zeroed or
duplicated, truncation, and structure-aware edits (decode the program, set one
field or list to an extreme value, write it back with the schema writer, so the
damage gets past the flatbuffer checks into the runtime). For each variant,
Program.load + load_method + execute (with the case's inputs) must either work or
raise an ExecupyError subclass; and `execupy inspect` must print a report and
return 0 or 1.

The variants run in a worker subprocess with RLIMIT_AS set just above what it uses
after warm-up (+ HEADROOM), and Program.load(..., max_arena_bytes=64 MiB): an
attempt to allocate beyond that bound raises MemoryError, which is reported as a
failure even when the runtime wrapped it. Each variant has a time limit.

    EXECUPY_FUZZ_VARIANTS=20000 .venv/bin/python -m pytest -q tests/test_fuzz.py   # more variants
    .venv/bin/python -m tests.test_fuzz replay 0:1234     # rerun one variant (seed:index), full traceback
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import random
import resource
import signal
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import pytest

from . import programs
from .conformance import cases, load_inputs, named, program_name, samples

REPO = Path(__file__).resolve().parents[1]
VARIANTS = int(os.environ.get("EXECUPY_FUZZ_VARIANTS", "3000"))
SEED = int(os.environ.get("EXECUPY_FUZZ_SEED", "0"))
MAX_ARENA = 64 << 20
HEADROOM = 512 << 20  # address space the worker may grow by after warm-up
MAX_STEPS = 100_000  # instructions per execute (jump loops)
VARIANT_SECONDS = 10.0  # generous: the machine is shared; a real hang runs far longer


# ---------------------------------------------------------------------------- seeds


@dataclasses.dataclass
class Seed:
    name: str
    data: bytes
    method: str
    inputs: list


def seeds() -> list[Seed]:
    """Every conformance program with its main run's inputs, and the design samples with inputs
    drawn from their method metadata (they have no input files)."""
    out = []
    for case in cases():
        run = case.manifest["runs"][0]
        out.append(Seed(case.name, case.pte.read_bytes(), run["method"], load_inputs(case, run)))
    for sample in samples():
        data = sample.pte.read_bytes()
        method, inputs = _meta_inputs(data)
        out.append(Seed("sample-" + sample.name, data, method, inputs))
    return out


def _meta_inputs(data: bytes) -> tuple[str, list]:
    from execupy.runtime import Program, TensorInfo

    program = Program.load(data)
    name = "forward" if "forward" in program.method_names else program.method_names[0]
    rng = np.random.default_rng(0)
    inputs = []
    for info in program.method_meta(name).inputs:
        if isinstance(info, TensorInfo):
            inputs.append(rng.integers(0, 3, info.shape).astype(info.dtype))
        else:
            inputs.append(info.value)
    return name, inputs


# ---------------------------------------------------------------------------- mutations

U32_EXTREMES = [0, 1, 2, 3, 4, 7, 8, 0xFF, 0x7FFF, 0xFFFF, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFE, 0xFFFFFFFF]
U64_EXTREMES = [0, 1, 0x7FFFFFFF, 0xFFFFFFFF, 1 << 32, (1 << 62), (1 << 63) - 1, 1 << 63, (1 << 64) - 1]
INT_EXTREMES = [-(1 << 31), -2, -1, 0, 1, 2, 3, 7, 64, 255, 65535, (1 << 31) - 1]


def _flatbuffer_end(data: bytes) -> int:
    """Where the flatbuffer ends (damage there is more interesting than in raw segment bytes)."""
    if len(data) >= 24 and data[8:12] == b"eh00":
        return max(16, min(len(data), struct.unpack_from("<Q", data, 16)[0]))
    return len(data)


def _pos(rng: random.Random, data: bytearray, width: int) -> int:
    end = _flatbuffer_end(bytes(data[:24])) if rng.random() < 0.85 else len(data)
    end = min(end, len(data))
    if end <= width:
        return 0
    return rng.randrange(0, end - width) & ~(min(width, 4) - 1)


def flip_bits(rng, data):
    for _ in range(rng.randint(1, 8)):
        i = _pos(rng, data, 1)
        data[i] ^= 1 << rng.randrange(8)
    return "flip bits"


def overwrite_u32(rng, data):
    i = _pos(rng, data, 4)
    value = rng.choice(U32_EXTREMES + [len(data), len(data) + 1, rng.getrandbits(32)])
    struct.pack_into("<I", data, i, value & 0xFFFFFFFF)
    return f"u32@{i}={value:#x}"


def overwrite_u64(rng, data):
    i = _pos(rng, data, 8)
    value = rng.choice(U64_EXTREMES + [len(data), rng.getrandbits(64)])
    struct.pack_into("<Q", data, i, value)
    return f"u64@{i}={value:#x}"


def header_field(rng, data):
    """Damage the identifier or one `eh00` field (bytes 0..40)."""
    i = rng.choice([0, 4, 8, 12, 16, 24, 32])
    if i + 8 <= len(data) and i >= 16:
        struct.pack_into("<Q", data, i, rng.choice(U64_EXTREMES + [len(data), len(data) + 1]))
    elif i + 4 <= len(data):
        struct.pack_into("<I", data, i, rng.choice(U32_EXTREMES + [len(data)]))
    return f"header@{i}"


def zero_range(rng, data):
    i = _pos(rng, data, 1)
    n = rng.choice([1, 2, 4, 8, 16, 64, 256])
    data[i : i + n] = bytes(len(data[i : i + n]))
    return f"zero[{i}:+{n}]"


def duplicate_range(rng, data):
    src, dst = _pos(rng, data, 1), _pos(rng, data, 1)
    n = rng.choice([4, 8, 16, 64, 256])
    chunk = data[src : src + n]
    data[dst : dst + len(chunk)] = chunk
    return f"dup[{src}:+{n}]->{dst}"


def truncate(rng, data):
    n = rng.choice([rng.randrange(len(data)), rng.randrange(64), len(data) - rng.randint(1, 64)])
    n = max(0, n)
    del data[n:]
    return f"truncate {n}"


BYTE_MUTATIONS: list[Callable[[random.Random, bytearray], str]] = [
    flip_bits, overwrite_u32, overwrite_u32, overwrite_u64, header_field, zero_range, duplicate_range, truncate,
]


def _int_fields(obj: Any, path: str, out: list) -> None:
    """Every (owner, field, path) in the Program tree holding an int or a list of ints."""
    if dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if isinstance(value, bool):
                continue
            if isinstance(value, int) or (isinstance(value, list) and all(type(v) is int for v in value)):
                out.append((obj, f.name, f"{path}.{f.name}"))
            elif isinstance(value, list) or dataclasses.is_dataclass(value):
                _int_fields(value, f"{path}.{f.name}", out)
    elif isinstance(obj, list):
        for k, item in enumerate(obj[:64]):  # long lists: the first entries are enough
            _int_fields(item, f"{path}[{k}]", out)


def structural(rng: random.Random, data: bytearray) -> str:
    """Decode, set one int field (or list) to an extreme value, re-encode with the writer."""
    from execupy.schema.reader import read_pte
    from execupy.schema.writer import write_pte

    pte = read_pte(bytes(data))
    program = pte.program
    segments = [bytes(pte.segment(i)) for i in range(len(program.segments))]
    fields: list = []
    _int_fields(program, "program", fields)
    if not fields:
        return "structural: nothing to edit"
    owner, name, path = rng.choice(fields)
    original = getattr(owner, name)
    # An extreme value first; if it does not fit the field's flatbuffer type, a small one.
    for value in (_extreme(rng, original), rng.choice([0, 1, 2, 3, 5, 7, 100, 127])):
        setattr(owner, name, value if not isinstance(original, list) or isinstance(value, list) else [value])
        try:
            encoded = write_pte(program, segments)
        except Exception:
            setattr(owner, name, original)
            continue
        data[:] = encoded
        return f"structural {path}={getattr(owner, name)!r:.40}"
    return f"structural {path}: unencodable, unchanged"


def _extreme(rng: random.Random, value):
    """An extreme replacement for an int, or an edited copy of an int list."""
    if not isinstance(value, list):
        return rng.choice(INT_EXTREMES + [int(value) + 1, int(value) - 1])
    value = list(value)
    choice = rng.randrange(4)
    if choice == 0 and value:
        value[rng.randrange(len(value))] = rng.choice(INT_EXTREMES)
    elif choice == 1:
        value.append(rng.choice(INT_EXTREMES))
    elif choice == 2 and value:
        del value[rng.randrange(len(value))]
    else:
        value = [rng.choice([(1 << 31) - 1, 65535, 255, 0])] * rng.randint(1, 8)
    return value


def make_variant(seed: Seed, seed_value: int, index: int) -> tuple[bytes, str]:
    """Variant `index` of `seed`: half structural edits (maybe plus one byte damage), half byte damage."""
    rng = random.Random(f"{seed_value}:{index}")
    data = bytearray(seed.data)
    steps = []
    if rng.random() < 0.5:
        steps += [structural(rng, data) for _ in range(rng.choice([1, 1, 2]))]
        byte_damages = 1 if rng.random() < 0.25 else 0
    else:
        byte_damages = rng.choice([1, 1, 1, 2, 3])
    for _ in range(byte_damages):
        if len(data) < 8:
            break
        steps.append(rng.choice(BYTE_MUTATIONS)(rng, data))
    return bytes(data), "; ".join(steps)


# ---------------------------------------------------------------------------- checks


class VariantTimeout(BaseException):
    """Raised by the alarm; a BaseException so the runtime's `except Exception` cannot swallow it."""


def _on_alarm(signum, frame):
    raise VariantTimeout()


def run_variant(data: bytes, seed: Seed) -> str:
    """Load, bind and execute; returns the outcome name, raises on anything not an ExecupyError."""
    from execupy.errors import ExecupyError
    from execupy.runtime import Program

    try:
        program = Program.load(data, max_arena_bytes=MAX_ARENA)
        names = program.method_names
        if not names:
            return "no methods"
        for name in names:
            program.method_meta(name)
        method = program.load_method(seed.method if seed.method in names else names[0])
        # A damaged jump can loop forever; the runtime's step budget turns that into a KernelError.
        # Its default (50M steps) takes minutes in Python, so the fuzz uses a smaller one.
        method.max_steps_per_call = MAX_STEPS
        method.execute(seed.inputs)
        return "ok"
    except ExecupyError as e:
        if _memory_error_in(e):
            raise
        return type(e).__name__


def _memory_error_in(e: BaseException) -> bool:
    while e is not None:
        if isinstance(e, MemoryError):
            return True
        e = e.__cause__ or e.__context__
    return False


def inspect_variant(data: bytes, workdir: Path, use_cli: bool) -> str:
    """`summarize` on the bytes; every few variants the real CLI on a file. Returns the outcome."""
    from execupy.cli import main
    from execupy.devtools.summary import format_summary, summarize

    if not use_cli:
        info = summarize(data)
        text = format_summary(info)
        assert text.startswith("file:")
        json.dumps(info, default=str)
        return "problems" if info["problems"] else "clean"
    path = workdir / "variant.pte"
    path.write_bytes(data)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["inspect", str(path)])
    assert rc in (0, 1), f"inspect returned {rc}"
    assert out.getvalue().startswith("file:"), "inspect printed no report"
    assert "Traceback" not in out.getvalue() + err.getvalue()
    return f"cli rc={rc}"


def _guarded(fn: Callable[[], str]) -> tuple[str, Optional[str]]:
    signal.setitimer(signal.ITIMER_REAL, VARIANT_SECONDS)
    try:
        return fn(), None
    except VariantTimeout:
        return "TIMEOUT", f"no result after {VARIANT_SECONDS} s (hang?)"
    except BaseException:
        return "CRASH", traceback.format_exc()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


# ---------------------------------------------------------------------------- worker


def _limit_address_space() -> int:
    """Cap the address space at its warm-up size plus HEADROOM; returns the cap."""
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    cap = vm + HEADROOM
    resource.setrlimit(resource.RLIMIT_AS, (cap, resource.RLIM_INFINITY))
    return cap


def worker(count: int, seed_value: int, out_path: str) -> None:
    all_seeds = seeds()
    baseline = {}
    for s in all_seeds:  # warm-up: imports, kernels, caches; and which seeds run at all
        baseline[s.name] = _guarded(lambda: run_variant(s.data, s))[0]
    cap = _limit_address_space()
    signal.signal(signal.SIGALRM, _on_alarm)
    outcomes: dict[str, int] = {}
    inspect_outcomes: dict[str, int] = {}
    failures = []
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for index in range(count):
            seed = all_seeds[index % len(all_seeds)]
            data, how = make_variant(seed, seed_value, index)
            for check, outcome_counts in (
                (lambda: run_variant(data, seed), outcomes),
                (lambda: inspect_variant(data, Path(tmp), use_cli=index % 10 == 0), inspect_outcomes),
            ):
                outcome, problem = _guarded(check)
                outcome_counts[outcome] = outcome_counts.get(outcome, 0) + 1
                if problem is not None:
                    which = "runtime" if outcome_counts is outcomes else "inspect"
                    failures.append({"variant": f"{seed_value}:{index}", "check": which, "seed": seed.name,
                                     "mutation": how, "error": problem})
    result = {"variants": count, "seconds": time.perf_counter() - start, "address_space_cap": cap,
              "baseline": baseline, "outcomes": outcomes, "inspect_outcomes": inspect_outcomes,
              "failures": failures}
    Path(out_path).write_text(json.dumps(result, indent=1))


def replay(spec: str) -> None:
    seed_value, index = (int(x) for x in spec.split(":"))
    all_seeds = seeds()
    seed = all_seeds[index % len(all_seeds)]
    data, how = make_variant(seed, seed_value, index)
    print(f"variant {spec}: seed {seed.name}, {how}, {len(data)} bytes")
    print("runtime:", run_variant(data, seed))
    with tempfile.TemporaryDirectory() as tmp:
        print("inspect:", inspect_variant(data, Path(tmp), use_cli=True))


# ---------------------------------------------------------------------------- tests

@pytest.fixture(scope="module")
def fuzz_result(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("fuzz") / "result.json"
    env = programs.child_env(OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "tests.test_fuzz", "worker", str(VARIANTS), str(SEED), str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, f"fuzz worker died (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(out.read_text())


def _report(failures: list) -> str:
    return "\n\n".join(f"variant {f['variant']} ({f['seed']}: {f['mutation']}):\n{f['error']}" for f in failures[:5])


def test_runtime_rejects_damaged_programs_with_execupy_errors(fuzz_result):
    runtime_failures = [f for f in fuzz_result["failures"] if f["check"] == "runtime"]
    assert not runtime_failures, (
        f"{len(runtime_failures)} of {fuzz_result['variants']} variants crashed or hung; first ones "
        f"(replay with `python -m tests.test_fuzz replay SEED:INDEX`):\n" + _report(runtime_failures)
    )
    outcomes = fuzz_result["outcomes"]
    assert sum(outcomes.values()) == VARIANTS
    # The damage must reach past the reader, and some variants must still load and run.
    assert outcomes.get("MalformedProgramError", 0) > VARIANTS // 20
    survivors = VARIANTS - outcomes.get("MalformedProgramError", 0)
    assert survivors > VARIANTS // 20, outcomes
    if "ok" in fuzz_result["baseline"].values():
        assert outcomes.get("ok", 0) > 0, "no variant of a runnable program ran; the mutations are too harsh"


def test_inspect_reports_on_damaged_programs(fuzz_result):
    inspect_failures = [f for f in fuzz_result["failures"] if f["check"] == "inspect"]
    assert not inspect_failures, f"{len(inspect_failures)} variants broke inspect:\n" + _report(inspect_failures)
    seen = fuzz_result["inspect_outcomes"]
    assert seen.get("problems", 0) > 0 and seen.get("clean", 0) > 0, seen
    assert seen.get("cli rc=1", 0) > 0, seen


@pytest.mark.parametrize("case", named("portable-lstm", "execupy-llama_block"), ids=program_name)
def test_inspect_cli_process_on_truncated_file_has_no_traceback(case, tmp_path):
    path = tmp_path / "cut.pte"
    path.write_bytes(case.pte.read_bytes()[:3000])
    proc = subprocess.run([sys.executable, "-m", "execupy", "inspect", str(path)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "problems:" in proc.stdout and "Traceback" not in proc.stdout + proc.stderr


def test_variants_are_reproducible():
    s = seeds()[0]
    assert make_variant(s, SEED, 7) == make_variant(s, SEED, 7)
    assert make_variant(s, SEED, 7)[0] != s.data


if __name__ == "__main__":
    if sys.argv[1] == "worker":
        worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    elif sys.argv[1] == "replay":
        replay(sys.argv[2])
