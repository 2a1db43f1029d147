#!/usr/bin/env bash
# Regenerate every benchmark result under benchmarks/results/ (JSON, PNG, log). Run it on a quiet
# machine: the scripts time real work on all cores, and another busy process distorts every number
# (2-thread OpenMP regions are hit hardest). About 1-2 hours on the 2-core CPU machine.
#
#   benchmarks/run_all.sh            # full runs, 3 repetitions each
#   benchmarks/run_all.sh --quick    # a few minutes: checks that every script runs (results/*-quick.*)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
QUICK=()
[[ "${1:-}" == "--quick" ]] && QUICK=(--quick)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

echo "== machine"; uname -a; nproc; free -g | head -2; "$PY" -c "import torch, vllm, ray, zmq; print('torch', torch.__version__, 'vllm', vllm.__version__, 'ray', ray.__version__, 'pyzmq', zmq.__version__)"
echo "== bench_transport";   "$PY" benchmarks/bench_transport.py "${QUICK[@]}"
echo "== bench_scaling";     "$PY" benchmarks/bench_scaling.py "${QUICK[@]}"
echo "== bench_e2e (+ TRL)"; "$PY" benchmarks/bench_e2e.py "${QUICK[@]}"
echo "== bench_sim";         "$PY" benchmarks/bench_sim.py "${QUICK[@]}"
if [[ ${#QUICK[@]} -eq 0 ]]; then
  echo "== bench_e2e, wide preset"; "$PY" benchmarks/bench_e2e.py --preset wide --steps 8 --warmup 2 --lags 2
  echo "== bench_weight_sync"; "$PY" benchmarks/bench_weight_sync.py
  echo "== bench_e2e, real preset (SmolLM2-135M, arithmetic, natural EOS; + TRL)"
  "$PY" benchmarks/bench_e2e.py --preset real --prompts 4 --group 4 --reps 3 --steps 6 --warmup 2 --lags 1,2
  echo "== bench_limits";    "$PY" benchmarks/bench_limits.py
fi
