#!/usr/bin/env bash
# The C++ tests (tests/cpp: the NCCL emulator and communicator, the HCCL fake, the TCP shrink and
# auth) built and run under sanitizers, each set in its own build tree:
#   bash scripts/sanitize.sh                      # address,undefined then thread
#   bash scripts/sanitize.sh thread               # one set
# Needs the venv of scripts/setup.sh. A finding fails the run (-fno-sanitize-recover=all); the
# exit status is the first failing set's. Build trees go to build-sanitize/, out of the way of
# tests/unit/test_cpp.py (which runs the newest build/*/rc_cpp_tests).
set -euo pipefail
cd "$(dirname "$0")/.."
VPY=.venv/bin/python
[ -x "$VPY" ] || { echo "run scripts/setup.sh first" >&2; exit 2; }
SETS=("$@")
[ ${#SETS[@]} -gt 0 ] || SETS=(address,undefined thread)
JOBS=${JOBS:-$(nproc)}
status=0
mkdir -p build-sanitize
for san in "${SETS[@]}"; do
  dir="build-sanitize/${san//,/-}"
  echo "[sanitize] $san: building rc_cpp_tests in $dir"
  gen=()
  [ -x .venv/bin/ninja ] && gen=(-G Ninja -DCMAKE_MAKE_PROGRAM="$PWD/.venv/bin/ninja")
  .venv/bin/cmake -S . -B "$dir" "${gen[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPython3_EXECUTABLE="$PWD/$VPY" \
    -DRESILIENT_COMM_SANITIZE="$san" -DRESILIENT_COMM_BUILD_BENCHMARKS=OFF > "$dir.configure.log" 2>&1 ||
    { cat "$dir.configure.log"; exit 2; }
  .venv/bin/cmake --build "$dir" --target rc_cpp_tests --parallel "$JOBS" > "$dir.build.log" 2>&1 ||
    { tail -50 "$dir.build.log"; exit 2; }
  echo "[sanitize] $san: running"
  # Leaks are not checked: torch's static registries and the emulator's never-freed
  # communicators (see EmuComm) are deliberate. Threads are joined or detached by design.
  if ASAN_OPTIONS=detect_leaks=0:abort_on_error=0 UBSAN_OPTIONS=print_stacktrace=1 \
     TSAN_OPTIONS="second_deadlock_stack=1 history_size=4" \
     "$dir/rc_cpp_tests" > "$dir.run.log" 2>&1; then
    echo "[sanitize] $san: clean ($(tail -1 "$dir.run.log"))"
  else
    rc=$?
    echo "[sanitize] $san: FAILED (exit $rc); the report:"
    grep -m1 -A40 -E "ERROR: (Address|Thread|Undefined)Sanitizer|WARNING: ThreadSanitizer|runtime error:" "$dir.run.log" ||
      tail -40 "$dir.run.log"
    [ $status -ne 0 ] || status=$rc
  fi
done
exit $status
