"""`execupy inspect` and `execupy run` on real programs, damaged files and bad arguments.

Each test runs on ExecuTorch's program (../shared, where present) and on our own
exporter's program of the same kind (tests/programs.py). Expected facts come from each
case's manifest (written by ExecuTorch's toolchain, or from our exporter's in-memory
program), not from our own reader.
"""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from execupy.cli import main
from execupy.devtools.summary import format_summary, summarize

from .conformance import expected_outputs, load_inputs, mismatch, named, program_name, topic

REPO = Path(__file__).resolve().parents[1]
MULTI = topic("multi_method")
LLAMA = topic("llama_block")


def inspect_json(path, capsys) -> tuple[int, dict]:
    rc = main(["inspect", str(path), "--json"])
    return rc, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("c", named("portable-multi_method", "xnnpack-mixed_partition", "portable-dynamic_batch_seq",
                                     "execupy-multi_method", "execupy-mixed_partition", "execupy-dynamic_batch_seq"),
                         ids=program_name)
def test_inspect_json_agrees_with_the_manifest(c, capsys):
    rc, info = inspect_json(c.pte, capsys)
    assert rc == 0 and info["problems"] == []
    assert info["size"] == c.manifest["pte_bytes"]
    methods = {m["name"]: m for m in info["methods"]}
    assert sorted(methods) == sorted(c.manifest["method_names"])
    for method, operators in c.manifest["operators"].items():
        assert sorted(methods[method]["operators"]) == sorted(operators)
        assert [d["id"] for d in methods[method]["delegates"]] == c.manifest["delegates"][method]
    main_method = methods[c.manifest["method_names"][0]]
    tensor_inputs = [i for i in c.manifest["inputs"] if i["kind"] == "tensor"]
    dynamic = c.manifest.get("dynamic_shapes") or {}

    def upper_bound(spec):  # dynamic axes are planned at their maximum
        axes = dynamic.get(spec["name"]) or {}
        return [axes[str(k)]["max"] if str(k) in axes else s for k, s in enumerate(spec["shape"])]

    assert [(i["dtype"], i["shape"]) for i in main_method["inputs"]] == [(i["dtype"], upper_bound(i)) for i in tensor_inputs]
    assert [i["dynamic"] for i in main_method["inputs"]] == [i["name"] in dynamic for i in tensor_inputs]


@pytest.mark.parametrize("c", LLAMA, ids=program_name)
def test_operator_counts_add_up_to_kernel_calls(c, capsys):
    rc, info = inspect_json(c.pte, capsys)
    (m,) = info["methods"]
    assert sum(m["operators"].values()) == m["instruction_kinds"]["KernelCall"]
    assert m["planned_memory"] and all(a["bytes"] > 0 for a in m["planned_memory"])
    assert m["constant_tensors"] > 0 and info["constants"]["bytes"] >= m["constant_tensor_bytes"]


# (program, whether its delegates read named data): XNNPACK keeps weights there, our backend in its payload.
DELEGATED = [(c, c.by_executorch) for c in named("xnnpack-linear", "execupy-mixed_partition")]


@pytest.mark.parametrize("c, has_named_data", DELEGATED, ids=[c.name for c, _ in DELEGATED])
def test_delegates_report_payload_sizes_and_named_data(c, has_named_data, capsys):
    rc, info = inspect_json(c.pte, capsys)
    (m,) = info["methods"]
    assert m["delegates"] and all(d["payload_bytes"] > 0 for d in m["delegates"])
    segment_sizes = {s["index"]: s["size"] for s in info["segments"]}
    for d in m["delegates"]:
        if d["location"] == "segment":
            assert d["payload_bytes"] == segment_sizes[d["data_index"]]
    assert bool(info["named_data"]) == has_named_data
    assert all(n["bytes"] == segment_sizes[n["segment_index"]] for n in info["named_data"])
    assert info["header"]["extended_header"]["segment_base_offset"] % 128 == 0


@pytest.mark.parametrize("c", MULTI, ids=program_name)
def test_text_summary_names_methods_operators_and_memory(c, capsys):
    rc = main(["inspect", str(c.pte)])
    text = capsys.readouterr().out
    assert rc == 0
    for fragment in ("method 'encode'", "method 'decode'", "aten::addmm.out", "planned memory: arena 1", "ET12"):
        assert fragment in text


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda b: b[:40], "but the file has 40 bytes"),
        (lambda b: b"", "empty"),
        (lambda b: b"PK\x03\x04" + bytes(100), "not an ExecuTorch program"),
        (lambda b: b[:8] + b"eh00" + b"\xff" * 28 + b[40:], "extended header"),
    ],
    ids=["truncated", "empty", "zip file", "bad header"],
)
@pytest.mark.parametrize("c", named("portable-lstm", "execupy-llama_block"), ids=program_name)
def test_inspect_reports_problems_of_broken_files(c, damage, message, tmp_path, capsys):
    path = tmp_path / "broken.pte"
    path.write_bytes(damage(c.pte.read_bytes()))
    rc = main(["inspect", str(path)])
    out = capsys.readouterr().out
    assert rc == 1
    assert "problems:" in out and message in out


def test_summary_of_bytes_never_raises_on_random_data():
    rng = np.random.default_rng(0)
    for n in (0, 3, 8, 64, 4096):
        info = summarize(rng.integers(0, 256, n, dtype=np.uint8).tobytes())
        assert info["problems"], n
        assert format_summary(info).startswith("file: <bytes>")


def test_inspect_missing_file(capsys):
    assert main(["inspect", "/nonexistent/model.pte"]) == 1
    assert "No such file" in capsys.readouterr().out


@pytest.mark.parametrize("c", MULTI, ids=program_name)
def test_inspect_load_flag_loads_every_method(c, capsys):
    rc, info = inspect_json(c.pte, capsys)
    assert all("loads" not in m for m in info["methods"])
    main(["inspect", str(c.pte), "--json", "--load"])
    info = json.loads(capsys.readouterr().out)
    assert all(m["loads"] for m in info["methods"]) and info["warnings"] == []


# ---------------------------------------------------------------------------- run


@pytest.mark.parametrize("c", LLAMA, ids=program_name)
def test_run_with_case_inputs_saves_the_reference_outputs(c, tmp_path, capsys):
    run = c.manifest["runs"][0]
    inputs = load_inputs(c, run)
    np.savez(tmp_path / "in.npz", **{f"in{k}": x for k, x in enumerate(inputs)})
    rc = main(["run", str(c.pte), "--inputs", str(tmp_path / "in.npz"), "--repeat", "2",
               "--save", str(tmp_path / "out.npz")])
    out = capsys.readouterr().out
    assert rc == 0
    assert "output 0: float32" in out and "execute: 2 run(s)" in out
    saved = np.load(tmp_path / "out.npz")
    for k, expected in enumerate(expected_outputs(c, run)):
        assert mismatch(saved[f"out{k}"], expected, c.manifest["tolerance"]["atol"], c.manifest["tolerance"]["rtol"]) is None


@pytest.mark.parametrize("c", MULTI, ids=program_name)
def test_run_random_inputs_on_a_named_method(c, capsys):
    rc = main(["run", str(c.pte), "--method", "encode", "--random-inputs"])
    out = capsys.readouterr().out
    assert rc == 0 and "output 0: float32 [3, 4]" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--method", "nope"], "has no method 'nope'"),
        ([], "give --inputs IN.npz or --random-inputs"),
        (["--random-inputs", "--repeat", "0"], "--repeat must be at least 1"),
    ],
)
@pytest.mark.parametrize("c", MULTI, ids=program_name)
def test_run_errors_are_one_line(c, argv, message, capsys):
    rc = main(["run", str(c.pte), *argv])
    err = capsys.readouterr().err
    assert rc == 1 and err.startswith("error: ") and message in err


@pytest.mark.parametrize("c", named("execupy-unknown_backend"), ids=program_name)
def test_run_on_a_program_for_an_unknown_backend_names_it(c, capsys):
    rc = main(["run", str(c.pte), "--random-inputs"])
    assert rc == 1 and "NoSuchBackend" in capsys.readouterr().err


def test_python_dash_m_execupy_help_and_error_exit():
    help_proc = subprocess.run([sys.executable, "-m", "execupy", "--help"], cwd=REPO, capture_output=True, text=True)
    assert help_proc.returncode == 0 and "inspect" in help_proc.stdout and "run" in help_proc.stdout
    bad = subprocess.run([sys.executable, "-m", "execupy", "run", "/nonexistent.pte"], cwd=REPO,
                         capture_output=True, text=True)
    assert bad.returncode == 1 and bad.stderr.startswith("error:") and "Traceback" not in bad.stderr
