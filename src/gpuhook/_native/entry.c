/* gpuhook's native hook entry: what `gpuhook hook install` writes at the hook path.
 *
 * It only forwards; Python stays the one implementation of every decision. It reads the OCI state
 * from stdin (a state over MAX_STATE bytes goes to the Python entry, below, never to the service), connects to `gpuhook service` ($GPUHOOK_SERVICE_SOCKET, else
 * /run/gpuhook/service.sock), sends its arguments, $GPUHOOK_CONFIG and the state (service/protocol.py, with
 * an O_DIRECTORY fd of /proc/<pid> over SCM_RIGHTS when the state names a pid), and relays the answer: the
 * one stderr line and the exit status.
 *
 * A `cdi-hook …` call (a CDI spec's createContainer hook) connects and sends its header first and its state once
 * stdin gave it (protocol.py's `later`; cdi_hook below), so the service's part overlaps the runtime's delay.
 *
 * Who runs the call is decided here, by one byte (service/protocol.py): the service changes nothing before it
 * sends TAKING and reads our GO. Until we send GO the call is ours: whenever the service cannot be reached, says
 * nothing within $GPUHOOK_SERVICE_ACK_MS (default 250) of the connect, closes, DECLINES, or answers without
 * TAKING in a way we cannot read, we exec the Python entry beside us (its own path + ".py", the -IS script) with
 * the same arguments and the same state on stdin (a memfd), and $GPUHOOK_SERVED_BY saying why, for its log line:
 * the same result as with no service at all, at most that bound later. A stopped, stuck, crashed or flooded
 * service so never fails a start, and never injects twice: once GO is sent the service owns the call, and an
 * answer that does not come within $GPUHOOK_SERVICE_TIMEOUT_MS (default 5000, below runc's hook timeout) fails
 * the start with one line.
 *
 * --help and --version go straight to the Python entry; so does a `cdi-hook …` call the service DECLINED (one only
 * click can word: help, a malformed option), since the service did nothing for it.
 *
 * `ENTRY generate-cdi ARGS` is the console script's `gpuhook generate-cdi ARGS` without an interpreter's start:
 * the request service/client.py sends (no state; the client's cwd, its interpreter, which is the Python entry's
 * #! line, and the SERVED_ENV values), the spec relayed to stdout and the messages to stderr with the exit
 * status. Nothing listening, a DECLINED answer or no way to say where the client is (cwd, interpreter): the
 * Python entry runs it in-process, as the console script does. A service that took the request and then failed
 * is one `gpuhook: service …` line and exit 1, never a second run.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#define MAX_STATE (1 << 20)   /* protocol.MAX_STATE */
#define MAX_HEADER (64 << 10) /* protocol.MAX_HEADER */
#define MAX_ANSWER (64 << 10) /* protocol.MAX_ANSWER */
#define MAX_DOCUMENT (64 << 20) /* oci/bundle.MAX_DOCUMENT: the most of a state the Python hook reads */
#define DEFAULT_SOCKET "/run/gpuhook/service.sock"
#define DEFAULT_TIMEOUT_MS 5000
#define DEFAULT_ACK_MS 250 /* protocol.TAKING_WAIT_MS */
#define DECLINED 256 /* protocol.DECLINED: the service took nothing on; run the call in-process */
#define TAKING 257 /* protocol.TAKING: the service will change something once we say GO */
#define GO 1 /* protocol.GO */
#define MAX_OUTPUT (64 << 20) /* protocol.MAX_OUTPUT: a generate-cdi spec on stdout */
#define COMMAND_TIMEOUT_MS 60000 /* service/client.ANSWER_TIMEOUT_S: a served command may discover */
#define SHEBANG_MAX 256 /* the kernel reads at most this much of a "#!" line (cli/entry.SHEBANG_MAX + 1) */

/* hook/installed.py's MARKER: is_ours() finds it in this binary as in the script. */
const char gpuhook_marker[] =
    "# gpuhook's OCI hook (and CDI createContainer hook) entry, written by `gpuhook hook install`.";

static void fail(const char *what, const char *detail) {
    fprintf(stderr, "gpuhook-hook: %s%s%s\n", what, detail ? ": " : "", detail ? detail : "");
    exit(1);
}

/* The big-endian u32 at p (protocol.py's framing). */
static uint32_t be32(const unsigned char *p) {
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

static long long now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* The whole of stdin up to MAX_STATE bytes; *over is set (and the bytes read so far returned) when there is
 * more: such a state is the in-process hook's to read and word (fallback), the service never sees it. */
static char *read_state(size_t *len, int *over) {
    size_t cap = 4096, n = 0;
    char *buf = malloc(cap);
    if (!buf) fail("out of memory", NULL);
    *over = 0;
    for (;;) {
        if (n == cap) {
            if (cap > MAX_STATE) {
                *over = 1;
                break;
            }
            cap *= 2;
            buf = realloc(buf, cap);
            if (!buf) fail("out of memory", NULL);
        }
        ssize_t r = read(0, buf + n, cap - n);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) fail("cannot read the OCI state", strerror(errno));
        if (r == 0) break;
        n += (size_t)r;
    }
    if (n > MAX_STATE) *over = 1;
    *len = n;
    return buf;
}

/* The index of the first byte at or after j of s[0..n) that is not JSON whitespace. */
static size_t skip_space(const char *s, size_t n, size_t j) {
    while (j < n && (s[j] == ' ' || s[j] == '\t' || s[j] == '\n' || s[j] == '\r')) j++;
    return j;
}

/* The first top-level-looking "pid": <digits> of the state; 0 when there is none (then no fd is sent: the
 * service parses the state properly and words what is wrong). */
static long find_pid(const char *s, size_t n) {
    const char key[] = "\"pid\"";
    for (size_t i = 0; i + sizeof key - 1 <= n; i++) {
        if (memcmp(s + i, key, sizeof key - 1) != 0) continue;
        size_t j = i + sizeof key - 1;
        j = skip_space(s, n, j);
        if (j >= n || s[j] != ':') continue;
        j = skip_space(s, n, j + 1);
        long pid = 0;
        size_t digits = 0;
        while (j < n && s[j] >= '0' && s[j] <= '9' && digits < 10) pid = pid * 10 + (s[j++] - '0'), digits++;
        return (digits && pid > 0 && pid <= INT_MAX && (j >= n || s[j] < '0' || s[j] > '9')) ? pid : 0;
    }
    return 0;
}

/* Growable buffer for the JSON header; `over` once it would pass MAX_HEADER (then nothing more is put). */
struct buf { char *p; size_t n, cap; int over; };

static void put(struct buf *b, const char *s, size_t n) {
    if (b->over || b->n + n > MAX_HEADER) {
        b->over = 1;
        return;
    }
    if (b->n + n > b->cap) {
        b->cap = (b->n + n) * 2;
        b->p = realloc(b->p, b->cap);
        if (!b->p) fail("out of memory", NULL);
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
}

static void put_str(struct buf *b, const char *s) { put(b, s, strlen(s)); }

static void put_json_string(struct buf *b, const char *s) {
    put(b, "\"", 1);
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        char esc[8];
        if (c == '"' || c == '\\') {
            esc[0] = '\\', esc[1] = (char)c;
            put(b, esc, 2);
        } else if (c < 0x20 || c == 0x7f) {
            snprintf(esc, sizeof esc, "\\u%04x", c);
            put(b, esc, 6);
        } else {
            put(b, (const char *)&c, 1);
        }
    }
    put(b, "\"", 1);
}

/* The header's start: the version and our arguments (argv[0] left out), the list still open. */
static void put_argv(struct buf *b, int argc, char **argv) {
    put_str(b, "{\"v\": 2, \"argv\": [");
    for (int i = 1; i < argc; i++) {
        if (i > 1) put_str(b, ", ");
        put_json_string(b, argv[i]);
    }
}

/* All of buf[0..n) to fd, or one line and exit 1. */
static void write_all(int fd, const char *buf, size_t n) {
    for (size_t off = 0; off < n;) {
        ssize_t w = write(fd, buf + off, n - off);
        if (w < 0 && errno == EINTR) continue;
        if (w < 0) fail("cannot keep the OCI state for the Python entry", strerror(errno));
        off += (size_t)w;
    }
}

/* Exec the Python entry beside us with the same argv, the state on stdin. Returns only on failure. */
/* The Python entry beside us: our own path + ".py". */
static void script_path(char *script, size_t size) {
    char self[PATH_MAX - 4];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n < 0) fail("cannot find the Python entry (readlink /proc/self/exe)", strerror(errno));
    self[n] = 0;
    snprintf(script, size, "%s.py", self);
}

/* --- the Python entry cannot run (its #! interpreter or the entry itself is gone: Python upgraded, the venv
 * deleted, gpuhook removed) ------------------------------------------------------------------------------------
 * Nothing can plan this start, so a container that asks for a GPU must fail with one line naming the fix, and one
 * that asks for none must start untouched, as it would have. Deciding that here is conservative: any sign that
 * model/contract.has_gpu_signal or model/request.py could read as a request counts, whatever its value (an
 * NVIDIA_* or CUDA_VERSION variable, a cdi.k8s.io/ annotation, a mount under nvidia-container-devices), as does
 * anything that cannot be read (no bundle in the state, no config.json, one over MAX_DOCUMENT). The bundle's
 * config.json is scanned as bytes for those strings, in bounded chunks; it is never parsed. A `cdi-hook` call comes
 * from a CDI spec, which only a GPU device's injection runs, and a command (generate-cdi, --help) has no container:
 * both always fail. tests/test_stranded.py checks the strings against model/contract.py. */
static const char *const STRANDED_SIGNS[] = {
    "\"NVIDIA_",                  /* an env entry "NVIDIA_…=…" (contract.VISIBLE_DEVICES and every other NVIDIA_*) */
    "\"CUDA_VERSION=",            /* contract.LEGACY_CUDA_VERSION: a legacy CUDA image */
    "\"cdi.k8s.io/",              /* contract.CDI_ANNOTATION_PREFIX */
    "nvidia-container-devices",   /* contract.VOLUME_MOUNT_DIR's folder: a device requested by a mount */
};
#define STRANDED_OVERLAP 32 /* > the longest sign: one split between two chunks is still found */

static int has_sign(const char *s, size_t n) {
    for (size_t k = 0; k < sizeof STRANDED_SIGNS / sizeof *STRANDED_SIGNS; k++)
        if (memmem(s, n, STRANDED_SIGNS[k], strlen(STRANDED_SIGNS[k]))) return 1;
    return 0;
}

/* Whether the config.json of `bundle` shows any sign of a GPU request; 1 too when it cannot be read whole. */
static int bundle_has_sign(const char *bundle) {
    char path[PATH_MAX];
    if ((size_t)snprintf(path, sizeof path, "%s/config.json", bundle) >= sizeof path) return 1;
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) return 1;
    static char chunk[STRANDED_OVERLAP + 65536];
    size_t keep = 0, total = 0;
    for (;;) {
        ssize_t r = read(fd, chunk + keep, sizeof chunk - keep);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) {
            close(fd);
            return r < 0;
        }
        total += (size_t)r;
        if (total > MAX_DOCUMENT || has_sign(chunk, keep + (size_t)r)) {
            close(fd);
            return 1;
        }
        size_t n = keep + (size_t)r;
        keep = n < STRANDED_OVERLAP ? n : STRANDED_OVERLAP;
        memmove(chunk, chunk + n - keep, keep);
    }
}

/* Whether the state (its annotations) or the bundle named by any "bundle": "…" in it shows a sign of a GPU
 * request; 1 when no bundle is named or a name uses an escape this does not decode (\uXXXX). */
static int state_has_sign(const char *state, size_t len) {
    if (has_sign(state, len)) return 1;
    const char key[] = "\"bundle\"";
    int found = 0;
    for (size_t i = 0; i + sizeof key - 1 <= len; i++) {
        if (memcmp(state + i, key, sizeof key - 1) != 0) continue;
        size_t j = skip_space(state, len, i + sizeof key - 1);
        if (j >= len || state[j] != ':') continue;
        j = skip_space(state, len, j + 1);
        if (j >= len || state[j] != '"') continue;
        char bundle[PATH_MAX];
        size_t n = 0;
        for (j++; j < len && state[j] != '"'; j++) {
            char c = state[j];
            if (c == '\\') {
                if (++j >= len || (state[j] != '\\' && state[j] != '"' && state[j] != '/')) return 1;
                c = state[j];
            }
            if (c == 0 || n + 1 >= sizeof bundle) return 1;
            bundle[n++] = c;
        }
        if (j >= len || n == 0) return 1;
        bundle[n] = 0;
        if (bundle_has_sign(bundle)) return 1;
        found = 1;
    }
    return !found;
}

/* Why execv(`script`) failed with `err`, in words: ENOENT for a script that is there means its #! interpreter is
 * gone (Python upgraded, the venv deleted), which is what the line must name. */
static void exec_failure(const char *script, int err, char *why, size_t size) {
    char line[PATH_MAX + 8];
    int fd = err == ENOENT ? open(script, O_RDONLY | O_CLOEXEC | O_NONBLOCK) : -1;
    ssize_t n = fd >= 0 ? read(fd, line, sizeof line - 1) : -1;
    if (fd >= 0) close(fd);
    if (n > 2 && line[0] == '#' && line[1] == '!') {
        line[n] = 0;
        char *interpreter = line + 2 + strspn(line + 2, " \t");
        interpreter[strcspn(interpreter, " \t\r\n")] = 0;
        if (*interpreter && access(interpreter, X_OK) != 0) {
            snprintf(why, size, "its interpreter %s is missing", interpreter);
            return;
        }
    }
    snprintf(why, size, "%s", strerror(err));
}

/* The Python entry `script` could not be exec'd (errno `err`): a container without a GPU request starts (exit 0,
 * nothing said); anything else is one line naming the fix, exit 1. */
static void stranded(char **argv, const char *state, size_t len, const char *script, int err) {
    int always = !state || (argv[1] && !strcmp(argv[1], "cdi-hook"));
    if (!always && !state_has_sign(state, len)) exit(0);
    char why[PATH_MAX + 64];
    exec_failure(script, err, why, sizeof why);
    fprintf(stderr, "gpuhook-hook: cannot run the Python entry %s (%s): reinstall gpuhook, then run "
            "`gpuhook hook install`%s\n", script, why, always ? "" : "; this GPU container cannot start");
    exit(1);
}

static void fallback(char **argv, const char *state, size_t len, int rest) {
    char script[PATH_MAX];
    script_path(script, sizeof script);
    if (!getenv("GPUHOOK_SERVED_BY")) setenv("GPUHOOK_SERVED_BY", "in-process", 1);
    if (!state) {  /* --help, --version: stdin untouched */
        execv(script, argv);
        stranded(argv, NULL, 0, script, errno);
    }
    int fd = (int)syscall(SYS_memfd_create, "gpuhook-state", 0);
    if (fd < 0) fail("cannot keep the OCI state for the Python entry (memfd_create)", strerror(errno));
    write_all(fd, state, len);
    if (rest) {  /* the state was longer than the service takes: the rest of stdin follows, up to one byte past
                  * the Python hook's own bound (oci/bundle.MAX_DOCUMENT), so that it refuses it in its words */
        char chunk[65536];
        size_t total = len;
        while (total <= MAX_DOCUMENT) {
            ssize_t r = read(0, chunk, sizeof chunk);
            if (r < 0 && errno == EINTR) continue;
            if (r < 0) fail("cannot read the OCI state", strerror(errno));
            if (r == 0) break;
            write_all(fd, chunk, (size_t)r);
            total += (size_t)r;
        }
    }
    if (lseek(fd, 0, SEEK_SET) < 0 || dup2(fd, 0) < 0) fail("cannot hand the OCI state on", strerror(errno));
    close(fd);
    execv(script, argv);
    stranded(argv, state, len, script, errno);
}

/* $name in 1..limit-1 milliseconds, else `fallback_ms`. */
static int env_ms(const char *name, int fallback_ms, long limit) {
    const char *v = getenv(name);
    long t = v && *v ? strtol(v, NULL, 10) : fallback_ms;
    return t > 0 && t < limit ? (int)t : fallback_ms;
}

static int timeout_ms(void) { return env_ms("GPUHOOK_SERVICE_TIMEOUT_MS", DEFAULT_TIMEOUT_MS, 600000); }
static int ack_ms(void) { return env_ms("GPUHOOK_SERVICE_ACK_MS", DEFAULT_ACK_MS, 60001); }

/* One call to the service: where it is, how long it may take (`ms` once taken; `ack` until then), whose words a
 * failure is in (the hook's `gpuhook-hook: … the start fails`, or a command's `gpuhook: service PATH: …`,
 * service/client.ServiceFailed's), and what the Python entry needs when the call stays ours (argv, the state). */
struct call {
    const char *sock_path;
    int ms, ack, command, taken;
    long long deadline;
    char **argv;
    char *state;
    size_t len;
};

/* Where the service listens: $GPUHOOK_SERVICE_SOCKET when set and not empty, else the default. */
static const char *service_socket(void) {
    const char *path = getenv("GPUHOOK_SERVICE_SOCKET");
    return path && *path ? path : DEFAULT_SOCKET;
}

/* The call failed; `what` happened (a phrase: "closed without an answer"). Not taken yet (no GO sent): the
 * Python entry runs it here, told why. Taken: one line, exit 1, never a second run. */
static void lost(const struct call *c, const char *what) {
    if (!c->taken) {
        char why[512];
        snprintf(why, sizeof why, "in-process (service %s %s)", c->sock_path, what);
        setenv("GPUHOOK_SERVED_BY", why, 1);
        fallback(c->argv, c->state, c->len, 0);
    }
    if (c->command) fprintf(stderr, "gpuhook: service %s: %s\n", c->sock_path, what);
    else fprintf(stderr, "gpuhook-hook: service %s %s: the start fails\n", c->sock_path, what);
    exit(1);
}

/* lost(), `what` followed by ": " and strerror(err). */
static void lost_errno(const struct call *c, const char *what, int err) {
    char phrase[256];
    snprintf(phrase, sizeof phrase, "%s: %s", what, strerror(err));
    lost(c, phrase);
}

/* Wait until fd is ready for `events` or the call's deadline passes; exits with one line on the deadline. */
static void wait_for(int fd, short events, const struct call *c) {
    for (;;) {
        long long left = c->deadline - now_ms();
        if (left <= 0) {
            char phrase[64];
            snprintf(phrase, sizeof phrase, "gave no answer within %d ms", c->taken ? c->ms : c->ack);
            lost(c, phrase);
        }
        struct pollfd p = {.fd = fd, .events = events};
        int r = poll(&p, 1, (int)left);
        if (r > 0) return;
        if (r < 0 && errno != EINTR) fail("poll", strerror(errno));
    }
}

/* A socket connected to the service; on any failure (nothing listens, a full backlog for `ack` ms, a path too
 * long) the call stays ours: lost() runs the Python entry, nothing having been sent. */
static int connect_service(struct call *c) {
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    if (strlen(c->sock_path) >= sizeof addr.sun_path) lost(c, "has a path too long for a socket");
    strcpy(addr.sun_path, c->sock_path);
    int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (s < 0) lost_errno(c, "cannot be reached (socket)", errno);
    struct timeval tv = {.tv_sec = c->ack / 1000, .tv_usec = (c->ack % 1000) * 1000};
    setsockopt(s, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);  /* a full backlog: connect waits this long */
    if (connect(s, (struct sockaddr *)&addr, sizeof addr) == 0) return s;
    int err = errno;
    close(s);
    if (err == ENOENT || err == ECONNREFUSED) lost(c, "is not running");
    lost_errno(c, "cannot be reached", err);
    return -1;
}

/* The service's first 8 bytes: TAKING (then GO is sent and the call is the service's from here on, answered
 * within `ms`), or the start of an answer made without changing anything. Into first[8]; 1 when TAKING. */
static int first_frame(int s, unsigned char first[8], struct call *c) {
    size_t n = 0;
    while (n < 8) {
        wait_for(s, POLLIN, c);
        ssize_t r = recv(s, first + n, 8 - n, MSG_DONTWAIT);
        if (r < 0 && (errno == EINTR || errno == EAGAIN)) continue;
        if (r < 0) lost_errno(c, "failed before it took the call", errno);
        if (r == 0) lost(c, "closed without taking the call");
        n += (size_t)r;
    }
    if (be32(first) != TAKING || be32(first + 4) != 0) return 0;
    char go = GO;
    if (send(s, &go, 1, MSG_NOSIGNAL) != 1) lost(c, "went away before it took the call");
    c->taken = 1;  /* from here on the service owns it: never run again here */
    c->deadline = now_ms() + c->ms;
    return 1;
}

/* One buffer: u32 n (big-endian) | first[0..n) | rest[0..len): a request (the header, then the state) or a late
 * state (the state alone: protocol.encode_late_state). */
static char *frame(const char *first, size_t n, const char *rest, size_t len, size_t *total) {
    *total = 4 + n + len;
    char *msg = malloc(*total);
    if (!msg) fail("out of memory", NULL);
    uint32_t hl = (uint32_t)n;
    unsigned char be[4] = {hl >> 24, hl >> 16, hl >> 8, hl};
    memcpy(msg, be, 4);
    if (n) memcpy(msg + 4, first, n);
    if (len) memcpy(msg + 4 + n, rest, len);
    return msg;
}

/* All of msg to the service, pid_fd (when >= 0) over SCM_RIGHTS on the first message. A peer that closed
 * unread (EPIPE, ECONNRESET: returns 1, else 0) may still have answered: the caller reads on. */
static int send_request(int s, char *msg, size_t total, int pid_fd, const struct call *c) {
    int first = 1;
    for (size_t off = 0; off < total;) {
        wait_for(s, POLLOUT, c);
        struct iovec iov = {.iov_base = msg + off, .iov_len = total - off};
        struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1};
        char control[CMSG_SPACE(sizeof(int))];
        if (first && pid_fd >= 0) {
            memset(control, 0, sizeof control);
            mh.msg_control = control;
            mh.msg_controllen = sizeof control;
            struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
            cm->cmsg_level = SOL_SOCKET;
            cm->cmsg_type = SCM_RIGHTS;
            cm->cmsg_len = CMSG_LEN(sizeof(int));
            memcpy(CMSG_DATA(cm), &pid_fd, sizeof(int));
        }
        ssize_t w = sendmsg(s, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w < 0 && (errno == EINTR || errno == EAGAIN)) continue;
        if (w < 0 && (errno == EPIPE || errno == ECONNRESET)) return 1;  /* refused unread: its answer may wait */
        if (w < 0) lost_errno(c, "dropped the request", errno);
        first = 0;
        off += (size_t)w;
    }
    return 0;
}

/* The request could not be sent whole (send_request: the service closed its end). A service that refused it
 * unread answered DECLINED first: say so when that answer is there to read; either way the call stays ours. */
static void undelivered(int s, const struct call *c) {
    unsigned char ans[8];
    ssize_t r = recv(s, ans, sizeof ans, MSG_DONTWAIT | MSG_PEEK);
    if (r == (ssize_t)sizeof ans && be32(ans) == DECLINED && be32(ans + 4) == 0) lost(c, "declined the call");
    lost(c, "closed before it read the call");
}

/* Whether ans[0..n) is a whole answer already, by its lengths (a hook's: code, stderr; a command's: and its
 * stdout part): a child's answer is, before the connection ends (the service keeps a copy of the connection
 * until it reaps the child). A command's refusal comes without a stdout part and is whole at the end. */
static int whole(const unsigned char *ans, size_t n, int command) {
    if (n < 8 || be32(ans + 4) > MAX_ANSWER) return 0;
    size_t end = 8 + (size_t)be32(ans + 4);
    if (!command) return n >= end;
    return n >= end + 4 && be32(ans + end) <= MAX_OUTPUT && n >= end + 4 + be32(ans + end);
}

/* The whole answer, until the service closes or `bound` bytes came; *got is its length. A hook's answer is
 * complete once its stderr part is (the service closes after it anyway). Begins with first_frame()'s bytes
 * unless they were TAKING. */
static unsigned char *recv_answer(int s, size_t bound, size_t *got, struct call *c) {
    size_t cap = c->command ? 65536 : 8 + MAX_ANSWER, n = 0;
    unsigned char *ans = malloc(cap);
    if (!ans) fail("out of memory", NULL);
    if (!first_frame(s, ans, c)) n = 8;
    for (;;) {
        if (whole(ans, n, c->command)) break;
        if (n == cap) {
            if (cap >= bound) break;
            cap = cap * 2 > bound ? bound : cap * 2;
            ans = realloc(ans, cap);
            if (!ans) fail("out of memory", NULL);
        }
        wait_for(s, POLLIN, c);
        ssize_t r = recv(s, ans + n, cap - n, MSG_DONTWAIT);
        if (r < 0 && (errno == EINTR || errno == EAGAIN)) continue;
        if (r < 0 && errno == ECONNRESET) break;
        if (r < 0) lost_errno(c, "failed", errno);
        if (r == 0) break;
        n += (size_t)r;
    }
    *got = n;
    return ans;
}

/* The interpreter of the Python entry (its "#!" line's first word): the `exe` a command request names, which the
 * service compares with its own (a spec names the gpuhook beside it). 0 when it cannot be read. */
static int entry_interpreter(char *out, size_t size) {
    char script[PATH_MAX], line[SHEBANG_MAX + 1];
    script_path(script, sizeof script);
    int fd = open(script, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0;
    ssize_t n = read(fd, line, SHEBANG_MAX);
    close(fd);
    if (n < 3 || line[0] != '#' || line[1] != '!') return 0;
    line[n] = 0;
    size_t start = 2, end;
    while (line[start] == ' ' || line[start] == '\t') start++;
    for (end = start; line[end] && line[end] != ' ' && line[end] != '\t' && line[end] != '\n'; end++) {}
    if (end == start || line[start] != '/' || end - start >= size) return 0;
    memcpy(out, line + start, end - start);
    out[end - start] = 0;
    return 1;
}

/* Every byte of buf[0..n) to fd; 0 when the reader went away (a closed pipe: nothing more to say). */
static int relay(int fd, const unsigned char *buf, size_t n) {
    for (size_t off = 0; off < n;) {
        ssize_t w = write(fd, buf + off, n - off);
        if (w < 0 && errno == EINTR) continue;
        if (w < 0) return 0;
        off += (size_t)w;
    }
    return 1;
}

/* `ENTRY generate-cdi ARGS` through the service (the console script's request, service/client.ask), or the
 * Python entry when the service is not there or declines. */
static int command(int argc, char **argv) {
    char cwd[PATH_MAX], exe[SHEBANG_MAX];
    struct call c = {.sock_path = service_socket(), .ms = COMMAND_TIMEOUT_MS, .ack = ack_ms(), .command = 1,
                     .argv = argv};
    /* Nothing to say where the client is, or more than a header holds: the Python entry runs it in-process. */
    if (!getcwd(cwd, sizeof cwd) || !entry_interpreter(exe, sizeof exe)) fallback(argv, NULL, 0, 0);
    struct buf h = {0};
    put_argv(&h, argc, argv);
    put_str(&h, "], \"state\": 0, \"config_env\": null, \"pid_fd\": false, \"cwd\": ");
    put_json_string(&h, cwd);
    put_str(&h, ", \"exe\": ");
    put_json_string(&h, exe);
    put_str(&h, ", \"env\": [");
    const char *served[] = {"PATH", "CUDA_MPS_PIPE_DIRECTORY"};  /* protocol.SERVED_ENV */
    int n = 0;
    for (size_t i = 0; i < sizeof served / sizeof *served; i++) {
        const char *v = getenv(served[i]);
        if (!v) continue;
        char *entry = malloc(strlen(served[i]) + strlen(v) + 2);
        if (!entry) fail("out of memory", NULL);
        sprintf(entry, "%s=%s", served[i], v);
        if (n++) put_str(&h, ", ");
        put_json_string(&h, entry);
        free(entry);
    }
    put_str(&h, "]}");
    if (h.over) fallback(argv, NULL, 0, 0);
    c.deadline = now_ms() + c.ack;
    int s = connect_service(&c);
    size_t total, got;
    char *msg = frame(h.p, h.n, NULL, 0, &total);
    if (send_request(s, msg, total, -1, &c)) undelivered(s, &c);
    unsigned char *ans = recv_answer(s, 12 + MAX_ANSWER + MAX_OUTPUT, &got, &c);
    close(s);
    /* u32 code | u32 stderr length | stderr | u32 stdout length | stdout (protocol.decode_answer) */
    if (got < 8) lost(&c, "closed without an answer");
    uint32_t code = be32(ans), size = be32(ans + 4);
    size_t end = 8 + (size_t)size, out_size = 0;
    if (size > MAX_ANSWER || got < end) lost(&c, "sent a malformed answer");
    if (got > end) {
        if (got < end + 4) lost(&c, "sent a malformed answer");
        out_size = be32(ans + end);
        if (out_size > MAX_OUTPUT || got != end + 4 + out_size) lost(&c, "sent a malformed answer");
    }
    if (code == DECLINED && size == 0 && out_size == 0 && !c.taken) lost(&c, "declined the call");
    if (out_size) relay(1, ans + end + 4, out_size);
    if (size) relay(2, ans + 8, size);
    return code > 255 ? 1 : (int)code;
}

static int is_direct(int argc, char **argv) {
    if (argc < 2) return 0;
    return !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "--version");
}

/* The header's start up to the state's length: the version, our arguments and the client's GPUHOOK_CONFIG. */
static void put_hook_header(struct buf *h, int argc, char **argv, const char *state_len) {
    put_argv(h, argc, argv);
    put_str(h, "], \"state\": ");
    put_str(h, state_len);
    put_str(h, ", \"config_env\": ");
    const char *config_env = getenv("GPUHOOK_CONFIG");
    if (config_env && *config_env) put_json_string(h, config_env);
    else put(h, "null", 4);
}

/* The hook's answer on s, relayed: its stderr line and exit status. Until the service took the call (first_frame),
 * every failure, and DECLINED, runs the Python entry with the state (lost); once taken, a missing or malformed
 * answer is one line. */
static int hook_answer(int s, struct call *c) {
    size_t got;
    unsigned char *ans = recv_answer(s, 8 + MAX_ANSWER, &got, c);
    if (got < 8) lost(c, "closed without an answer");
    uint32_t code = be32(ans), size = be32(ans + 4);
    if (size > MAX_ANSWER || got < 8 + size) lost(c, "sent a malformed answer");
    if (code == DECLINED && size == 0 && !c->taken) {  /* nothing was done: the Python entry answers it */
        close(s);
        lost(c, "declined the call");
    }
    if (size) {
        fwrite(ans + 8, 1, size, stderr);
        if (ans[8 + size - 1] != '\n') fputc('\n', stderr);
    }
    return code > 255 ? 1 : (int)code;
}

/* A CDI spec's createContainer hook (`cdi-hook …`): connected and its header sent before stdin is read, the state
 * after it (protocol.py's `later`). runc runs such a hook from `runc init`, whose Go runtime writes the hook's
 * stdin only once its scheduler gets round to it (1-5 ms idle, measured under podman); meanwhile the service
 * parses the arguments and its child joins the container's namespace. A state over MAX_STATE is never sent:
 * the connection is closed (nothing can have been done without the state) and the Python entry reads all of it.
 * The wait for TAKING starts once the state is sent: the wait for stdin was the runtime's. */
static int cdi_hook(int argc, char **argv) {
    size_t len;
    int over;
    struct call c = {.sock_path = service_socket(), .ms = timeout_ms(), .ack = ack_ms(), .argv = argv};
    c.deadline = now_ms() + c.ack;
    int s = connect_service(&c);  /* not reached: the Python entry reads stdin itself (lost, no state yet) */
    struct buf h = {0};
    put_hook_header(&h, argc, argv, "0");
    put_str(&h, ", \"pid_fd\": false, \"later\": true}");
    if (h.over) fail("arguments are too long for the service", NULL);
    size_t total;
    char *msg = frame(h.p, h.n, NULL, 0, &total);
    int unsent = send_request(s, msg, total, -1, &c);
    char *state = read_state(&len, &over);
    c.state = state, c.len = len;
    if (over) {
        close(s);
        fallback(argv, state, len, 1);
    }
    if (unsent) undelivered(s, &c);
    char *part = frame(state, len, NULL, 0, &total);
    c.deadline = now_ms() + c.ack;  /* from here: the wait for stdin was the runtime's, not the service's */
    if (send_request(s, part, total, -1, &c)) undelivered(s, &c);
    return hook_answer(s, &c);
}

int main(int argc, char **argv) {
    if (is_direct(argc, argv)) fallback(argv, NULL, 0, 0), exit(1);
    if (argc >= 2 && !strcmp(argv[1], "generate-cdi")) return command(argc, argv);
    if (argc >= 2 && !strcmp(argv[1], "cdi-hook")) return cdi_hook(argc, argv);
    size_t len;
    int over;
    char *state = read_state(&len, &over);
    if (over) fallback(argv, state, len, 1);  /* nothing sent: the in-process hook reads and words it */
    struct call c = {.sock_path = service_socket(), .ms = timeout_ms(), .ack = ack_ms(), .argv = argv,
                     .state = state, .len = len};
    c.deadline = now_ms() + c.ack;
    int s = connect_service(&c);
    long pid = find_pid(state, len);
    int pid_fd = -1;
    if (pid > 0) {
        char proc[32];
        snprintf(proc, sizeof proc, "/proc/%ld", pid);
        pid_fd = open(proc, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    }
    struct buf h = {0};
    char num[32];
    snprintf(num, sizeof num, "%zu", len);
    put_hook_header(&h, argc, argv, num);
    put_str(&h, pid_fd >= 0 ? ", \"pid_fd\": true}" : ", \"pid_fd\": false}");
    if (h.over) fail("arguments are too long for the service", NULL);
    size_t total;
    char *msg = frame(h.p, h.n, state, len, &total);
    if (send_request(s, msg, total, pid_fd, &c)) undelivered(s, &c);
    if (pid_fd >= 0) close(pid_fd);
    return hook_answer(s, &c);
}
