/* gpuhook native helper; see gpuhook_native.h. */
#define _GNU_SOURCE
#include "gpuhook_native.h"

#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <inttypes.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <linux/bpf.h>

/* Symbols glibc gave new versions after 2.17 are reached by raw system calls instead, so the wheel's extension
 * runs on every glibc >= 2.17 (its manylinux tag; tests/test_native.py checks the versions it references):
 * fstat and mknodat became real symbols in 2.33 (before: __fxstat, __xmknodat), pthread_sigmask got a new
 * version in 2.32. The kernel's struct stat is glibc's on x86-64 and on the 64-bit generic ABI (aarch64). */
static int gh_fstat(int fd, struct stat *st)
{
    return (int)syscall(SYS_fstat, fd, st);
}

static int gh_mknod_raw(int dirfd, const char *path, mode_t mode, dev_t dev)
{
    unsigned int kdev = (unsigned int)dev; /* the kernel takes the 32-bit encoding, as glibc passes it */

    if ((dev_t)kdev != dev) {
        errno = EINVAL;
        return -1;
    }
    return (int)syscall(SYS_mknodat, dirfd, path, mode, kdev);
}

/* confine.c's pthread_sigmask calls, routed here at link time (-Wl,--wrap=pthread_sigmask, _build.py). As glibc
 * does, the two signals it keeps for itself (SIGCANCEL 32, SIGSETXID 33) are never blocked. */
__attribute__((visibility("hidden"))) int __wrap_pthread_sigmask(int how, const sigset_t *set, sigset_t *old);
int __wrap_pthread_sigmask(int how, const sigset_t *set, sigset_t *old)
{
    sigset_t copy;

    if (set) {
        memcpy(&copy, set, sizeof copy);
        ((unsigned long *)&copy)[0] &= ~((1UL << (32 - 1)) | (1UL << (33 - 1)));
        set = &copy;
    }
    return syscall(SYS_rt_sigprocmask, how, set, old, _NSIG / 8) == 0 ? 0 : errno;
}

#ifndef SYS_openat2
#define SYS_openat2 437
#endif
#ifndef SYS_open_tree
#define SYS_open_tree 428
#endif
#ifndef MOVE_MOUNT_F_EMPTY_PATH
#define MOVE_MOUNT_F_EMPTY_PATH 0x00000004
#endif
#ifndef MOVE_MOUNT_T_EMPTY_PATH
#define MOVE_MOUNT_T_EMPTY_PATH 0x00000040
#endif
#ifndef SYS_move_mount
#define SYS_move_mount 429
#endif
#ifndef SYS_mount_setattr
#define SYS_mount_setattr 442
#endif

/* ------------------------------------------------------------------------------------------------ */
/* helpers                                                                                          */

static void seterr(char *err, size_t errlen, const char *fmt, ...)
{
    va_list ap;

    if (err == NULL || errlen == 0)
        return;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
}

/* Little-endian loads from possibly unaligned memory (ld.so.cache and ELF are read as LE only). */
static uint16_t le16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }
static uint32_t le32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static uint64_t le64(const uint8_t *p) { return (uint64_t)le32(p) | (uint64_t)le32(p + 4) << 32; }

/* ------------------------------------------------------------------------------------------------ */
/* ld.so.cache                                                                                      */

#define OLD_MAGIC "ld.so-1.7.0"
#define OLD_MAGIC_LEN 11
#define OLD_HDR 16 /* magic[11], pad, uint32 nlibs */
#define OLD_ENT 12 /* int32 flags, uint32 key, uint32 value */
#define NEW_MAGIC "glibc-ld.so.cache"
#define NEW_MAGIC_LEN 17
#define NEW_VERSION "1.1"
#define NEW_HDR 48 /* magic, version[3], nlibs, len_strings, flags, pad[3], extension_offset, unused[3] */
#define NEW_ENT 24 /* int32 flags, uint32 key, uint32 value, uint32 osversion, uint64 hwcap */
#define CACHE_ALIGN 8

/* Check that buf[off..] holds a NUL-terminated string and return its length via *n. */
static int cstr_at(const uint8_t *buf, size_t len, uint64_t off, uint32_t *n)
{
    const uint8_t *nul;

    if (off >= len)
        return 0;
    nul = memchr(buf + off, 0, len - off);
    if (nul == NULL || (size_t)(nul - (buf + off)) > UINT32_MAX)
        return 0;
    *n = (uint32_t)(nul - (buf + off));
    return 1;
}

/* Fill out[i] from one entry whose string offsets are relative to `base`; strings must lie past `strings`. */
static int ld_entry(const uint8_t *buf, size_t len, uint64_t base, uint64_t strings, uint64_t i,
                    int32_t flags, uint32_t key, uint32_t value, uint64_t hwcap, struct gh_ldentry *e,
                    char *err, size_t errlen)
{
    uint64_t koff = base + key, voff = base + value;

    if (koff < strings || !cstr_at(buf, len, koff, &e->key_len)) {
        seterr(err, errlen, "entry %llu: key offset %u is outside the string table or unterminated",
               (unsigned long long)i, key);
        return 0;
    }
    if (voff < strings || !cstr_at(buf, len, voff, &e->value_len)) {
        seterr(err, errlen, "entry %llu: value offset %u is outside the string table or unterminated",
               (unsigned long long)i, value);
        return 0;
    }
    e->flags = flags;
    e->key = koff;
    e->value = voff;
    e->hwcap = hwcap;
    return 1;
}

static int64_t ld_new(const uint8_t *buf, size_t len, uint64_t base, struct gh_ldentry *out, size_t cap,
                      char *err, size_t errlen)
{
    const uint8_t *h = buf + base;
    uint32_t n;
    uint8_t endian;
    uint64_t i, strings;

    if (len - base < NEW_HDR) {
        seterr(err, errlen, "truncated %s header", NEW_MAGIC);
        return -1;
    }
    if (memcmp(h + NEW_MAGIC_LEN, NEW_VERSION, 3) != 0) {
        seterr(err, errlen, "unsupported cache version '%.3s' (expected %s)", (const char *)h + NEW_MAGIC_LEN,
               NEW_VERSION);
        return -1;
    }
    n = le32(h + 20);
    endian = h[28];
    if (endian == 3) {
        seterr(err, errlen, "big-endian cache is not supported");
        return -1;
    }
    if (endian != 0 && endian != 2) {
        seterr(err, errlen, "invalid endianness flag %u", endian);
        return -1;
    }
    if ((len - base - NEW_HDR) / NEW_ENT < n) {
        seterr(err, errlen, "header claims %u entries but the file has room for %llu", n,
               (unsigned long long)((len - base - NEW_HDR) / NEW_ENT));
        return -1;
    }
    strings = base + NEW_HDR + (uint64_t)n * NEW_ENT;
    for (i = 0; i < n && i < cap; i++) {
        const uint8_t *e = h + NEW_HDR + i * NEW_ENT;
        if (!ld_entry(buf, len, base, strings, i, (int32_t)le32(e), le32(e + 4), le32(e + 8), le64(e + 16),
                      &out[i], err, errlen))
            return -1;
    }
    return n;
}

int64_t gh_ldcache_parse(const uint8_t *buf, size_t len, struct gh_ldentry *out, size_t cap, char *err,
                         size_t errlen)
{
    uint32_t n;
    uint64_t i, strings, aligned;

    if (len >= NEW_MAGIC_LEN && memcmp(buf, NEW_MAGIC, NEW_MAGIC_LEN) == 0)
        return ld_new(buf, len, 0, out, cap, err, errlen);
    if (len < OLD_MAGIC_LEN || memcmp(buf, OLD_MAGIC, OLD_MAGIC_LEN) != 0) {
        seterr(err, errlen, "not an ld.so cache (unknown magic)");
        return -1;
    }
    if (len < OLD_HDR) {
        seterr(err, errlen, "truncated %s header", OLD_MAGIC);
        return -1;
    }
    n = le32(buf + 12);
    if ((len - OLD_HDR) / OLD_ENT < n) {
        seterr(err, errlen, "%s header claims %u entries but the file has room for %llu", OLD_MAGIC, n,
               (unsigned long long)((len - OLD_HDR) / OLD_ENT));
        return -1;
    }
    strings = OLD_HDR + (uint64_t)n * OLD_ENT;
    /* glibc hides the new format, aligned, at the start of the old format's string table. */
    aligned = (strings + CACHE_ALIGN - 1) & ~(uint64_t)(CACHE_ALIGN - 1);
    if (aligned <= len && len - aligned >= NEW_MAGIC_LEN && memcmp(buf + aligned, NEW_MAGIC, NEW_MAGIC_LEN) == 0)
        return ld_new(buf, len, aligned, out, cap, err, errlen);
    for (i = 0; i < n && i < cap; i++) {
        const uint8_t *e = buf + OLD_HDR + i * OLD_ENT;
        if (!ld_entry(buf, len, strings, strings, i, (int32_t)le32(e), le32(e + 4), le32(e + 8), 0, &out[i],
                      err, errlen))
            return -1;
    }
    return n;
}

/* ------------------------------------------------------------------------------------------------ */
/* ELF                                                                                              */

/* A byte source: a buffer, or a file read with pread (no mmap: a file truncated under us must not SIGBUS). */
struct src {
    const uint8_t *buf;
    int fd;
    uint64_t size;
};

/* 0: read; 1: out of range (malformed); -1: I/O error (errno). */
static int src_read(const struct src *s, uint64_t off, void *dst, size_t n)
{
    size_t done = 0;

    if (off > s->size || n > s->size - off)
        return 1;
    if (s->buf != NULL) {
        memcpy(dst, s->buf + off, n);
        return 0;
    }
    while (done < n) {
        ssize_t k = pread(s->fd, (char *)dst + done, n - done, (off_t)(off + done));
        if (k < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        if (k == 0)
            return 1; /* the file shrank */
        done += (size_t)k;
    }
    return 0;
}

#define PT_LOAD_ 1
#define PT_DYNAMIC_ 2
#define DT_NULL_ 0
#define DT_STRTAB_ 5
#define DT_STRSZ_ 10
#define DT_SONAME_ 14
#define MAX_PHNUM 4096
#define MAX_DYN_BYTES (1u << 20)

struct phdr {
    uint32_t type;
    uint64_t offset, vaddr, filesz;
};

static void phdr_get(const uint8_t *p, int is64, struct phdr *ph)
{
    ph->type = le32(p);
    if (is64) {
        ph->offset = le64(p + 8);
        ph->vaddr = le64(p + 16);
        ph->filesz = le64(p + 32);
    } else {
        ph->offset = le32(p + 4);
        ph->vaddr = le32(p + 8);
        ph->filesz = le32(p + 16);
    }
}

/* Map a virtual address to a file offset through the PT_LOAD segments. */
static int vaddr_to_off(const uint8_t *phs, uint32_t phnum, uint32_t phentsize, int is64, uint64_t vaddr,
                        uint64_t *off)
{
    uint32_t i;
    struct phdr ph;

    for (i = 0; i < phnum; i++) {
        phdr_get(phs + (size_t)i * phentsize, is64, &ph);
        if (ph.type == PT_LOAD_ && vaddr >= ph.vaddr && vaddr - ph.vaddr < ph.filesz &&
            ph.offset + (vaddr - ph.vaddr) >= ph.offset) {
            *off = ph.offset + (vaddr - ph.vaddr);
            return 1;
        }
    }
    return 0;
}

#define READ_OR(rc_expr, what)                                                                           \
    do {                                                                                                 \
        int rc_ = (rc_expr);                                                                             \
        if (rc_ < 0) {                                                                                   \
            ret = -1;                                                                                    \
            goto out;                                                                                    \
        }                                                                                                \
        if (rc_ > 0) {                                                                                   \
            seterr(err, errlen, "%s", what);                                                             \
            goto out;                                                                                    \
        }                                                                                                \
    } while (0)

#define FAIL(...)                                                                                        \
    do {                                                                                                 \
        seterr(err, errlen, __VA_ARGS__);                                                                \
        goto out;                                                                                        \
    } while (0)

static int elf_parse(const struct src *s, struct gh_elfinfo *out, char *err, size_t errlen)
{
    uint8_t eh[64];
    uint8_t *phs = NULL, *dyn = NULL;
    int ret = 1, is64, have_strtab = 0, have_strsz = 0, have_soname = 0;
    uint64_t phoff, strtab = 0, strsz = 0, soname = 0, stroff, start, avail, i, ndyn;
    uint32_t phentsize, phnum, entsz;
    struct phdr ph, dynph;
    size_t want;
    char *nul;

    memset(out, 0, sizeof *out);
    READ_OR(src_read(s, 0, eh, 16), "not an ELF file");
    if (memcmp(eh, "\177ELF", 4) != 0)
        FAIL("not an ELF file");
    if (eh[4] != 1 && eh[4] != 2)
        FAIL("unsupported ELF class %u", eh[4]);
    if (eh[5] != 1)
        FAIL("unsupported ELF data encoding %u (only little-endian is supported)", eh[5]);
    is64 = eh[4] == 2;
    READ_OR(src_read(s, 0, eh, is64 ? 64 : 52), "truncated ELF header");
    out->elf_class = is64 ? 64 : 32;
    out->machine = le16(eh + 18);
    phoff = is64 ? le64(eh + 32) : le32(eh + 28);
    phentsize = le16(eh + (is64 ? 54 : 42));
    phnum = le16(eh + (is64 ? 56 : 44));
    if (phnum == 0) {
        ret = 0; /* no program headers (an object file): no dynamic section, no soname */
        goto out;
    }
    if (phnum == 0xffff || phnum > MAX_PHNUM)
        FAIL("too many program headers (%u)", phnum);
    if (phentsize < (is64 ? 56u : 32u))
        FAIL("program header entry size %u is too small", phentsize);
    if (phoff > s->size || (uint64_t)phnum * phentsize > s->size - phoff)
        FAIL("program headers lie outside the file");
    phs = malloc((size_t)phnum * phentsize);
    if (phs == NULL) {
        ret = -1;
        goto out;
    }
    READ_OR(src_read(s, phoff, phs, (size_t)phnum * phentsize), "truncated program headers");

    memset(&dynph, 0, sizeof dynph);
    for (i = 0; i < phnum; i++) {
        phdr_get(phs + i * phentsize, is64, &ph);
        if (ph.type == PT_DYNAMIC_) {
            dynph = ph;
            break;
        }
    }
    if (dynph.type != PT_DYNAMIC_) {
        ret = 0; /* static: no soname */
        goto out;
    }
    entsz = is64 ? 16 : 8;
    if (dynph.filesz > MAX_DYN_BYTES)
        FAIL("dynamic section too large (%llu bytes)", (unsigned long long)dynph.filesz);
    if (dynph.offset > s->size || dynph.filesz > s->size - dynph.offset)
        FAIL("dynamic section lies outside the file");
    ndyn = dynph.filesz / entsz;
    dyn = malloc(dynph.filesz ? dynph.filesz : 1);
    if (dyn == NULL) {
        ret = -1;
        goto out;
    }
    READ_OR(src_read(s, dynph.offset, dyn, dynph.filesz), "truncated dynamic section");
    for (i = 0; i < ndyn; i++) {
        const uint8_t *d = dyn + i * entsz;
        int64_t tag = is64 ? (int64_t)le64(d) : (int32_t)le32(d);
        uint64_t val = is64 ? le64(d + 8) : le32(d + 4);
        if (tag == DT_NULL_)
            break;
        if (tag == DT_STRTAB_) {
            strtab = val;
            have_strtab = 1;
        } else if (tag == DT_STRSZ_) {
            strsz = val;
            have_strsz = 1;
        } else if (tag == DT_SONAME_) {
            soname = val;
            have_soname = 1;
        }
    }
    if (!have_soname) {
        ret = 0;
        goto out;
    }
    if (!have_strtab)
        FAIL("DT_SONAME without DT_STRTAB");
    if (!vaddr_to_off(phs, phnum, phentsize, is64, strtab, &stroff))
        FAIL("DT_STRTAB address 0x%llx is not inside any PT_LOAD segment", (unsigned long long)strtab);
    if (have_strsz && soname >= strsz)
        FAIL("DT_SONAME offset %llu is beyond DT_STRSZ %llu", (unsigned long long)soname,
             (unsigned long long)strsz);
    start = stroff + soname;
    if (start < stroff || start >= s->size)
        FAIL("DT_SONAME string lies outside the file");
    avail = s->size - start;
    if (have_strsz && strsz - soname < avail)
        avail = strsz - soname;
    want = avail < sizeof out->soname ? (size_t)avail : sizeof out->soname;
    READ_OR(src_read(s, start, out->soname, want), "truncated string table");
    nul = memchr(out->soname, 0, want);
    if (nul == NULL) {
        out->soname[0] = '\0';
        FAIL(want == sizeof out->soname ? "DT_SONAME string is too long" : "DT_SONAME string is unterminated");
    }
    out->has_soname = 1;
    ret = 0;
out:
    free(phs);
    free(dyn);
    return ret;
}

int gh_elf_info_buf(const uint8_t *buf, size_t len, struct gh_elfinfo *out, char *err, size_t errlen)
{
    struct src s = {buf, -1, len};

    return elf_parse(&s, out, err, errlen);
}

int gh_elf_info_fd(int fd, struct gh_elfinfo *out, char *err, size_t errlen)
{
    struct stat st;
    struct src s = {NULL, fd, 0};

    if (gh_fstat(fd, &st) != 0)
        return -1;
    if (!S_ISREG(st.st_mode)) {
        memset(out, 0, sizeof *out);
        seterr(err, errlen, "not a regular file");
        return 1;
    }
    s.size = (uint64_t)st.st_size;
    return elf_parse(&s, out, err, errlen);
}

/* ------------------------------------------------------------------------------------------------ */
/* syscalls                                                                                         */

int gh_setns(int fd, int nstype) { return setns(fd, nstype); }

int gh_unshare(int flags) { return unshare(flags); }

/* struct statx by its kernel ABI (include/uapi/linux/stat.h), 256 bytes: a raw buffer, because glibc's and the
 * kernel's headers both define the struct and cannot be included together. */
enum {
    RAW_STATX_BYTES = 256,
    RAW_STATX_MASK_AT = 0,
    RAW_STATX_ATTRIBUTES_AT = 8,
    RAW_STATX_ATTRIBUTES_MASK_AT = 56,
    RAW_STATX_MNT_ID_AT = 144
};

/* statx of `fd` itself (never a link's target) into `buf`, asking for `mask` */
static int statx_fd(int fd, uint32_t mask, uint64_t buf[RAW_STATX_BYTES / 8])
{
    memset(buf, 0, RAW_STATX_BYTES);
    return syscall(SYS_statx, fd, "", AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW, mask, buf) != 0 ? -1 : 0;
}

static uint64_t statx_u64(const uint64_t *buf, size_t at)
{
    uint64_t value;
    memcpy(&value, (const uint8_t *)buf + at, sizeof(value));
    return value;
}

int gh_mount_id(int fd, uint64_t *out)
{
    const uint32_t MNT_ID = 0x1000; /* STATX_MNT_ID */
    uint64_t buf[RAW_STATX_BYTES / 8];
    if (statx_fd(fd, MNT_ID, buf) != 0)
        return -1;
    uint32_t mask; /* stx_mask: a __u32 */
    memcpy(&mask, (const uint8_t *)buf + RAW_STATX_MASK_AT, sizeof(mask));
    if (!(mask & MNT_ID))
        return 1; /* a kernel before 5.8: the caller reads /proc/self/fdinfo */
    *out = statx_u64(buf, RAW_STATX_MNT_ID_AT);
    return 0;
}

int gh_is_mount_root(int fd)
{
    const uint64_t MOUNT_ROOT = 0x2000; /* STATX_ATTR_MOUNT_ROOT */
    uint64_t buf[RAW_STATX_BYTES / 8];
    if (statx_fd(fd, 0, buf) != 0)
        return -1;
    if (!(statx_u64(buf, RAW_STATX_ATTRIBUTES_MASK_AT) & MOUNT_ROOT))
        return 2; /* a kernel before 5.8 does not say */
    return (statx_u64(buf, RAW_STATX_ATTRIBUTES_AT) & MOUNT_ROOT) ? 1 : 0;
}

int gh_set_pdeathsig(int sig) { return prctl(PR_SET_PDEATHSIG, (unsigned long)sig, 0, 0, 0); }

int gh_mount(const char *source, const char *target, const char *fstype, unsigned long flags, const char *data)
{
    return mount(source, target, fstype, flags, data);
}

int gh_umount2(const char *target, int flags) { return umount2(target, flags); }

int gh_openat2(int dirfd, const char *path, uint64_t flags, uint64_t mode, uint64_t resolve)
{
    /* struct open_how, spelled out so the build does not need <linux/openat2.h>. */
    struct {
        uint64_t flags, mode, resolve;
    } how = {flags, mode, resolve};

    return (int)syscall(SYS_openat2, dirfd, path, &how, sizeof how);
}

int gh_mknodat(int dirfd, const char *path, uint32_t mode, uint32_t major, uint32_t minor)
{
    return gh_mknod_raw(dirfd, path, (mode_t)mode, makedev(major, minor));
}

/* Raw syscalls: glibc only wraps these from 2.36. */
int gh_open_tree(int dirfd, const char *path, uint32_t flags)
{
    return (int)syscall(SYS_open_tree, dirfd, path, flags);
}

int gh_move_mount(int from_dirfd, const char *from_path, int to_dirfd, const char *to_path, uint32_t flags)
{
    return (int)syscall(SYS_move_mount, from_dirfd, from_path, to_dirfd, to_path, flags);
}

int gh_mount_setattr(int dirfd, const char *path, uint32_t flags, uint64_t attr_set, uint64_t attr_clr,
                     uint64_t propagation)
{
    /* struct mount_attr (MOUNT_ATTR_SIZE_VER0), spelled out so the build does not need <linux/mount.h>'s newest */
    struct {
        uint64_t attr_set, attr_clr, propagation, userns_fd;
    } attr = {attr_set, attr_clr, propagation, 0};

    return (int)syscall(SYS_mount_setattr, dirfd, path, flags, &attr, sizeof attr);
}

#define GH_OPENAT2_ATTEMPTS 64 /* as _native.openat2: a rootfs that keeps racing the lookup fails with EAGAIN */

int gh_bind_files(int count, const int *dirfds, char *const names[], const int *trees, const uint64_t *attr_set,
                  const uint64_t *attr_clr, uint32_t mode, uint64_t resolve, int uid, int gid, int *failed_step,
                  int *failed_errno)
{
    int i;

    *failed_step = 0;
    *failed_errno = 0;
    for (i = 0; i < count; i++) {
        struct stat st;
        int fd = -1, attempt, step = 0;

        if (gh_fstat(trees[i], &st) != 0) {
            step = GH_BIND_TREE;
            goto failed;
        }
        if (!S_ISREG(st.st_mode)) {
            errno = ENOTSUP; /* not a file: a folder's bind goes another way (bind_all) */
            step = GH_BIND_TREE;
            goto failed;
        }
        for (attempt = 0; attempt < GH_OPENAT2_ATTEMPTS; attempt++) {
            fd = gh_openat2(dirfds[i], names[i], O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, mode, resolve);
            if (fd >= 0 || errno != EAGAIN)
                break;
        }
        if (fd < 0) {
            step = GH_BIND_CREATE;
            goto failed;
        }
        if (uid >= 0 && fchown(fd, (uid_t)uid, (gid_t)gid) != 0) {
            step = GH_BIND_OWNER;
            goto failed;
        }
        if (gh_move_mount(trees[i], "", fd, "", MOVE_MOUNT_F_EMPTY_PATH | MOVE_MOUNT_T_EMPTY_PATH) != 0) {
            step = GH_BIND_MOVE;
            goto failed;
        }
        close(fd);
        fd = -1;
        if (gh_mount_setattr(trees[i], "", AT_EMPTY_PATH, attr_set[i], attr_clr[i], MS_PRIVATE) != 0) {
            step = GH_BIND_SETATTR;
            goto failed;
        }
        continue;
    failed:
        *failed_step = step;
        *failed_errno = errno;
        if (fd >= 0)
            close(fd);
        return i;
    }
    return count;
}

int gh_open_trees(int count, char *const paths[], uint32_t flags, int *fds)
{
    int i;

    for (i = 0; i < count; i++) {
        fds[i] = gh_open_tree(AT_FDCWD, paths[i], flags);
        if (fds[i] < 0)
            break;
    }
    return i;
}

int gh_symlinks(int count, const int *dirfds, char *const names[], char *const targets[], int uid, int gid,
                int *failed_step, int *failed_errno)
{
    int i;

    *failed_step = 0;
    *failed_errno = 0;
    for (i = 0; i < count; i++) {
        if (symlinkat(targets[i], dirfds[i], names[i]) != 0) {
            *failed_step = GH_LINK_CREATE;
            break;
        }
        if (uid >= 0 && fchownat(dirfds[i], names[i], (uid_t)uid, (gid_t)gid, AT_SYMLINK_NOFOLLOW) != 0) {
            *failed_step = GH_LINK_OWNER;
            break;
        }
    }
    if (i < count)
        *failed_errno = errno;
    return i;
}

/* ------------------------------------------------------------------------------------------------ */
/* bpf                                                                                              */

static int sys_bpf(int cmd, union bpf_attr *attr)
{
    return (int)syscall(SYS_bpf, cmd, attr, sizeof *attr);
}

int gh_bpf_prog_query(int target_fd, uint32_t attach_type, uint32_t *attach_flags, uint32_t *ids,
                      uint32_t *count)
{
    union bpf_attr a;
    int rc, saved;

    memset(&a, 0, sizeof a);
    a.query.target_fd = (uint32_t)target_fd;
    a.query.attach_type = attach_type;
    a.query.prog_ids = (uint64_t)(uintptr_t)ids;
    a.query.prog_cnt = *count;
    rc = sys_bpf(BPF_PROG_QUERY, &a);
    saved = errno;
    /* On success and on ENOSPC the kernel reports the real count. */
    *count = a.query.prog_cnt;
    *attach_flags = a.query.attach_flags;
    errno = saved;
    return rc;
}

int gh_bpf_prog_get_fd_by_id(uint32_t id)
{
    union bpf_attr a;

    memset(&a, 0, sizeof a);
    a.prog_id = id;
    return sys_bpf(BPF_PROG_GET_FD_BY_ID, &a);
}

int gh_bpf_prog_info(int prog_fd, struct gh_bpf_prog_info *out, uint8_t *xlated, uint32_t xlated_cap)
{
    struct bpf_prog_info info;
    union bpf_attr a;
    int rc;

    memset(&info, 0, sizeof info);
    memset(out, 0, sizeof *out);
    if (xlated != NULL) {
        info.xlated_prog_len = xlated_cap;
        info.xlated_prog_insns = (uint64_t)(uintptr_t)xlated;
    }
    memset(&a, 0, sizeof a);
    a.info.bpf_fd = (uint32_t)prog_fd;
    a.info.info_len = sizeof info;
    a.info.info = (uint64_t)(uintptr_t)&info;
    rc = sys_bpf(BPF_OBJ_GET_INFO_BY_FD, &a);
    if (rc != 0)
        return rc;
    out->id = info.id;
    out->type = info.type;
    out->xlated_len = info.xlated_prog_len;
    out->xlated_withheld = xlated != NULL && info.xlated_prog_len != 0 && info.xlated_prog_insns == 0;
    out->gpl_compatible = info.gpl_compatible;
    memcpy(out->name, info.name, sizeof out->name < sizeof info.name ? sizeof out->name : sizeof info.name);
    out->name[sizeof out->name - 1] = '\0';
    return 0;
}

int gh_bpf_prog_load(uint32_t prog_type, const uint8_t *insns, size_t insns_len, const char *license,
                     const char *name, uint32_t log_level, char *log, uint32_t log_size)
{
    union bpf_attr a;

    if (insns_len == 0 || insns_len % 8 != 0 || insns_len / 8 > UINT32_MAX) {
        errno = EINVAL;
        return -1;
    }
    memset(&a, 0, sizeof a);
    a.prog_type = prog_type;
    a.insns = (uint64_t)(uintptr_t)insns;
    a.insn_cnt = (uint32_t)(insns_len / 8);
    a.license = (uint64_t)(uintptr_t)license;
    if (log != NULL && log_size > 0) {
        log[0] = '\0';
        a.log_level = log_level;
        a.log_buf = (uint64_t)(uintptr_t)log;
        a.log_size = log_size;
    }
    if (name != NULL)
        strncpy(a.prog_name, name, sizeof a.prog_name - 1);
    return sys_bpf(BPF_PROG_LOAD, &a);
}

int gh_bpf_prog_attach(int target_fd, int prog_fd, uint32_t attach_type, uint32_t flags, int replace_fd)
{
    union bpf_attr a;

    memset(&a, 0, sizeof a);
    a.target_fd = (uint32_t)target_fd;
    a.attach_bpf_fd = (uint32_t)prog_fd;
    a.attach_type = attach_type;
    a.attach_flags = flags;
    if ((flags & BPF_F_REPLACE) && replace_fd >= 0)
        a.replace_bpf_fd = (uint32_t)replace_fd;
    return sys_bpf(BPF_PROG_ATTACH, &a);
}

int gh_bpf_prog_detach(int target_fd, int prog_fd, uint32_t attach_type)
{
    union bpf_attr a;

    memset(&a, 0, sizeof a);
    a.target_fd = (uint32_t)target_fd;
    a.attach_bpf_fd = (uint32_t)prog_fd;
    a.attach_type = attach_type;
    return sys_bpf(BPF_PROG_DETACH, &a);
}
