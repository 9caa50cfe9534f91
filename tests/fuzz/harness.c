/*
 * Fuzz harness for the native helper's parsers of untrusted bytes (src/gpuhook/_native/gpuhook_native.c):
 * gh_ldcache_parse (ld.so.cache, every format), gh_elf_info_buf and gh_elf_info_fd (DT_SONAME).
 * Built with -fsanitize=address,undefined by tests/fuzz/run.sh, which documents how to run it.
 *
 * Every input is copied into a buffer of exactly its size, so a read one byte past the end hits ASan's
 * redzone. As a program: `harness [-n MUTATIONS] [-s SEED] FILE...` runs each file and MUTATIONS mutants of
 * it (deterministic from SEED). Built with -DGH_LIBFUZZER (clang -fsanitize=fuzzer,address,undefined) it is a
 * libFuzzer target instead, taking the same files as its seed corpus.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "gpuhook_native.h"

static int memfd = -1;

static void check_ldcache(const uint8_t *data, size_t size)
{
    char err[256];
    int64_t n = gh_ldcache_parse(data, size, NULL, 0, err, sizeof err);
    if (n < 0)
        return;
    struct gh_ldentry *out = calloc((size_t)n + 1, sizeof *out);
    if (out == NULL)
        abort();
    int64_t again = gh_ldcache_parse(data, size, out, (size_t)n, err, sizeof err);
    for (int64_t i = 0; i < again; i++) {
        /* what the Python wrapper does with an entry: slice key and value out of the buffer */
        if (out[i].key + out[i].key_len >= size || out[i].value + out[i].value_len >= size)
            abort();
        if (data[out[i].key + out[i].key_len] != 0 || data[out[i].value + out[i].value_len] != 0)
            abort();
    }
    free(out);
}

static void check_elf(const uint8_t *data, size_t size)
{
    struct gh_elfinfo from_buf, from_fd;
    char err_buf[256] = "", err_fd[256] = "";
    int rc_buf = gh_elf_info_buf(data, size, &from_buf, err_buf, sizeof err_buf);
    if (rc_buf == 0 && from_buf.has_soname && memchr(from_buf.soname, 0, sizeof from_buf.soname) == NULL)
        abort();
    if (memfd < 0)
        return;
    /* the pread path must agree with the buffer path on the same bytes */
    if (ftruncate(memfd, 0) != 0 || pwrite(memfd, data, size, 0) != (ssize_t)size)
        abort();
    int rc_fd = gh_elf_info_fd(memfd, &from_fd, err_fd, sizeof err_fd);
    if (rc_fd != rc_buf || strcmp(err_fd, err_buf) != 0)
        abort();
    if (rc_buf == 0 && (from_fd.has_soname != from_buf.has_soname || from_fd.elf_class != from_buf.elf_class ||
                        from_fd.machine != from_buf.machine || strcmp(from_fd.soname, from_buf.soname) != 0))
        abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    uint8_t *copy = malloc(size ? size : 1); /* exactly `size`: the redzone starts right after it */
    if (copy == NULL)
        abort();
    memcpy(copy, data, size);
    if (memfd < 0)
        memfd = memfd_create("gh-fuzz", MFD_CLOEXEC);
    check_ldcache(copy, size);
    check_elf(copy, size);
    free(copy);
    return 0;
}

#ifndef GH_LIBFUZZER
static uint64_t rng_state;

static uint64_t rng(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

static const uint32_t interesting[] = {0, 1, 7, 8, 16, 0x7f, 0x80, 0xff, 0x100, 0x7fff, 0xffff, 0x10000,
                                       0x7fffffff, 0x80000000, 0xfffffff0, 0xffffffff};

/* One mutant of `src`: byte flips, 32/64-bit fields set to interesting values (mostly in the headers, where
 * counts and offsets live), block copies inside the input, and sometimes a truncation. */
static size_t mutate(const uint8_t *src, size_t len, uint8_t *dst)
{
    size_t n = len;
    memcpy(dst, src, len);
    if (n == 0)
        return 0;
    unsigned ops = 1 + (unsigned)(rng() % 6);
    for (unsigned k = 0; k < ops; k++) {
        size_t window = (rng() & 1) && n > 512 ? 512 : n;
        size_t pos = (size_t)(rng() % window);
        switch (rng() % 5) {
        case 0:
            dst[pos] ^= (uint8_t)(1u << (rng() % 8));
            break;
        case 1:
            dst[pos] = (uint8_t)rng();
            break;
        case 2: {
            uint32_t v = interesting[rng() % (sizeof interesting / sizeof *interesting)];
            pos &= ~(size_t)3;
            for (unsigned b = 0; b < 4 && pos + b < n; b++)
                dst[pos + b] = (uint8_t)(v >> (8 * b));
            break;
        }
        case 3: {
            uint64_t v = rng() & 1 ? (uint64_t)-1 : (uint64_t)n + (rng() % 64) - 32;
            pos &= ~(size_t)7;
            for (unsigned b = 0; b < 8 && pos + b < n; b++)
                dst[pos + b] = (uint8_t)(v >> (8 * b));
            break;
        }
        default: {
            size_t from = (size_t)(rng() % n), count = (size_t)(rng() % 64);
            if (from + count > n)
                count = n - from;
            if (pos + count > n)
                count = n - pos;
            memmove(dst + pos, dst + from, count);
        }
        }
    }
    if (rng() % 8 == 0)
        n = (size_t)(rng() % (n + 1));
    return n;
}

static uint8_t *slurp(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (f == NULL)
        return NULL;
    size_t cap = 1 << 16, n = 0;
    uint8_t *buf = malloc(cap);
    size_t got;
    while (buf != NULL && (got = fread(buf + n, 1, cap - n, f)) > 0) {
        n += got;
        if (n == cap)
            buf = realloc(buf, cap *= 2);
    }
    fclose(f);
    *len = n;
    return buf;
}

int main(int argc, char **argv)
{
    unsigned long mutations = 2000, seed = 1, files = 0, runs = 0;
    int opt;
    while ((opt = getopt(argc, argv, "n:s:")) != -1) {
        if (opt == 'n')
            mutations = strtoul(optarg, NULL, 10);
        else if (opt == 's')
            seed = strtoul(optarg, NULL, 10);
        else {
            fprintf(stderr, "usage: %s [-n MUTATIONS] [-s SEED] FILE...\n", argv[0]);
            return 2;
        }
    }
    for (int i = optind; i < argc; i++) {
        size_t len;
        uint8_t *data = slurp(argv[i], &len);
        if (data == NULL) {
            fprintf(stderr, "%s: %s\n", argv[i], strerror(errno));
            return 2;
        }
        uint8_t *mutant = malloc(len ? len : 1);
        rng_state = seed * 0x9E3779B97F4A7C15ull + (uint64_t)i;
        LLVMFuzzerTestOneInput(data, len);
        for (size_t cut = 0; cut <= len && cut < 256; cut++) /* every short prefix: the header checks */
            LLVMFuzzerTestOneInput(data, cut);
        for (unsigned long m = 0; m < mutations; m++)
            LLVMFuzzerTestOneInput(mutant, mutate(data, len, mutant));
        runs += 1 + (len < 256 ? len + 1 : 256) + mutations;
        files++;
        free(mutant);
        free(data);
    }
    printf("fuzz harness: %lu inputs from %lu corpus files, no sanitizer report\n", runs, files);
    return 0;
}
#endif
