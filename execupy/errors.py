"""Every error execupy raises on purpose derives from ExecupyError.

Callers catch the subclass that fits: a malformed program, an operator the runtime has no
kernel for, a backend that is not registered, or a bad input from the caller.
"""


class ExecupyError(Exception):
    """Base class of all errors raised by execupy."""


class MalformedProgramError(ExecupyError):
    """The .pte bytes are truncated, corrupted or inconsistent."""


class UnsupportedOperatorError(ExecupyError):
    """An instruction names an operator that has no registered kernel."""


class MissingBackendError(ExecupyError):
    """A delegate call names a backend that is not registered or not available."""


class InvalidInputError(ExecupyError, ValueError):
    """An input given to a method has the wrong count, dtype, rank or shape."""


class KernelError(ExecupyError):
    """A kernel failed while executing an instruction (names the instruction and op)."""


class ExportError(ExecupyError):
    """The exporter cannot turn a model into a program (names the op and source line)."""


class MethodNotFoundError(ExecupyError, KeyError):
    """The program has no method of the requested name."""

    def __str__(self) -> str:  # KeyError would print the message with quotes
        return str(self.args[0]) if self.args else ""


class CheckpointError(ExecupyError, ValueError):
    """A model checkpoint (GGUF, HF folder, Meta folder) cannot be read or is inconsistent."""


class TokenizerError(ExecupyError, ValueError):
    """A tokenizer file cannot be read or does not fit the model."""


class MalformedETDumpError(ExecupyError):
    """An ETDump trace (.etdp) or its debug buffer is truncated, corrupted or inconsistent."""
