"""Runs one .pte in ExecuTorch's own runtime; executed by the reference venv's python,
never imported by execupy or by the tests' own process.

    <reference venv>/bin/python tests/reference_worker.py MODEL.pte --out out.npz
        [--inputs in.npz] [--method forward] [--calls N]

Inputs are arrays named in0, in1, ... (in argument order); for N > 1 calls, call{k}_in{i}
overrides in{i} for call k. A name ending in __bf16 holds bfloat16 bits as uint16, one
ending in __scalar a Python number. Outputs come back the same way, as out{i} (or
call{k}_out{i}). ExecuTorch's quantized_decomposed:: and llama:: kernels are registered
first. Exit status 3 means ExecuTorch refused or failed the program (its message on stderr).
"""
import argparse
import importlib
import sys

import numpy as np
import torch


def register_extra_kernels() -> None:
    for name in ("executorch.kernels.quantized", "executorch.extension.llm.custom_ops.custom_ops"):
        try:
            importlib.import_module(name)
        except Exception as exc:  # a build without them still runs portable programs
            print(f"reference_worker: could not register {name}: {exc}", file=sys.stderr)


def to_torch(name: str, array: np.ndarray):
    if name.endswith("__bf16"):
        return torch.from_numpy(array.astype(np.uint16).view(np.int16)).view(torch.bfloat16)
    if name.endswith("__scalar"):
        return array.item()
    return torch.from_numpy(np.array(array, copy=True, order="C"))


def inputs_for(data, call: int) -> tuple:
    """in{i} arrays in index order, each replaced by call{call}_in{i} when that exists."""
    by_index = {}
    for prefix in ("", f"call{call}_"):
        for name in data.files:
            if name.startswith(prefix + "in") and (prefix or not name.startswith("call")):
                index = int(name[len(prefix) + 2:].split("__")[0])
                by_index[index] = to_torch(name, data[name])
    return tuple(by_index[i] for i in sorted(by_index))


def to_numpy(value) -> tuple[str, np.ndarray]:
    if isinstance(value, torch.Tensor):
        if value.dtype == torch.bfloat16:
            return "__bf16", value.view(torch.int16).numpy().view(np.uint16)
        return "", value.detach().numpy()
    return "__scalar", np.asarray(value)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--out", required=True)
    parser.add_argument("--inputs")
    parser.add_argument("--method", default="forward")
    parser.add_argument("--calls", type=int, default=1)
    args = parser.parse_args()
    register_extra_kernels()
    from executorch.extension.pybindings.portable_lib import _load_for_executorch

    try:
        module = _load_for_executorch(args.model)
    except Exception as exc:
        print(f"reference_worker: load failed: {exc}", file=sys.stderr)
        return 3
    data = np.load(args.inputs) if args.inputs else None
    saved = {}
    for call in range(args.calls):
        inputs = inputs_for(data, call) if data is not None else ()
        try:
            outputs = module.run_method(args.method, inputs)
        except Exception as exc:
            print(f"reference_worker: execution failed: {exc}", file=sys.stderr)
            return 3
        prefix = f"call{call}_" if args.calls > 1 else ""
        for i, value in enumerate(outputs):
            suffix, array = to_numpy(value)
            saved[f"{prefix}out{i}{suffix}"] = array
    np.savez(args.out, **saved)
    return 0


if __name__ == "__main__":
    sys.exit(main())
