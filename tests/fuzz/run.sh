#!/usr/bin/env bash
# ASan/UBSan fuzzing of the native helper's parsers (ld.so.cache, ELF) on a corpus of real and edge-case files.
#
#   bash tests/fuzz/run.sh                 # build, make the corpus, run 3000 mutants per corpus file (~1 min)
#   FUZZ_MUTATIONS=50000 FUZZ_SEED=7 bash tests/fuzz/run.sh      # a longer hunt, another seed
#   FUZZ_KEEP=/tmp/ghfuzz bash tests/fuzz/run.sh                 # keep the build and corpus there
#
# It compiles src/gpuhook/_native/gpuhook_native.c (the C file the package builds, unchanged) together with
# tests/fuzz/harness.c using gcc -fsanitize=address,undefined -fno-sanitize-recover=all, builds a corpus
# (the host's ld.so.cache; caches that this host's ldconfig writes in the new, compat and old formats; 64-bit
# and 32-bit shared libraries with and without DT_SONAME, an executable, a static binary, an object file,
# short and empty files), and runs every file plus its short prefixes plus FUZZ_MUTATIONS deterministic
# mutants through the parsers. Any sanitizer report or inconsistency (buffer and file paths must agree)
# aborts with a non-zero exit. With clang and libFuzzer available, the same harness also builds as a
# libFuzzer target:  clang -g -O1 -DGH_LIBFUZZER -fsanitize=fuzzer,address,undefined \
#   -I src/gpuhook/_native tests/fuzz/harness.c src/gpuhook/_native/gpuhook_native.c -o fuzz && ./fuzz CORPUS/
# Needs: gcc with libasan/libubsan (Debian: gcc), ldconfig; gcc-multilib for the 32-bit inputs (optional).
set -euo pipefail
cd "$(dirname "$0")/../.."

work=${FUZZ_KEEP:-$(mktemp -d /tmp/gpuhook-fuzz.XXXXXX)}
[ -n "${FUZZ_KEEP:-}" ] || trap 'rm -rf "$work"' EXIT
mkdir -p "$work/corpus" "$work/root/etc" "$work/root/usr/lib/x86_64-linux-gnu" "$work/root/usr/lib32"
corpus=$work/corpus

gcc -std=gnu11 -g -O1 -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=all \
    -Wall -Wextra -Wno-unused-parameter -I src/gpuhook/_native \
    tests/fuzz/harness.c src/gpuhook/_native/gpuhook_native.c -o "$work/harness"

# ELF inputs: libraries with and without a soname, 32-bit if the compiler can, an object file, executables.
echo 'int gh_f(void) { return 1; }' > "$work/lib.c"
gcc -shared -fPIC -Wl,-soname,libghfuzz.so.1 -o "$work/root/usr/lib/x86_64-linux-gnu/libghfuzz.so.1.2" "$work/lib.c"
gcc -shared -fPIC -o "$corpus/elf-no-soname.so" "$work/lib.c"
gcc -c -o "$corpus/elf-object.o" "$work/lib.c"
if gcc -m32 -shared -fPIC -Wl,-soname,libghfuzz32.so.1 -o "$work/root/usr/lib32/libghfuzz32.so.1.2" "$work/lib.c" \
        2>/dev/null; then
    cp "$work/root/usr/lib32/libghfuzz32.so.1.2" "$corpus/elf32.so"
fi
cp "$work/root/usr/lib/x86_64-linux-gnu/libghfuzz.so.1.2" "$corpus/elf64.so"
cp "$(readlink -f /bin/true)" "$corpus/elf-exe"
for f in /bin/busybox /usr/lib/x86_64-linux-gnu/libc.so.6; do
    [ -f "$f" ] && cp "$(readlink -f "$f")" "$corpus/host-$(basename "$f")"
done

# ld.so.cache inputs: the host's, and this ldconfig's formats over the small root above.
cp /etc/ld.so.cache "$corpus/host-ld.so.cache"
printf '/usr/lib/x86_64-linux-gnu\n/usr/lib32\n' > "$work/root/etc/ld.so.conf"
for fmt in new compat old; do
    if ldconfig -r "$work/root" -c "$fmt" -C "/etc/ld.so.cache.$fmt" 2>/dev/null; then
        cp "$work/root/etc/ld.so.cache.$fmt" "$corpus/ld.so.cache.$fmt"
    fi
done

# Edge cases: empty, magic only, headers claiming everything.
: > "$corpus/empty"
printf 'glibc-ld.so.cache1.1' > "$corpus/new-magic-only"
printf 'ld.so-1.7.0\0\377\377\377\377' > "$corpus/old-huge-count"
printf '\177ELF\002\001\001' > "$corpus/elf-ident-only"

ls "$corpus" | sed 's/^/corpus: /'
ASAN_OPTIONS=abort_on_error=1:detect_leaks=1:allocator_may_return_null=1 \
UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    "$work/harness" -n "${FUZZ_MUTATIONS:-3000}" -s "${FUZZ_SEED:-1}" "$corpus"/*
