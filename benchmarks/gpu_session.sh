#!/usr/bin/env bash
# The next GPU session's device checks as ONE command: gpu_check.py --json, then gpu_soak.py; everything under $OUT.
#
#   On the device tool (about 8 minutes of its 10; the machine's start comes on top):
#       run(command="bash benchmarks/gpu_session.sh", carry=[".whl"], timeout_s=590)
#   Here, first, once per checkout (transformers 5.24.0, the release the figures in docs/budget.md used,
#   into .whl/, which git is told to ignore):
#       bash benchmarks/gpu_session.sh --wheels
#   Without a GPU it runs through as well (each script says so in one line), which tests/test_gpu_soak.py checks.
#
# What it assumes of the device machine (/work/.library/device/KINDS.md): no network; python3 (or $PYTHON) holds
# torch with CUDA, of whatever release (this repo's CPU pin is not needed), and numpy, pyyaml, rich,
# huggingface-hub, tokenizers, safetensors and typer; transformers is there or carried as a wheel in .whl/
# (installed with --no-deps into /tmp/site, first on the path). batchfit runs from this tree (PYTHONPATH=src),
# not installed, so no `pip install -e .` is needed (none could fetch the dependencies there).
#
# Time: gpu_check.py is cut at 270 s; gpu_soak.py gets what is left of $GPU_SESSION_SECONDS (510 s) less 30 s,
# at most its default 4.5 minutes, and stops its runs cleanly within it; `timeout` guards both.
#
# Writes under $OUT (the device tool copies it back; at most 8 files, 2 folders down): env.txt, gpu_check.json,
# gpu_check.log, gpu_soak.log, soak/soak.json, soak/calibration-caching.json,
# soak/calibration-expandable_segments.json. The logs are printed as they run too.
set -u -o pipefail
cd "$(dirname "$0")/.." || exit 2
PY=${PYTHON:-python3}

if [ "${1:-}" = "--wheels" ]; then  # here, not on the device: fetch what the device lacks
    exclude=$(git rev-parse --git-path info/exclude) && mkdir -p "$(dirname "$exclude")" || exit 2
    grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >>"$exclude"
    exec "$PY" -m pip download --quiet --no-deps --only-binary=:all: -d .whl "transformers==${TRANSFORMERS_VERSION:-5.24.0}"
fi

OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT" || exit 2
LIMIT=${GPU_SESSION_SECONDS:-510}
START=$(date +%s)
left() { echo $((LIMIT - ($(date +%s) - START))); }
export PYTHONUNBUFFERED=1

if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl &&
        export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}

{
    echo "gpu_session: $(date -u '+%Y-%m-%d %H:%M:%S UTC'), limit ${LIMIT} s, out $OUT, commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
    else
        echo "nvidia-smi: not here"
    fi
    "$PY" - <<'EOF' 2>&1
import sys

import torch
import transformers

import batchfit

print(f"python {sys.version.split()[0]} ({sys.executable}); torch {torch.__version__} (cuda {torch.version.cuda}, "
      f"available {torch.cuda.is_available()}); transformers {transformers.__version__} ({transformers.__file__}); "
      f"batchfit from {batchfit.__file__}")
EOF
} | tee "$OUT/env.txt"

echo "== gpu_check.py (at most 270 s)"
timeout -k 10 270 "$PY" benchmarks/gpu_check.py --json "$OUT/gpu_check.json" 2>&1 | tee "$OUT/gpu_check.log"
echo "gpu_check.py: exit ${PIPESTATUS[0]} after $(($(date +%s) - START)) s"

remaining=$(left)
minutes=$("$PY" -c "print(round(min(4.5, max(0.5, ($remaining - 30) / 60)), 2))")
echo "== gpu_soak.py --minutes $minutes ($remaining s left of $LIMIT)"
timeout -k 10 "$((remaining > 40 ? remaining - 10 : 30))" \
    "$PY" benchmarks/gpu_soak.py --minutes "$minutes" --out "$OUT/soak" 2>&1 | tee "$OUT/gpu_soak.log"
echo "gpu_soak.py: exit ${PIPESTATUS[0]} after $(($(date +%s) - START)) s; files: $(cd "$OUT" && find . -type f | sort | tr '\n' ' ')"
