"""The start of a child script that must run where torch cannot be imported: a meta-path
finder refuses torch and executorch, and the script stops at once if the refusal fails."""

BLOCK_TORCH = r'''
import importlib.abc, sys
class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "executorch"):
            raise ImportError(f"{name} is blocked in this torch-free test")
sys.meta_path.insert(0, NoTorch())
try:
    import torch
    sys.exit("the torch blocker does not work")
except ImportError:
    pass
'''
