"""LLM subcommands of the execupy CLI (export-llm, generate, chat)."""


def register(subparsers) -> None:
    """Add the LLM subcommands to the CLI's argparse subparsers."""
