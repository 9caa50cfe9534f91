/*
 * gpuhook native helper: what Python lacks or does slowly.
 *   - glibc ld.so.cache and ELF (DT_SONAME) reading, with strict bounds checks (input is untrusted);
 *   - thin syscall wrappers (setns, unshare, mount, umount2, openat2, mknodat);
 *   - runs of an injection's system calls, one call each (mount sources, binds onto new files, new links);
 *   - the bpf(2) calls needed to widen a cgroup v2 device filter;
 *   - confining ldconfig (confine.c): capabilities, no_new_privs, a seccomp allow-list.
 * Plain C, no Python objects. Calls return -1 with errno set for syscall failures; the parsers return 1
 * with a message in `err` for malformed input. The block between the CDEF markers is fed verbatim to
 * cffi's cdef by _build.py, so it must stay free of preprocessor directives.
 */
#ifndef GPUHOOK_NATIVE_H
#define GPUHOOK_NATIVE_H

#include <stddef.h>
#include <stdint.h>

/* CDEF BEGIN */
struct gh_ldentry {
    uint64_t key;       /* offset of the key (soname) in the buffer */
    uint64_t value;     /* offset of the value (the library's path) */
    uint64_t hwcap;
    uint32_t key_len;   /* lengths without the NUL */
    uint32_t value_len;
    int32_t flags;      /* glibc FLAG_* (type in the low byte, required ABI in the next) */
};

struct gh_elfinfo {
    int elf_class;      /* 32 or 64 */
    int machine;        /* e_machine */
    int has_soname;
    char soname[4096];
};

struct gh_bpf_prog_info {
    uint32_t id;
    uint32_t type;
    uint32_t xlated_len;      /* bytes of translated instructions the kernel holds */
    int xlated_withheld;      /* the kernel refused to dump them (no CAP_SYS_ADMIN / kptr_restrict) */
    int gpl_compatible;       /* loaded with a GPL-compatible license (may use GPL-only helpers) */
    char name[16];
};

/* Returns the entry count (filling at most `cap` entries: call with cap 0 to size the array), or -1. */
int64_t gh_ldcache_parse(const uint8_t *buf, size_t len, struct gh_ldentry *out, size_t cap,
                         char *err, size_t errlen);
/* 0: parsed (has_soname says whether there is one); 1: malformed (err); -1: I/O error (errno). */
int gh_elf_info_buf(const uint8_t *buf, size_t len, struct gh_elfinfo *out, char *err, size_t errlen);
int gh_elf_info_fd(int fd, struct gh_elfinfo *out, char *err, size_t errlen);

int gh_setns(int fd, int nstype);
int gh_unshare(int flags);
/* The id of the mount `fd` is on (statx STATX_MNT_ID, as /proc/self/fdinfo's mnt_id): 0, or 1 when the kernel
 * does not report it (before 5.8), or -1 (errno). */
int gh_mount_id(int fd, uint64_t *out);
int gh_set_pdeathsig(int sig);
int gh_mount(const char *source, const char *target, const char *fstype, unsigned long flags,
             const char *data);
int gh_umount2(const char *target, int flags);
int gh_openat2(int dirfd, const char *path, uint64_t flags, uint64_t mode, uint64_t resolve);
int gh_mknodat(int dirfd, const char *path, uint32_t mode, uint32_t major, uint32_t minor);
int gh_open_tree(int dirfd, const char *path, uint32_t flags);
/* mount_setattr(2) (Linux 5.12): set and clear MOUNT_ATTR_* flags of the mount at `path` under `dirfd`
 * (AT_EMPTY_PATH: `dirfd` itself; AT_RECURSIVE: and every mount below it) in one call, and its propagation
 * (MS_PRIVATE, ...; 0 leaves it as it is). -1/ENOSYS on an older kernel. */
int gh_mount_setattr(int dirfd, const char *path, uint32_t flags, uint64_t attr_set, uint64_t attr_clr,
                     uint64_t propagation);
/* Whether `fd` is the root of a mount (statx STATX_ATTR_MOUNT_ROOT): 1 or 0, 2 when the kernel does not say
 * (before 5.8), or -1 (errno). */
int gh_is_mount_root(int fd);
int gh_move_mount(int from_dirfd, const char *from_path, int to_dirfd, const char *to_path, uint32_t flags);
/* A run of bind mounts onto new empty files, each a few system calls with no Python between them (mounts.py's
 * bind_all; it decides which binds go here and has checked each folder is the rootfs's own). Item i: the
 * detached tree `trees[i]` must be a regular file; `names[i]` is created in the folder `dirfds[i]` (openat2
 * O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW with `mode` and `resolve`, EAGAIN retried as openat2(2) asks),
 * given to `uid`:`gid` when uid >= 0, the tree attached onto it (move_mount), the new file's descriptor closed,
 * then the tree's mount given `attr_set[i]`, `attr_clr[i]` and private propagation (mount_setattr). Stops at
 * the first item that fails: returns how many were done, that item's step (GH_BIND_*) and errno in *failed_step
 * and *failed_errno (0 when all were done). The caller keeps every descriptor it passed. */
/* open_tree(AT_FDCWD, paths[i], flags) for each path, the descriptors in `fds` (mounts.clone_sources): how many
 * were opened before the first that failed (errno), `count` when all were. */
int gh_open_trees(int count, char *const paths[], uint32_t flags, int *fds);
/* A run of new symbolic links (RootFS.symlinks decides which links go here, in folders it checked are the
 * rootfs's own): item i is `names[i]` -> `targets[i]` in the folder `dirfds[i]` (symlinkat), given to
 * `uid`:`gid` when uid >= 0. Stops at the first that fails: returns how many were made, that item's step
 * (GH_LINK_*) and errno (0 when all were made). */
enum { GH_LINK_CREATE = 1, GH_LINK_OWNER = 2 };
int gh_symlinks(int count, const int *dirfds, char *const names[], char *const targets[], int uid, int gid,
                int *failed_step, int *failed_errno);
enum { GH_BIND_TREE = 1, GH_BIND_CREATE = 2, GH_BIND_OWNER = 3, GH_BIND_MOVE = 4, GH_BIND_SETATTR = 5 };
int gh_bind_files(int count, const int *dirfds, char *const names[], const int *trees, const uint64_t *attr_set,
                  const uint64_t *attr_clr, uint32_t mode, uint64_t resolve, int uid, int gid, int *failed_step,
                  int *failed_errno);

int gh_bpf_prog_query(int target_fd, uint32_t attach_type, uint32_t *attach_flags, uint32_t *ids,
                      uint32_t *count);
int gh_bpf_prog_get_fd_by_id(uint32_t id);
int gh_bpf_prog_info(int prog_fd, struct gh_bpf_prog_info *out, uint8_t *xlated, uint32_t xlated_cap);
int gh_bpf_prog_load(uint32_t prog_type, const uint8_t *insns, size_t insns_len, const char *license,
                     const char *name, uint32_t log_level, char *log, uint32_t log_size);
int gh_bpf_prog_attach(int target_fd, int prog_fd, uint32_t attach_type, uint32_t flags, int replace_fd);
int gh_bpf_prog_detach(int target_fd, int prog_fd, uint32_t attach_type);

/* confine.c: for the host's ldconfig, after chroot and before execve. */
int gh_no_new_privs(void);
/* Drop every capability not in `keep` (bit N = capability N) from the bounding, ambient, effective, permitted and
 * inheritable sets. */
int gh_keep_capabilities(uint64_t keep);
/* Install the ldconfig allow-list (other calls: EPERM; another arch or x32: killed); needs no_new_privs.
 * -1/ENOSYS on an architecture it has no list for. */
int gh_seccomp_ldconfig(void);
/* All three, in that order (ENOSYS from the filter tolerated): what ldconfig runs under. */
int gh_confine_ldconfig(uint64_t keep);
/* Start the host's ldconfig (`exe_fd`, static) confined, in the root `root_fd`, stdin from `in_fd`, stdout and
 * stderr to `out_fd`, no environment, `alarm(timeout_s)`, only stdio (and the program's own descriptor, 3,
 * close-on-exec) kept, killed with its caller. A clone(CLONE_VM | CLONE_VFORK) child, as posix_spawn: a large
 * caller (the resident service) pays no copy of its memory. Returns the pid (or -1, errno); a child that could
 * not execve has exited 127, with the step (GH_SPAWN_*) and errno in *failed_step, *failed_errno. */
enum { GH_SPAWN_PDEATHSIG = 1, GH_SPAWN_FDS = 2, GH_SPAWN_ROOT = 3, GH_SPAWN_CONFINE = 4, GH_SPAWN_EXEC = 5 };
int gh_spawn_confined(int exe_fd, int root_fd, int in_fd, int out_fd, char *const argv[], uint64_t keep,
                      unsigned int timeout_s, int *failed_step, int *failed_errno);
/* CDEF END */

#endif
