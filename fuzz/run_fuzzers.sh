#!/usr/bin/env bash
# Runs every libFuzzer target for a bounded time and reports its speed.
# Usage: fuzz/run_fuzzers.sh BUILD_DIR [SECONDS] [TARGET...]
#   BUILD_DIR  a build configured with -DLEAP_BUILD_FUZZERS=ON (clang), e.g.
#              CC=clang CXX=clang++ cmake -S . -B build-fuzz -G Ninja \
#                -DLEAP_BUILD_FUZZERS=ON -DLEAP_BUILD_BENCHMARKS=OFF
#              (the targets are built here if they are not yet).
#   SECONDS    fuzzing time per target (default 60).
#   TARGET     npy, artifact, shm, shm_frames, engine_session (default: all).
# Each target first replays fuzz/regressions/<target>/ (every crash found so
# far), then fuzzes for SECONDS on a copy of fuzz/corpus/<target>/ (the
# committed corpus is not changed), one process, one thread, LEAP_FUZZ_JOBS
# (default: the number of cores) targets at a time. It prints
# executions per second and total executions per target and exits non-zero
# when any target crashed, leaked, ran out of memory or hung; the inputs that
# did so are kept under $FUZZ_OUT (default: a new folder under /tmp) and
# named in the output (a folder made here is removed when every target
# passed). Turn each into a regression: copy it into
# fuzz/regressions/<target>/ and fix the code.
set -uo pipefail
if [ $# -lt 1 ]; then
  sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
BUILD_DIR=$1
SECONDS_EACH=${2:-60}
shift $(( $# >= 2 ? 2 : 1 ))
TARGETS=("$@")
[ ${#TARGETS[@]} -eq 0 ] && TARGETS=(npy artifact shm shm_frames engine_session)
SRC=$(cd "$(dirname "$0")" && pwd)
OUT=${FUZZ_OUT:-$(mktemp -d /tmp/leap-fuzz.XXXXXX)}
mkdir -p "$OUT"

bins=()
for t in "${TARGETS[@]}"; do bins+=("fuzz_$t"); done
cmake --build "$BUILD_DIR" --target "${bins[@]}" >"$OUT/build.log" 2>&1 || {
  echo "run_fuzzers: building ${bins[*]} in $BUILD_DIR failed (see $OUT/build.log;" \
       "configure with -DLEAP_BUILD_FUZZERS=ON and clang)" >&2
  exit 2
}

# One target: regressions, then SECONDS of fuzzing; writes its summary
# line (status last: "ok" when it passed) to $OUT/$t.summary.
run_target() {
  local t=$1 bin="$BUILD_DIR/fuzz/fuzz_$1" log="$OUT/$1.log" rc execs rate status
  mkdir -p "$OUT/corpus/$t" "$OUT/crashes/$t"
  cp -r "$SRC/corpus/$t/." "$OUT/corpus/$t/" 2>/dev/null || true
  local common=(-rss_limit_mb=2048 -timeout=30 -print_final_stats=1
                "-artifact_prefix=$OUT/crashes/$t/")
  # 1. Every crash found before must stay fixed.
  if compgen -G "$SRC/regressions/$t/*" >/dev/null; then
    if ! "$bin" "${common[@]}" -runs=0 "$SRC/regressions/$t" >"$OUT/$t.regressions.log" 2>&1; then
      echo "FAIL $t: a regression input crashes again (see $OUT/$t.regressions.log)"
      printf '%-16s %12s %14s  %s\n' "$t" - - "REGRESSION CRASH" >"$OUT/$t.summary"
      return
    fi
  fi
  # 2. Fuzz for SECONDS.
  "$bin" "${common[@]}" -max_total_time="$SECONDS_EACH" "$OUT/corpus/$t" >"$log" 2>&1
  rc=$?
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1)
  status=ok
  if [ $rc -ne 0 ]; then
    status="CRASH (rc $rc): $(ls "$OUT/crashes/$t" | tr '\n' ' ')"
    echo "FAIL $t: libFuzzer exited $rc; log $log; inputs in $OUT/crashes/$t/"
    grep -m3 -E "ERROR: |SUMMARY: |FUZZ_CHECK" "$log" | sed 's/^/  /'
  fi
  printf '%-16s %12s %14s  %s\n' "$t" "${rate:-?}" "${execs:-?}" "$status" >"$OUT/$t.summary"
}

# LEAP_FUZZ_JOBS targets at a time (default: the cores this process may
# use); each target is one single-threaded process.
JOBS=${LEAP_FUZZ_JOBS:-$(nproc)}
[ "$JOBS" -ge 1 ] 2>/dev/null || JOBS=1
echo "run_fuzzers: ${#TARGETS[@]} targets, ${SECONDS_EACH} s each, $JOBS at a time"
for t in "${TARGETS[@]}"; do
  while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n || true; done
  run_target "$t" &
done
wait
failed=0
summary=()
for t in "${TARGETS[@]}"; do
  line=$(cat "$OUT/$t.summary" 2>/dev/null) || line="$t  (no result)"
  [[ "$line" == *"  ok" ]] || failed=1
  summary+=("$line")
done

echo
printf '%-16s %12s %14s  %s\n' target "execs/s" "total execs" status
for line in "${summary[@]}"; do echo "$line"; done
if [ $failed -eq 0 ] && [ -z "${FUZZ_OUT:-}" ]; then
  # Nothing to look at: the folder this run made goes (set FUZZ_OUT to keep it).
  rm -rf "$OUT"
  echo "all targets passed; removed $OUT (set FUZZ_OUT=DIR to keep the logs)"
else
  echo "logs and any crashing inputs: $OUT"
fi
exit $failed
