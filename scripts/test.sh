#!/usr/bin/env bash
# Set up (CPU torch, the package and its test extras) and run the CPU test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q torch==2.13.0
python3 -m pip install -q -e ".[server,bench,test]"
python3 -m pytest -q -x "$@"
