# --- Real NVIDIA driver packages for tests/test_realdriver_roots.py (splice into .ci/run before pytest) ---
# Debian's non-free NVIDIA 535 user-space packages (about 270 MB of .debs, 700 MB unpacked), downloaded and
# unpacked once into a cache that persists on the machine; later runs reuse it without touching the network.
# The contrib, non-free and non-free-firmware components are enabled for these downloads only, in a private
# apt state under the cache built from this machine's Debian sources: /etc/apt is read, never changed, so
# the packages CI installs elsewhere come from the same components as before. Idempotent; needs root,
# apt-get, dpkg-deb and python3 (no venv: tests/support/realdriver.py imports gpuhook only to build roots).
# The tests download the same way themselves when the cache is cold; this step only moves the wait (and a
# failure to reach the archive) out of pytest. With GPUHOOK_REQUIRE_E2E=1 the tests fail, not skip, if the
# packages cannot be had.
export GPUHOOK_DEB_CACHE="${GPUHOOK_DEB_CACHE:-/var/cache/gpuhook-test-debs}"
for attempt in 1 2 3; do
    if python3 "$(dirname "${BASH_SOURCE[0]}")/../tests/support/realdriver.py" fetch; then
        break
    fi
    if [ "$attempt" = 3 ]; then
        echo "the NVIDIA driver packages could not be downloaded into $GPUHOOK_DEB_CACHE" >&2
        exit 1
    fi
    sleep 15
done
