/* gpuhook native helper: confining the host's ldconfig before it parses an image's files (see gpuhook_native.h).
 *
 * libnvidia-container runs ldconfig with few capabilities, no_new_privs and a seccomp filter; so does gpuhook:
 * a memory bug in glibc's ELF or config parsing, driven by a hostile image, must not become a host escape. */
#define _GNU_SOURCE
#include "gpuhook_native.h"

#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stddef.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <linux/audit.h>
#include <linux/capability.h>
#include <linux/filter.h>
#include <linux/seccomp.h>

#if defined(__x86_64__)
#define GH_AUDIT_ARCH AUDIT_ARCH_X86_64
#elif defined(__aarch64__)
#define GH_AUDIT_ARCH AUDIT_ARCH_AARCH64
#endif

/* What a static glibc ldconfig calls (strace of glibc 2.36's, building a cache, warnings, links, -p), plus what
 * glibc may use instead on another version; the numbers come from this build's headers. */
static const int ldconfig_syscalls[] = {
#define S(name) __NR_##name,
#ifdef __NR_open
    S(open) S(stat) S(lstat) S(access) S(readlink) S(rename) S(mkdir) S(rmdir) S(unlink) S(symlink) S(chmod)
    S(getdents) S(dup2) S(time)
#endif
    S(read) S(write) S(openat) S(close) S(fstat) S(newfstatat) S(statx) S(lseek) S(pread64) S(pwrite64)
    S(readv) S(writev) S(mmap) S(munmap) S(mprotect) S(mremap) S(brk) S(madvise) S(rt_sigaction)
    S(rt_sigprocmask) S(rt_sigreturn) S(ioctl) S(faccessat) S(faccessat2) S(getdents64) S(getcwd) S(chdir)
    S(fchdir) S(renameat) S(renameat2) S(mkdirat) S(unlinkat) S(symlinkat) S(readlinkat) S(fchmod) S(fchmodat)
    S(ftruncate) S(fcntl) S(dup) S(dup3) S(exit) S(exit_group) S(set_tid_address)
    S(set_robust_list) S(rseq) S(getrandom) S(uname) S(futex) S(getpid) S(gettid)
    S(getuid) S(geteuid) S(getgid) S(getegid) S(umask) S(clock_gettime) S(gettimeofday) S(sysinfo)
    S(sched_getaffinity) S(execve) S(execveat)
#ifdef __NR_arch_prctl
    S(arch_prctl)
#endif
#undef S
};

int gh_no_new_privs(void) { return prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); }

int gh_keep_capabilities(uint64_t keep)
{
    for (int cap = 0; cap < 64; cap++) {
        if (keep & (1ULL << cap))
            continue;
        if (prctl(PR_CAPBSET_DROP, (unsigned long)cap, 0, 0, 0) != 0) {
            if (errno == EINVAL)
                break; /* past the kernel's last capability: none above it either */
            return -1;
        }
    }
    if (prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) != 0 && errno != EINVAL)
        return -1;
    struct __user_cap_header_struct head = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct data[2];
    memset(data, 0, sizeof(data));
    for (int i = 0; i < 2; i++) {
        data[i].effective = data[i].permitted = (uint32_t)(keep >> (32 * i));
        data[i].inheritable = 0;
    }
    return (int)syscall(SYS_capset, &head, data);
}

#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define GH_ARG0_LO offsetof(struct seccomp_data, args[0])
#define GH_ARG0_HI (offsetof(struct seccomp_data, args[0]) + 4)
#else
#define GH_ARG0_LO (offsetof(struct seccomp_data, args[0]) + 4)
#define GH_ARG0_HI offsetof(struct seccomp_data, args[0])
#endif

/* The system call `nr` allowed only when its first argument (a pid) is `pid`, else EPERM: 7 instructions. The
 * accumulator holds the call's number on entry and, where `nr` is not this call, on exit. */
static size_t only_for_pid(struct sock_filter *f, uint32_t nr, uint32_t pid)
{
    size_t k = 0;
    f[k++] = (struct sock_filter)BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, nr, 0, 6);
    f[k++] = (struct sock_filter)BPF_STMT(BPF_LD | BPF_W | BPF_ABS, GH_ARG0_LO);
    f[k++] = (struct sock_filter)BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, pid, 0, 3);
    f[k++] = (struct sock_filter)BPF_STMT(BPF_LD | BPF_W | BPF_ABS, GH_ARG0_HI);
    f[k++] = (struct sock_filter)BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, 0, 0, 1);
    f[k++] = (struct sock_filter)BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW);
    f[k++] = (struct sock_filter)BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (EPERM & SECCOMP_RET_DATA));
    return k;
}

int gh_seccomp_ldconfig(void)
{
#ifndef GH_AUDIT_ARCH
    errno = ENOSYS;
    return -1;
#else
    enum { N = sizeof(ldconfig_syscalls) / sizeof(ldconfig_syscalls[0]) };
    struct sock_filter f[6 + 4 + 2 * 7 + 2 * N + 1];
    /* ldconfig runs as root in the caller's PID namespace (the service's: the host's): it may signal only itself
     * (glibc's abort: tgkill(getpid(), gettid(), SIGABRT)) and read or set only its own limits (glibc's
     * getrlimit/setrlimit: prlimit64(0, …)); kill is not allowed at all. The pid is this process's, which
     * execve keeps. */
    uint32_t self = (uint32_t)syscall(SYS_getpid);
    size_t k = 0;
    f[k++] = (struct sock_filter)BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, arch));
    f[k++] = (struct sock_filter)BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, GH_AUDIT_ARCH, 1, 0);
    f[k++] = (struct sock_filter)BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_KILL_PROCESS);
    f[k++] = (struct sock_filter)BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr));
    /* x32 system calls (bit 30) share the arch: killed, never matched against the 64-bit numbers */
    f[k++] = (struct sock_filter)BPF_JUMP(BPF_JMP | BPF_JGE | BPF_K, 0x40000000u, 0, 1);
    f[k++] = (struct sock_filter)BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_KILL_PROCESS);
    /* fsync and fdatasync succeed without running: the cache ldconfig writes lives in a container's rootfs, and
     * every start (prestart hook, CDI hook, shim) writes it anew, so a crash can lose nothing a restart does not
     * rebuild. On ext4 each one forced a journal commit that the container's start waited for. */
    f[k++] = (struct sock_filter)BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, (uint32_t)__NR_fsync, 0, 1);
    f[k++] = (struct sock_filter)BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | 0);
    f[k++] = (struct sock_filter)BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, (uint32_t)__NR_fdatasync, 0, 1);
    f[k++] = (struct sock_filter)BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | 0);
    k += only_for_pid(f + k, (uint32_t)__NR_tgkill, self);
    k += only_for_pid(f + k, (uint32_t)__NR_prlimit64, 0);
    for (size_t i = 0; i < N; i++) {
        f[k++] = (struct sock_filter)BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, (uint32_t)ldconfig_syscalls[i], 0, 1);
        f[k++] = (struct sock_filter)BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW);
    }
    /* anything else fails with EPERM (glibc copes; a kill would turn a harmless new call into a failed start) */
    f[k++] = (struct sock_filter)BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (EPERM & SECCOMP_RET_DATA));
    struct sock_fprog prog = {(unsigned short)k, f};
    return prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog, 0, 0);
#endif
}

int gh_confine_ldconfig(uint64_t keep)
{
    if (gh_keep_capabilities(keep) != 0 || gh_no_new_privs() != 0)
        return -1;
    if (gh_seccomp_ldconfig() != 0 && errno != ENOSYS)
        return -1;
    return 0;
}

/* --- gh_spawn_confined: ldconfig started without copying the caller ------------------------------------------ */

struct spawn_args {
    int exe_fd, root_fd, in_fd, out_fd;
    char *const *argv;
    uint64_t keep;
    unsigned int timeout_s;
    pid_t parent;
    sigset_t mask;     /* the caller's signal mask, given back to the program at execve */
    int failed_step;   /* the child writes these (it shares our memory) when it cannot execve */
    int failed_errno;
};

static int spawn_fail(struct spawn_args *a, int step)
{
    a->failed_errno = errno;
    a->failed_step = step;
    _exit(127);
}

static void close_from(int first)
{
    if (syscall(SYS_close_range, (unsigned int)first, ~0U, 0) == 0)
        return;
    struct rlimit lim; /* a kernel before 5.9: every descriptor number the limit allows */
    rlim_t most = getrlimit(RLIMIT_NOFILE, &lim) == 0 && lim.rlim_cur != RLIM_INFINITY ? lim.rlim_cur : 1 << 20;
    for (rlim_t fd = (rlim_t)first; fd < most; fd++)
        close((int)fd);
}

/* Runs on its own stack in our memory until execve: only system calls, nothing of malloc or stdio. */
static int spawn_child(void *arg)
{
    struct spawn_args *a = arg;
    struct sigaction dfl;
    memset(&dfl, 0, sizeof(dfl));
    dfl.sa_handler = SIG_DFL;
    for (int sig = 1; sig < _NSIG; sig++) { /* the caller's handlers (a copy: no CLONE_SIGHAND) never run here */
        struct sigaction old;
        if (sigaction(sig, NULL, &old) == 0 && old.sa_handler != SIG_IGN && old.sa_handler != SIG_DFL)
            sigaction(sig, &dfl, NULL);
    }
    if (prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0) != 0)
        spawn_fail(a, GH_SPAWN_PDEATHSIG);
    if (getppid() != a->parent) /* the caller was killed already */
        _exit(127);
    int exe = fcntl(a->exe_fd, F_DUPFD_CLOEXEC, 10), root = fcntl(a->root_fd, F_DUPFD_CLOEXEC, 10);
    int in = fcntl(a->in_fd, F_DUPFD_CLOEXEC, 10), out = fcntl(a->out_fd, F_DUPFD_CLOEXEC, 10);
    if (exe < 0 || root < 0 || in < 0 || out < 0)
        spawn_fail(a, GH_SPAWN_FDS);
    if (dup2(in, 0) < 0 || dup2(out, 1) < 0 || dup2(out, 2) < 0 || dup3(exe, 3, O_CLOEXEC) < 0)
        spawn_fail(a, GH_SPAWN_FDS);
    if (fchdir(root) != 0)
        spawn_fail(a, GH_SPAWN_ROOT);
    close_from(4);
    if (chroot(".") != 0 || chdir("/") != 0)
        spawn_fail(a, GH_SPAWN_ROOT);
    alarm(a->timeout_s); /* survives execve; before the filter, which does not allow alarm() */
    if (gh_confine_ldconfig(a->keep) != 0)
        spawn_fail(a, GH_SPAWN_CONFINE);
    sigprocmask(SIG_SETMASK, &a->mask, NULL);
    char *envp[] = {NULL};
    syscall(SYS_execveat, 3, "", a->argv, envp, AT_EMPTY_PATH);
    return spawn_fail(a, GH_SPAWN_EXEC);
}

int gh_spawn_confined(int exe_fd, int root_fd, int in_fd, int out_fd, char *const argv[], uint64_t keep,
                      unsigned int timeout_s, int *failed_step, int *failed_errno)
{
    enum { STACK = 256 * 1024 };
    struct spawn_args a;
    memset(&a, 0, sizeof(a));
    a.exe_fd = exe_fd;
    a.root_fd = root_fd;
    a.in_fd = in_fd;
    a.out_fd = out_fd;
    a.argv = argv;
    a.keep = keep;
    a.timeout_s = timeout_s;
    a.parent = getpid();
    void *stack = mmap(NULL, STACK, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_STACK, -1, 0);
    if (stack == MAP_FAILED)
        return -1;
    sigset_t all;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &a.mask); /* no signal is handled while the child runs on our memory */
    pid_t pid = clone(spawn_child, (char *)stack + STACK, CLONE_VM | CLONE_VFORK | SIGCHLD, &a);
    int saved = errno;
    pthread_sigmask(SIG_SETMASK, &a.mask, NULL);
    munmap(stack, STACK);
    *failed_step = a.failed_step;
    *failed_errno = a.failed_errno;
    errno = saved;
    return pid;
}
