#!/usr/bin/env bash
# One-shot, unattended check of CollectiveLoader on this machine's GPU (--cpu: on CPUs); see
# bench/gpu_check.py. Exit code 0 only if every check passed.
# The outer timeout is the last guard (the script's worlds have their own): it signals the whole
# process group, spawned ranks included, and kills what is left 10 s later.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec timeout --kill-after=10 300 "${PYTHON:-python}" bench/gpu_check.py "$@"
