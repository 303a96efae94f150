#!/usr/bin/env bash
# torch's own distributed test suite (torch.testing._internal.distributed.distributed_test) on the "detcomm"
# backend at W = 3, on CPU: the selection in tests/torch_suite/run_distributed_test.py (docs/trainers.md lists
# the results and why). Budget: 12 minutes on 2 cores (9 tests, the four PRODUCT ones included, about 65 s each on
# the loaded 2-core machine); the suite's own per-test timeouts stay in force.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=common.sh
. .ci/common.sh  # the multicast-off variables of docs/spec.md §8
PYTHON="${PYTHON:-.venv/bin/python}"
# The suite imports expecttest, one of torch's own test dependencies (not one of detcomm's).
"$PYTHON" -c "import expecttest" 2>/dev/null || "$PYTHON" -m pip install -q expecttest
# Without CI in its environment: torch's suite treats a set CI as its own CI (XML reports through xmlrunner, and
# its CI-only behaviour), which this run is not.
exec env -u CI timeout 720 "$PYTHON" tests/torch_suite/run_distributed_test.py --world-size 3 "$@"
