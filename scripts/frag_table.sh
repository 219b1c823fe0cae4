#!/usr/bin/env bash
# The fragmentation table on the simulated device, without the high-water rule: per trace and
# per configuration, peak reserved / peak live over both passes, the warm pass's driver calls
# (creates, maps, unmaps, releases of pages) and the cold pass's pages mapped, from
# `driver_calls --no-rule`.
#
#   scripts/frag_table.sh [LABEL=ENV ...]      e.g. 'default=' '2MiB=GPUPOOL_EXPANDABLE_LARGE_PAGES=0'
#
# ENV: space-separated NAME=VALUE set for that column. Environment: BIN, the driver_calls binary
# (default target/quick/examples/driver_calls; copy it elsewhere to keep measuring while you
# rebuild); TRACES, the traces (default replay/traces/*.txt.gz, ../shared/traces' llama_decode,
# and `random`, bench's random working set); CAPACITY_GIB (default 80); JOBS, replays at once
# (default 1). Prints a Markdown table; each replay's output is kept in $LOGDIR (default a
# temporary folder).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-target/quick/examples/driver_calls}
CAP=${CAPACITY_GIB:-80}
JOBS=${JOBS:-1}
[ $# -gt 0 ] || set -- 'default=' '2MiB=GPUPOOL_EXPANDABLE_LARGE_PAGES=0'
if [ -z "${TRACES:-}" ]; then
    TRACES="$(ls replay/traces/*.txt.gz)"
    for t in ../shared/traces/*.txt.gz; do
        [ -e "replay/traces/$(basename "$t")" ] || TRACES="$TRACES $t"
    done
    TRACES="$TRACES random"
fi
LOGDIR=${LOGDIR:-$(mktemp -d)}
mkdir -p "$LOGDIR"
jobs_list=()
for t in $TRACES; do
    for col in "$@"; do
        jobs_list+=("$t|$col")
    done
done
run_one() {
    local t=${1%%|*} col=${1#*|}
    local label=${col%%=*} env=${col#*=}
    local log="$LOGDIR/$(basename "$t" .txt.gz).$label.log"
    # shellcheck disable=SC2086
    env $env "$BIN" --no-rule "$t" "$CAP" >"$log" 2>&1 || echo "FAILED" >>"$log"
}
export -f run_one
export BIN CAP LOGDIR
printf '%s\n' "${jobs_list[@]}" | xargs -d '\n' -P "$JOBS" -I{} bash -c 'run_one "$@"' _ {}
header="| trace |"
sep="|---|"
for col in "$@"; do header="$header ${col%%=*} |"; sep="$sep---|"; done
echo "$header"
echo "$sep"
for t in $TRACES; do
    row="| $(basename "$t" .txt.gz) |"
    for col in "$@"; do
        log="$LOGDIR/$(basename "$t" .txt.gz).${col%%=*}.log"
        cell=$(awk '/reclaim false cold:/ { for (i = 1; i <= NF; i++) { c[$i] = $(i + 1) } }
        /reclaim false warm:/ {
            for (i = 1; i <= NF; i++) { k[$i] = $(i + 1) }
            r = k["reserved/live"]; sub(/;/, "", r)
            printf "%s; %d calls (cold %d maps)", r, k["create"] + k["map"] + k["unmap"] + k["release"], c["map"]
        }' "$log")
        row="$row ${cell:-failed} |"
    done
    echo "$row"
done
echo "(logs: $LOGDIR)"
