#!/usr/bin/env bash
# Runs the Python tests once per CPU capability and torch thread count, since both change
# the order of floating-point sums and so the rounding the tests must tolerate:
#   ATEN_CPU_CAPABILITY: unset (the best kernels this CPU has, e.g. AVX-512), avx2, default
#   (no vector kernels); VESCALE_TEST_THREADS: 1 and 2 threads per rank.
# Usage: tests/run_matrix.sh [pytest arguments]     (default: the whole Python suite)
# PY chooses the interpreter (default .venv/bin/python); logs go to out/matrix/.
set -u
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
if [ $# -eq 0 ]; then set -- tests/python tests/opinfo/test_opinfo_subset.py; fi
mkdir -p out/matrix
status=0
for cap in "" avx2 default; do
  for threads in 1 2; do
    log="out/matrix/${cap:-native}-${threads}threads.log"
    start=$SECONDS
    if [ -n "$cap" ]; then capenv=(ATEN_CPU_CAPABILITY="$cap"); else capenv=(-u ATEN_CPU_CAPABILITY); fi
    env "${capenv[@]}" VESCALE_TEST_THREADS="$threads" PYTHONPATH="$PWD" "$PY" -m pytest "$@" -q -p no:cacheprovider >"$log" 2>&1 || status=1
    printf '%-8s %s thread(s): %s (%ss; %s)\n' "${cap:-native}" "$threads" "$(tail -n 1 "$log")" "$((SECONDS - start))" "$log"
  done
done
exit $status
