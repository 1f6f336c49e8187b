#!/usr/bin/env bash
# The device session's one prepared check (see benchmarks/device_check.py). The device machine has
# no network: it uses the image's python3 with its JAX, and installs this repo without dependencies.
#   device run: bash benchmarks/device_check.sh        (results in $OUT/device_check.json, $OUT/step_audit.json)
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || python3 -m pip install -q --no-deps -e .
export PYTHONUNBUFFERED=1
python3 -m benchmarks.device_check --out="${OUT:-/tmp}/device_check.json" "$@" 2>&1 | tee "${OUT:-/tmp}/device_check.log"
# the compiled step read without running it (benchmarks/step_audit.py), on this device's backend
timeout 300 python3 -m benchmarks.step_audit --models=llama-1b-shape --tp=1 --out="${OUT:-/tmp}/step_audit.json" 2>&1 \
  | tee "${OUT:-/tmp}/step_audit.log" || echo "step audit: failed or past 300 s (see step_audit.log)"
# the sampler's top-p search against a sort of the vocabulary, on this device (benchmarks/sampler.py)
timeout 120 python3 -m benchmarks.sampler --vocabs=128256,201088 --rows=1,8,64 --reps=3 --out="${OUT:-/tmp}/sampler.json" \
  2>&1 | tee "${OUT:-/tmp}/sampler.log" || echo "sampler: failed or past 120 s (see sampler.log)"
