#!/usr/bin/env bash
# The whole test suite (`make test`), in two pytest sessions side by side:
#   - the launched training runs (tests/launched/, marker multiproc, set by tests/conftest.py from the directory;
#     Slurm's aside), which keep both cores busy only part of the time: a single-process run, a launcher starting,
#     a rank waiting for its peer;
#   - beside them, the unit tests (tests/unit/), the Slurm jobs (tests/launched/test_slurm.py: mostly waiting on
#     slurmd) and the launched tests marked `beside` (one process at a time, or mostly waiting, which fill those gaps;
#     and a few long ones that balance the two sessions' times). Its output is printed after the first session's.
# Each session forks most of its training runs from a process that imported torch once (tests/forkserver.py;
# DIST_TRAIN_TEST_FORK=0 launches every run for real).
# Two launched runs side by side would not gain: on 2 cores they slow each other down by more than they overlap
# (measured: tests/launched/test_strategies_core.py + tests/launched/test_zero.py took 138 s as two pytest-xdist
# workers, 123 s as one).
# Each session has a temporary directory of its own, so that neither cleans up the other's.
set -u
cd "$(dirname "$0")/.."
PY=${PY:-python}
base=$(mktemp -d)
side_log="$base/side.log"
"$PY" -m pytest -q -p no:cacheprovider --basetemp="$base/side" -m "not multiproc or slurm or beside" "$@" >"$side_log" 2>&1 &
side=$!
"$PY" -m pytest -q -p no:cacheprovider --basetemp="$base/launched" -m "multiproc and not slurm and not beside" "$@"
launched=$?
wait "$side"
side_code=$?
echo
echo "======== beside it: the unit tests and the Slurm jobs ========"
cat "$side_log"
rm -rf "$base"
# pytest's 5: no test selected (a marker expression that matched nothing here) is not a failure.
for code in "$launched" "$side_code"; do
    if [ "$code" -ne 0 ] && [ "$code" -ne 5 ]; then exit "$code"; fi
done
exit 0
