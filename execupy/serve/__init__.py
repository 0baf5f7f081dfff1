"""An OpenAI-compatible HTTP server for exported LLMs (`execupy serve MODEL.pte`), torch-free.

`protocol.py` parses and checks requests and shapes responses and errors as OpenAI's API
does; `engine.py` owns the LLMRunner and runs one generation at a time from a bounded
queue in a worker thread; `app.py` is the starlette application; `cli.py` the command.
Needs the `serve` extra (starlette, uvicorn).
"""
