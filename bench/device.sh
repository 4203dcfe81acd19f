#!/usr/bin/env bash
# The benchmark on the GPU machine: installs the wheels, then runs suites (bench/suites.py) with bench/run.py.
#   bash bench/device.sh <suite> [<suite> ...] [run.py options: --only GLOB, --missing, --budget-s S]
# Here first: `bash ../shared/device/wheels.sh`; carry `.whl` (and `.carry-peers` for the peers suites).
# Results come back packed in one file, $OUT/results.tgz (results/<suite>/<row key>.json, and a failed row's log in
# logs/; a call returns at most 8 files): here, `python bench/run.py --take <files_at>` copies them into
# bench/results/<suite>/ (a newer file of a row replaces the older); then `python bench/bench.py report --docs docs/performance.md`.
# `python bench/run.py --list <suite> [--only GLOB] [--missing]` shows the rows and commands such a call would run.
# On a machine of several GPUs the bench and memory calls of different families run side by side, one family to
# a GPU (bench/run.py --gpus; the default is every GPU): name several families' suites in one call.
set -eu
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=index,name,memory.used --format=csv,noheader
df -h /dev/shm /tmp | tail -2
rc=0
python3 bench/run.py "$@" || rc=$?
grep -h "^\[\(bench\|memory\|peers\)\]" /tmp/lorapipe-run/logs/*.log 2>/dev/null | cut -c1-300 || true
if [ -n "${OUT:-}" ]; then python3 bench/run.py --pack "$OUT"; fi
exit $rc
