#!/usr/bin/env bash
# Fuzzes every parser of outside input with libFuzzer (cargo-fuzz), each target for a bounded
# time, starting from the committed corpus under fuzz/corpus/. What a run discovers goes to a
# scratch directory, so the committed corpus only changes when someone copies inputs into it.
#
#   scripts/fuzz.sh                 every target, KVMESH_FUZZ_SECS (default 20) seconds each
#   scripts/fuzz.sh gguf config     only these targets
#   KVMESH_FUZZ_SECS=600 scripts/fuzz.sh openai_request
#   KVMESH_FUZZ_SEED=0 scripts/fuzz.sh   a random seed (the default, 1, repeats a run's inputs)
#   KVMESH_FUZZ_PROFILE=dev scripts/fuzz.sh   the quick build scripts/test.sh uses (fuzz/Cargo.toml)
#
# A crash, a failed check, a timeout (10 s on one input), more than 256 MiB allocated at once
# (fuzz/src/lib.rs) or an RSS over 2 GiB fails the run; the input that did it is kept under
# fuzz/artifacts/<target>/, and the line to replay it is printed. docs/fuzzing.md has the
# targets and what each one checks.
set -euo pipefail
cd "$(dirname "$0")/.."

secs="${KVMESH_FUZZ_SECS:-20}"
seed="${KVMESH_FUZZ_SEED:-1}"
profile="${KVMESH_FUZZ_PROFILE:-release}"
# 0 would mean "no limit" to libFuzzer: never a bounded run.
case "$secs" in
  '' | *[!0-9]* | 0) echo "fuzz.sh: KVMESH_FUZZ_SECS must be a whole number of seconds >= 1, not '$secs'" >&2; exit 2 ;;
esac
case "$seed" in
  '' | *[!0-9]*) echo "fuzz.sh: KVMESH_FUZZ_SEED must be a whole number (0: random), not '$seed'" >&2; exit 2 ;;
esac
case "$profile" in
  release | dev) ;;
  *) echo "fuzz.sh: KVMESH_FUZZ_PROFILE must be release or dev, not '$profile'" >&2; exit 2 ;;
esac

if ! cargo fuzz --version >/dev/null 2>&1; then
  echo "fuzz.sh: installing cargo-fuzz" >&2
  cargo install cargo-fuzz --locked --version 0.13.2
fi

# -s none: no AddressSanitizer, so the build works on the stable toolchain. The project's own
# code forbids `unsafe` (out-of-bounds access is a panic, which is caught); the unsafe code in
# dependencies (blake3, chacha20poly1305, serde_json, ...) is not checked for memory errors. Overflow
# checks are on (fuzz/Cargo.toml), which is what catches arithmetic on hostile lengths.
fuzz=(cargo fuzz)
build_flags=(-s none "--$profile")
limits=(-timeout=10 -rss_limit_mb=2048 -max_len=65536)

# The committed lock must be complete: a build never re-resolves dependencies silently.
cargo metadata --manifest-path fuzz/Cargo.toml --locked --format-version 1 >/dev/null
all=$(cd fuzz && "${fuzz[@]}" list)
if [ "$#" -gt 0 ]; then
  targets=("$@")
  for t in "${targets[@]}"; do
    grep -qxF -- "$t" <<<"$all" || { echo "fuzz.sh: no fuzz target '$t' (targets: $(echo $all))" >&2; exit 2; }
  done
else
  mapfile -t targets <<<"$all"
fi

(cd fuzz && "${fuzz[@]}" build "${build_flags[@]}")

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
failed=()
printf '%-22s %8s %10s %10s %s\n' target seconds runs corpus result
for t in "${targets[@]}"; do
  mkdir -p "$scratch/$t" "fuzz/artifacts/$t" "fuzz/corpus/$t"
  log="$scratch/$t.log"
  set +e
  (cd fuzz && "${fuzz[@]}" run "${build_flags[@]}" "$t" "$scratch/$t" "corpus/$t" -- \
    -max_total_time="$secs" -seed="$seed" "${limits[@]}" -print_final_stats=1) >"$log" 2>&1
  rc=$?
  set -e
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  units=$(find "$scratch/$t" "fuzz/corpus/$t" -type f | wc -l)
  if [ "$rc" -eq 0 ]; then
    result=ok
  else
    result="FAILED (exit $rc)"
    failed+=("$t")
  fi
  printf '%-22s %8s %10s %10s %s\n' "$t" "$secs" "${runs:-?}" "$units" "$result"
  if [ "$rc" -ne 0 ]; then
    { grep -E -A2 'panicked|ERROR: libFuzzer|Test unit written' "$log" || tail -20 "$log"; } | head -30 | sed 's/^/    /'
    echo "    replay: (cd fuzz && cargo fuzz run ${build_flags[*]} $t artifacts/$t/<file> -- ${limits[*]})"
  fi
done
if [ "${#failed[@]}" -gt 0 ]; then
  echo "fuzz.sh: ${#failed[@]} target(s) failed: ${failed[*]}" >&2
  exit 1
fi
