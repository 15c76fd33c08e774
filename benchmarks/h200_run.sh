#!/usr/bin/env bash
# Runs a list of benchmark/test steps on the lent H200 in one call and packs every result into
# one tarball under $OUT (the device returns at most 8 files).
#   bash benchmarks/h200_run.sh "name:seconds:command" ...
set -u
R="${OUT:-/tmp/out}/r"; mkdir -p "$R"
export PYTHONPATH="$PWD/src:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > "$R/gpu.txt" 2>&1
if ls .wheels/*.whl >/dev/null 2>&1; then python3 -m pip install -q --no-deps .wheels/*.whl > "$R/pip.log" 2>&1; fi
for step in "$@"; do
  name="${step%%:*}"; rest="${step#*:}"; secs="${rest%%:*}"; cmd="${rest#*:}"
  start=$(date +%s)
  timeout -k 5 "$secs" bash -c "$cmd" > "$R/$name.log" 2>&1
  rc=$?
  echo "== $name rc=$rc $(( $(date +%s) - start ))s"; tail -n 12 "$R/$name.log"
done
tar -C "$R/.." -czf "${OUT:-/tmp/out}/results.tgz" r
