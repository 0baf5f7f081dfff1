"""`execupy serve MODEL.pte [--host 127.0.0.1] [--port 8000]`: the OpenAI-compatible server."""
from __future__ import annotations

import argparse


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "serve", help="serve an exported LLM (.pte) over an OpenAI-compatible HTTP API",
        description="Serve one exported LLM over HTTP: POST /v1/chat/completions, POST /v1/completions, "
        "GET /v1/models, GET /health. One generation runs at a time; other requests wait in a bounded queue "
        "(503 when it is full). One log line per request on stderr. Needs the serve extra.")
    p.add_argument("model", help="the .pte from export-llm")
    p.add_argument("--tokenizer", metavar="FILE", help="tokenizer file (default: the one next to the .pte)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--model-name", default=None, help="the model id clients name (default: the file's stem)")
    p.add_argument("--queue-size", type=int, default=32,
                   help="requests that may wait while one generates (at least 1); more get 503 (default 32)")
    p.add_argument("--max-tokens", type=int, default=256,
                   help="completion tokens when a request does not say (default 256)")
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    from execupy.errors import InvalidInputError

    try:
        from execupy.serve.app import serve
    except ImportError as e:  # starlette or uvicorn
        raise InvalidInputError(f"execupy serve needs the serve extra ({e.name} is not installed): "
                                "pip install 'execupy[serve]'") from None

    return serve(args)
