#!/usr/bin/env bash
# End-to-end test of eagle3d@.service under a real systemd (systemd-nspawn container).
#
#   scripts/systemd_e2e.sh [--quick] [--keep] [--rootfs-only]
#
# Boots Debian bookworm minbase + systemd (built once, cached in $EAGLE3D_NSPAWN_CACHE,
# default /var/cache/eagle3d-nspawn) with `systemd-nspawn --register=no --keep-unit -b`,
# binding the base Python install, the repo and its .venv read-only at their host paths and a
# scratch directory read-write at /srv/eagle3d (the unit's default ReadWritePaths=). It installs
# the unit printed by `eagle3d unit` inside the container and a job on the tiny model, then:
#   0. a job file with an unknown key fails with exit 2 and is not restarted;
#   1. start: the unit reaches active, `systemctl status` shows our STATUS line, and
#      `eagle3-top --once --output` attaches over the socket in /run/eagle3d/JOB;
#   2. `systemctl restart` mid-run: a new main process, and the work goes on;
#   3. `kill -9` of the main process: systemd restarts it (NRestarts + 1);
#   4. a hung HF worker (EAGLE3D_FAULT=worker_hang) stops the watchdog pings, systemd logs
#      "Watchdog timeout", aborts and restarts it (NRestarts + 1);
#   5. `systemctl stop` drains: exit status 0, no stop timeout, the journal ends "run_stopped";
#   6. start again and run to the end; `eagle3d verify` passes and every sample file exists
#      exactly once; no log line carries its own timestamp;
#   7. starting the finished job again (what happens at every boot) is a clean no-op.
# --quick uses fewer samples (for CI); --keep leaves the scratch directory for inspection;
# --rootfs-only just builds the cached container image.
# Needs root. Installs debootstrap and systemd-container with apt if they are missing.
set -euo pipefail

QUICK=0
KEEP=0
ROOTFS_ONLY=0
for a in "$@"; do
    case "$a" in
        --quick) QUICK=1 ;;
        --rootfs-only) ROOTFS_ONLY=1 ;;
        --keep) KEEP=1 ;;
        -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
        *) echo "unknown argument: $a" >&2; exit 2 ;;
    esac
done

REPO=$(cd "$(dirname "$0")/.." && pwd)
VENV=${EAGLE3D_VENV:-$REPO/.venv}
CACHE=${EAGLE3D_NSPAWN_CACHE:-/var/cache/eagle3d-nspawn}
ROOTFS=$CACHE/bookworm
SUITE=bookworm
JOB=e2e
UNIT=eagle3d@$JOB.service
SAMPLES=${EAGLE3D_E2E_SAMPLES:-$([ "$QUICK" = 1 ] && echo 320 || echo 600)}
# The HF worker rests this long after each batch (EAGLE3D_FAULT=worker_slow), so the job takes
# a known minimum time: each step must act while the run is still going, and a fast machine
# (or faster batching) once finished the job between a step's check and its action.
PACE_MS=${EAGLE3D_E2E_PACE_MS:-400}
T0=$(date +%s)

log() { printf '[e2e %4ds] %s\n' "$(( $(date +%s) - T0 ))" "$*" >&2; }
die() { log "FAIL: $*"; exit 1; }

[ "$(id -u)" = 0 ] || die "needs root (debootstrap, systemd-nspawn, nsenter)"
[ -x "$VENV/bin/python" ] || die "no venv at $VENV (run scripts/bootstrap)"

# -- tools ---------------------------------------------------------------------------------
need=()
command -v debootstrap >/dev/null || need+=(debootstrap)
command -v systemd-nspawn >/dev/null || need+=(systemd-container)
command -v nsenter >/dev/null || need+=(util-linux)
if [ ${#need[@]} -gt 0 ]; then
    log "installing ${need[*]}"
    apt-get update -q >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need[@]}" >/dev/null
fi

# -- rootfs (cached) -----------------------------------------------------------------------
mirror() {
    # The Debian mirror apt already uses (deb822 sources first, then one-line sources).
    local m=""
    if compgen -G "/etc/apt/sources.list.d/*.sources" >/dev/null; then
        m=$(awk '/^URIs:/ && $2 ~ /debian\/?$/ && $2 !~ /security/ {print $2; exit}' \
            /etc/apt/sources.list.d/*.sources)
    fi
    if [ -z "$m" ] && [ -f /etc/apt/sources.list ]; then
        m=$(awk '$1=="deb" && $3 !~ /security/ {print $2; exit}' /etc/apt/sources.list)
    fi
    echo "${m:-http://deb.debian.org/debian}"
}

# Shared libraries the pyenv-built interpreter's extension modules link against, plus
# libstdc++/libgomp for torch; minbase has glibc, zlib and little else.
PKGS=systemd,systemd-sysv,dbus,libffi8,libssl3,libsqlite3-0,libbz2-1.0,liblzma5,zlib1g,libreadline8,libncursesw6,libnsl2,libuuid1,libstdc++6,libgomp1,procps
if [ ! -f "$ROOTFS/.eagle3d-complete" ]; then
    M=$(mirror)
    log "building rootfs $ROOTFS from $M (once; ~1 min)"
    rm -rf "$ROOTFS.tmp"
    mkdir -p "$CACHE"
    debootstrap --variant=minbase --include="$PKGS" "$SUITE" "$ROOTFS.tmp" "$M" \
        >"$CACHE/debootstrap.log" 2>&1 || { tail -20 "$CACHE/debootstrap.log" >&2; die "debootstrap"; }
    # No getty on the container console, and no network waits.
    chroot "$ROOTFS.tmp" systemctl mask console-getty.service systemd-networkd-wait-online.service \
        >/dev/null 2>&1 || true
    echo "$PKGS" >"$ROOTFS.tmp/.eagle3d-complete"
    mv "$ROOTFS.tmp" "$ROOTFS"
fi
log "rootfs ready"
[ "$ROOTFS_ONLY" = 0 ] || exit 0

# -- what the container sees ---------------------------------------------------------------
PYHOME=$(awk -F' = ' '$1=="home"{print $2}' "$VENV/pyvenv.cfg")
PYPREFIX=$(cd "$PYHOME/.." && pwd -P)     # e.g. /root/.pyenv/versions/3.11.7
REPO_REAL=$(cd "$REPO" && pwd -P)
VENV_REAL=$(cd "$VENV" && pwd -P)
WORK=$(mktemp -d /var/tmp/eagle3d-e2e.XXXXXX)
MACHINE=eagle3d-e2e-$$
NSPAWN_PID=""

binds=(--bind-ro="$PYPREFIX" --bind-ro="$REPO_REAL")
case "$VENV_REAL/" in "$REPO_REAL"/*) ;; *) binds+=(--bind-ro="$VENV_REAL") ;; esac

cleanup() {
    local rc=$?
    if [ -n "$NSPAWN_PID" ] && kill -0 "$NSPAWN_PID" 2>/dev/null; then
        if [ "$rc" != 0 ] && [ -n "${CPID:-}" ]; then
            log "journal of $UNIT (last 60 lines):"
            nsenter -t "$CPID" -a journalctl -u "$UNIT" --no-pager -n 60 >&2 || true
        fi
        [ -n "${CPID:-}" ] && nsenter -t "$CPID" -a systemctl poweroff >/dev/null 2>&1 || true
        for _ in $(seq 50); do kill -0 "$NSPAWN_PID" 2>/dev/null || break; sleep 0.2; done
        kill "$NSPAWN_PID" 2>/dev/null || true
        wait "$NSPAWN_PID" 2>/dev/null || true
    fi
    if [ "$KEEP" = 1 ] || [ "$rc" != 0 ]; then
        log "scratch kept: $WORK"
    else
        rm -rf "$WORK"
    fi
    log "exit $rc after $(( $(date +%s) - T0 )) s"
}
trap cleanup EXIT

# -- job inputs (host side, into the rw scratch dir) ---------------------------------------
log "preparing tiny model and $SAMPLES samples in $WORK"
"$VENV/bin/eagle3d" tiny-model "$WORK/model" >"$WORK/tiny-model.log" 2>&1 || {
    cat "$WORK/tiny-model.log" >&2; die "eagle3d tiny-model"; }
# A few hundred chats: the valid lines of the bundled demo set (it also holds deliberately
# broken ones, which would fail for good and never be "present exactly once"), cycled.
"$VENV/bin/python" - "$WORK/data.jsonl" "$SAMPLES" <<'PY'
import sys
from importlib import resources

from eagle3d.dataset import BadSample, parse_line


def valid(i: int, line: str) -> bool:
    try:
        parse_line(i, line)
    except BadSample:
        return False
    return True


lines = resources.files("eagle3d").joinpath("data/demo.jsonl").read_text().splitlines()
lines = [x for i, x in enumerate(lines) if valid(i, x)]
n = int(sys.argv[2])
with open(sys.argv[1], "w") as f:
    f.writelines(lines[i % len(lines)] + "\n" for i in range(n))
PY
cat >"$WORK/$JOB.toml" <<TOML
model = "/srv/eagle3d/model"
dataset = "/srv/eagle3d/data.jsonl"
output = "/srv/eagle3d/out"
backend = "hf"
device = "cpu"
dtype = "float32"
workers = 1
max_length = 512
batch_tokens = 1024
request_timeout = 3600.0
TOML

# -- boot ----------------------------------------------------------------------------------
log "booting systemd in $MACHINE"
systemd-nspawn --register=no --keep-unit --console=pipe --quiet -b \
    -D "$ROOTFS" --volatile=overlay --machine="$MACHINE" \
    "${binds[@]}" --bind="$WORK:/srv/eagle3d" \
    >"$WORK/nspawn.log" 2>&1 </dev/null &
NSPAWN_PID=$!

CPID=""
for _ in $(seq 100); do
    CPID=$(ps -o pid= --ppid "$NSPAWN_PID" 2>/dev/null | head -1 | tr -d ' ') || true
    [ -n "$CPID" ] && [ "$(cat /proc/"$CPID"/comm 2>/dev/null)" = systemd ] && break
    CPID=""
    kill -0 "$NSPAWN_PID" 2>/dev/null || { cat "$WORK/nspawn.log" >&2; die "nspawn exited"; }
    sleep 0.1
done
[ -n "$CPID" ] || die "container init not found"
C() { nsenter -t "$CPID" -a "$@"; }
for _ in $(seq 150); do
    st=$(C systemctl is-system-running 2>/dev/null || true)
    case "$st" in running|degraded) break ;; esac
    sleep 0.2
done
log "container systemd is $st (pid $CPID on the host)"
[ "$st" = running ] || [ "$st" = degraded ] || die "container did not boot: $st"


# -- install the unit, the job and the test drop-in ----------------------------------------
# The unit comes from `eagle3d unit` run inside the container: ExecStart= is this venv.
C sh -c "'$VENV/bin/eagle3d' unit > /etc/systemd/system/eagle3d@.service"
C mkdir -p /etc/eagle3d "/etc/systemd/system/$UNIT.d"
C cp "/srv/eagle3d/$JOB.toml" "/etc/eagle3d/$JOB.toml"
# Short watchdog and stall threshold so a hang is caught in seconds, quick restarts, and a
# start limit this test's deliberate restarts cannot exhaust.
printf '%s\n' '[Unit]' 'StartLimitBurst=20' '[Service]' 'WatchdogSec=10' 'RestartSec=1' \
    'Environment=EAGLE3D_STALL_SEC=8' "Environment=EAGLE3D_FAULT=worker_slow:$PACE_MS" \
    >"$WORK/10-e2e.conf"
C cp /srv/eagle3d/10-e2e.conf "/etc/systemd/system/$UNIT.d/10-e2e.conf"
C systemctl daemon-reload
C systemd-analyze verify --man=no /etc/systemd/system/eagle3d@.service 2>"$WORK/verify.err" || true
[ ! -s "$WORK/verify.err" ] || { cat "$WORK/verify.err" >&2; die "unit does not verify in the container"; }

# -- helpers -------------------------------------------------------------------------------
prop() { C systemctl show -P "$1" "$UNIT"; }
saved() { find "$WORK/out" -name 'data_*.ckpt' 2>/dev/null | wc -l; }
wait_for() {  # wait_for SECONDS DESCRIPTION COMMAND...
    local limit=$1 what=$2; shift 2
    local end=$(( $(date +%s) + limit ))
    until "$@"; do
        [ "$(date +%s)" -lt "$end" ] || die "timed out after ${limit}s waiting for: $what"
        sleep 0.5
    done
}
is_active() { [ "$(prop ActiveState)" = active ] && [ "$(prop SubState)" = running ]; }
saved_at_least() { [ "$(saved)" -ge "$1" ]; }
status_has_counts() {
    [ "$(prop StatusText | sed -nE 's|^saved [0-9,]+/([0-9,]+) .*|\1|p' | tr -d ,)" = "$SAMPLES" ]
}
# NRestarts counts automatic restarts only, and an operator's start/restart resets it.
restarts_are() { [ "$(prop NRestarts)" = "$1" ] && is_active; }
# (Not `journalctl | grep -q`: grep exits at the first match and pipefail sees SIGPIPE.)
journal_has() { C journalctl -u "$UNIT" --no-pager -o cat >"$WORK/journal.txt"; grep -qF "$1" "$WORK/journal.txt"; }
stopped() { case "$(prop ActiveState)" in inactive|failed) return 0 ;; esac; return 1; }
STEP=$(( SAMPLES / 8 ))

# -- 0. a bad job file fails once, with exit 2, and is not restarted -----------------------
log "0. a job file with an unknown key (eagle3d@bad)"
printf '%s\n' 'model = "/srv/eagle3d/model"' 'dataset = "/srv/eagle3d/data.jsonl"' \
    'output = "/srv/eagle3d/out-bad"' 'bogus_key = 1' >"$WORK/bad.toml"
C cp /srv/eagle3d/bad.toml /etc/eagle3d/bad.toml
C systemctl start eagle3d@bad.service 2>/dev/null && die "a bad job file started"
sleep 2  # a scheduled restart would show as "activating (auto-restart)" for RestartSec=15s
bad() { C systemctl show -P "$1" eagle3d@bad.service; }
[ "$(bad ExecMainStatus)" = 2 ] && [ "$(bad Result)" = exit-code ] && [ "$(bad ActiveState)" = failed ] ||
    die "bad job: status $(bad ExecMainStatus), result $(bad Result), state $(bad ActiveState)"
[ "$(bad NRestarts)" = 0 ] || die "a config error was restarted"
log "   failed with exit 2, not restarted (RestartPreventExitStatus=)"

# -- 1. start ------------------------------------------------------------------------------
log "1. systemctl start $UNIT"
t=$(date +%s)
C systemctl start "$UNIT"
log "   active after $(( $(date +%s) - t )) s (Type=notify: READY=1 received)"
is_active || die "not active after start: $(prop ActiveState)/$(prop SubState)"
wait_for 120 "STATUS with counters" status_has_counts
C systemctl status "$UNIT" --no-pager -n 0 >"$WORK/status.txt" || true
grep -q 'Status: "saved ' "$WORK/status.txt" || { cat "$WORK/status.txt" >&2; die "no STATUS in systemctl status"; }
log "   $(grep 'Status:' "$WORK/status.txt" | sed 's/^ *//')"
# An operator attaches the monitor by output directory; it finds the socket in
# $RUNTIME_DIRECTORY (/run/eagle3d/JOB) through the journal's run_started record.
C ls /run/eagle3d/$JOB/ | grep -q '\.sock$' || die "no socket in /run/eagle3d/$JOB"
C "$VENV/bin/eagle3-top" --once --json --output /srv/eagle3d/out >"$WORK/top.json" ||
    die "eagle3-top --once exited $? against the running service"
grep -q '"source": "socket"' "$WORK/top.json" || { head -c 600 "$WORK/top.json" >&2; die "eagle3-top did not use the socket"; }
log "   eagle3-top --once: OK over the socket in /run/eagle3d/$JOB"
wait_for 300 "$STEP samples saved" saved_at_least "$STEP"

# -- 2. restart mid-run --------------------------------------------------------------------
a=$(saved); pid=$(prop MainPID)
log "2. systemctl restart at $a/$SAMPLES saved (pid $pid)"
t=$(date +%s)
C systemctl restart "$UNIT"
log "   restarted in $(( $(date +%s) - t )) s, pid $(prop MainPID)"
[ "$(prop MainPID)" != "$pid" ] || die "restart kept the same main process"
[ "$(prop NRestarts)" = 0 ] || die "an operator restart counted as a failure restart"
wait_for 300 "progress after restart" saved_at_least $(( a + STEP ))

# -- 3. kill -9 ----------------------------------------------------------------------------
a=$(saved); pid=$(prop MainPID)
n=$(prop NRestarts)
log "3. kill -9 of the main process $pid at $a/$SAMPLES saved"
C kill -9 "$pid"
wait_for 60 "systemd to restart it (NRestarts=$(( n + 1 )))" restarts_are $(( n + 1 ))
log "   restarted as pid $(prop MainPID)"
journal_has "status=9/KILL" || die "no SIGKILL exit in the journal"
wait_for 300 "progress after kill -9" saved_at_least $(( a + STEP ))

# -- 4. a hung producer trips the watchdog -------------------------------------------------
a=$(saved)
log "4. hang the HF worker (EAGLE3D_FAULT=worker_hang) at $a/$SAMPLES saved"
printf '%s\n' '[Service]' \
    "Environment=EAGLE3D_FAULT=worker_slow:$PACE_MS,worker_hang:2@/srv/eagle3d/hang.marker" \
    >"$WORK/20-hang.conf"
C cp /srv/eagle3d/20-hang.conf "/etc/systemd/system/$UNIT.d/20-hang.conf"
C systemctl daemon-reload
t=$(date +%s)
C systemctl restart "$UNIT"
n=$(prop NRestarts)
wait_for 120 "the fault to fire" test -e "$WORK/hang.marker"
log "   worker hung $(( $(date +%s) - t )) s after the restart"
wait_for 180 "the watchdog to restart it (NRestarts=$(( n + 1 )))" restarts_are $(( n + 1 ))
log "   watchdog restart $(( $(date +%s) - t )) s after the restart"
journal_has "Watchdog timeout" || die "no 'Watchdog timeout' in the journal"
C rm "/etc/systemd/system/$UNIT.d/20-hang.conf"
C systemctl daemon-reload
wait_for 300 "progress after the watchdog restart" saved_at_least $(( a + STEP ))

# -- 5. stop drains cleanly ----------------------------------------------------------------
a=$(saved)
log "5. systemctl stop at $a/$SAMPLES saved"
t=$(date +%s)
C systemctl stop "$UNIT"
log "   stopped in $(( $(date +%s) - t )) s"
[ "$(prop Result)" = success ] || die "stop result: $(prop Result)"
[ "$(prop ExecMainStatus)" = 0 ] || die "exit status after stop: $(prop ExecMainStatus)"
! journal_has "State 'stop-sigterm' timed out" || die "the drain overran TimeoutStopSec="
"$VENV/bin/python" - "$WORK/out" <<'PY' || die "the journal does not end with run_stopped"
import sys

from eagle3proto import paths
from eagle3proto.journal import replay

kinds = []
for _shard, d in paths.shard_dirs(sys.argv[1]):
    replay(d, lambda batch: kinds.extend(e.kind for e in batch))
print(f"   journal: {len(kinds)} records, last {kinds[-1] if kinds else None!r}", file=sys.stderr)
sys.exit(0 if kinds and kinds[-1] == "run_stopped" else 1)
PY

# -- 6. run to the end, verify -------------------------------------------------------------
log "6. start again and run to completion"
t=$(date +%s)
C systemctl start "$UNIT"
wait_for 900 "the job to finish" stopped
log "   finished $(( $(date +%s) - t )) s after the last start"
[ "$(prop Result)" = success ] && [ "$(prop ExecMainStatus)" = 0 ] ||
    die "finished with result $(prop Result), status $(prop ExecMainStatus)"
# A run that wedged at its end and was killed by the watchdog would also end in 'success'
# here (the restarted daemon finds the job done): the last start must not have restarted.
[ "$(prop NRestarts)" = 0 ] || die "the last run was restarted $(prop NRestarts) times"
journal_has "finished: saved $SAMPLES / $SAMPLES (100 %), 0 failed" || die "no 'finished' line in the journal"
"$VENV/bin/eagle3d" verify --output "$WORK/out" || die "eagle3d verify failed"
"$VENV/bin/python" - "$WORK/out" "$SAMPLES" <<'PY' || die "samples missing or duplicated"
import os
import re
import sys

out, n = sys.argv[1], int(sys.argv[2])
seen, other = [], []
for d, _, files in os.walk(out):
    if "/.eagle3d" in d + "/":
        continue
    for f in files:
        m = re.fullmatch(r"data_(\d+)\.ckpt", f)
        if m:
            seen.append(int(m.group(1)))
        else:
            other.append(os.path.join(d, f))
assert not other, f"stray files: {other[:5]}"
assert len(seen) == len(set(seen)) == n and set(seen) == set(range(n)), (len(seen), n)
print(f"   {n} samples, each exactly once", file=sys.stderr)
PY
# journald stamps lines itself: the daemon must not add its own timestamps.
C journalctl -u "$UNIT" --no-pager -o cat >"$WORK/journal.txt"
if grep -Eq '^[0-9]{4}-[0-9]{2}-[0-9]{2}[ T][0-9]{2}:' "$WORK/journal.txt"; then
    die "log lines carry their own timestamps under journald"
fi
# The <N> priority prefixes are consumed by journald (a literal one means they were not).
if grep -Eq '^<[0-7]>' "$WORK/journal.txt"; then
    die "syslog priority prefixes reached the journal text"
fi
# Restarts, kill -9, the watchdog's abort and the stops are all expected here: none of them
# may leave a Python traceback or a C++ abort ("terminate called ...") in the service log.
# Only step 4's hang may trip the watchdog: a restart or stop that wedged would too.
wd=$(grep -c 'Watchdog timeout' "$WORK/journal.txt" || true)
[ "$wd" = 1 ] || die "$wd watchdog timeouts in the service log; only step 4's hang should trip it"
if grep -Eq 'Traceback|terminate called' "$WORK/journal.txt"; then
    grep -E -B3 -A15 'Traceback|terminate called' "$WORK/journal.txt" | head -60 >&2
    die "a traceback or a C++ abort in the service log"
fi
C journalctl -u "$UNIT" --no-pager -o verbose -p info -g 'producer up' >"$WORK/prio.txt" || true
grep -q 'PRIORITY=6' "$WORK/prio.txt" || die "an INFO line did not get journal priority 6"
log "   journal: no tracebacks, no duplicate timestamps, syslog priorities applied"
# An enabled unit starts again at every boot: a finished job must be a clean no-op then,
# not a failure (Type=notify: exiting 0 without READY=1 is result 'protocol') or a loop.
log "7. start the finished job again (as at boot)"
C systemctl start "$UNIT" || true
wait_for 120 "the no-op start to end" stopped
[ "$(prop Result)" = success ] && [ "$(prop ExecMainStatus)" = 0 ] ||
    die "starting a finished job: result $(prop Result), status $(prop ExecMainStatus)"
[ "$(prop NRestarts)" = 0 ] || die "starting a finished job restarted it $(prop NRestarts) times"
log "start, restart, kill -9, watchdog, drain and finish all passed"
log "PASS"
