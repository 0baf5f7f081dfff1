"""The Program data model and `.pte` read/write (torch-free)."""
from .program import *  # noqa: F401,F403
from .reader import PteFile, read_pte  # noqa: F401
