#!/usr/bin/env bash
# The real-GPU check in one go (bench/README.md "Real-GPU check"):
#
#   bench/device-check.sh OUTDIR [--simulate] [--wheels DIR] [--runc PATH] [--busybox PATH] [--probe PATH]
#                                [--nvidia-dir DIR] [--timeout S] [--keep]
#   bench/device-check.sh --self-test
#   bench/device-check.sh --make-kit [DIR]      # here: what the device machine lacks, to carry there
#
# Picks the interpreter ($PYTHON; else python3 when --wheels brings gpuhook; else the checkout's .venv), and
# runs bench/device_check.py under a backstop 30 s past its own whole-run timeout (--timeout, default 300 s).
set -u
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(dirname "$here")"
total=300
wheels=no
prev=""
for arg in "$@"; do
    [ "$prev" = "--timeout" ] && total="$arg"
    case "$arg" in
        --wheels|--wheels=*) wheels=yes ;;
        --timeout=*) total="${arg#--timeout=}" ;;
    esac
    prev="$arg"
done
case "$total" in ''|*[!0-9]*) total=300 ;; esac
python="${PYTHON:-}"
if [ -z "$python" ]; then
    if [ "$wheels" = no ] && [ -x "$repo/.venv/bin/python" ]; then
        python="$repo/.venv/bin/python"
    else
        python="$(command -v python3 || true)"
    fi
fi
if [ -z "$python" ]; then
    echo "device-check: no python3 (set PYTHON)" >&2
    exit 1
fi
if command -v timeout >/dev/null 2>&1; then
    exec timeout -k 5 "$((total + 30))" "$python" "$here/device_check.py" "$@"
fi
exec "$python" "$here/device_check.py" "$@"
