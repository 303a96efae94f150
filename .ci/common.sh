# Sourced by the CI scripts (.ci/run, .ci/probes.sh, .ci/wheel.sh); not run on its own.

# shellcheck source=.ci/multicast_off.sh
. .ci/multicast_off.sh  # docs/spec.md §8, the scripts' own children included

step() {  # step <description> <command...>: show it, time it, stop the script on failure
  local what="$1"; shift
  echo "=== $what: $*"
  local t0=$SECONDS
  if ! "$@"; then echo "=== FAILED: $what" >&2; exit 1; fi
  echo "=== ok: $what ($((SECONDS - t0)) s)"
}
