#!/usr/bin/env bash
# Set up (CPU torch, the package and its pinned test extras: pyproject.toml) and run the CPU test
# suite. No -x: one failure must not hide the rest. --durations lists the slowest tests, the ones
# to mark @pytest.mark.slow (`bash scripts/test.sh -m 'not gpu and not slow'` then skips them).
#
# With no arguments the suite runs in two parts: every test but those marked `serial` or `slow` on
# two worker processes (pytest-xdist; each test still runs torch on one thread, tests/conftest.py),
# then the `serial` tests (they time the host) alone. The `slow` tests (interpreter-driven engine
# runs of the GPU step, minutes each on 2 cores) run with `bash scripts/test.sh -m slow` (or
# `-n 2 -m slow`). With arguments, pytest runs them as given, in one process.
set -euo pipefail
cd "$(dirname "$0")/.."
# torch first, on its own: 2.13.0 resolves to the CPU build from the machine's local wheel index
# (pip's find-links), not the CUDA build from PyPI.
python3 -m pip install -q torch==2.13.0
python3 -m pip install -q -e ".[server,bench,test]"
# The playground's browser test (tests/server/test_ui_browser.py) drives Debian's Chromium and
# skips without it: installed here when apt-get is there and we are root. A failed install only
# means that test skips; it never fails the run.
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  { timeout 300 apt-get update -qq && DEBIAN_FRONTEND=noninteractive timeout 600 apt-get install -y -qq \
      --no-install-recommends chromium >/dev/null; } || echo "chromium was not installed: the browser test will skip"
fi
if [ $# -gt 0 ]; then
  exec python3 -m pytest -q --durations=25 "$@"
fi
status=0
python3 -m pytest -q --durations=25 -n 2 -m "not gpu and not serial and not slow" || status=$?
python3 -m pytest -q -m "serial and not gpu" || status=$?
exit $status
