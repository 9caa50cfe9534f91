/* gpuhook's native hook entry: what `gpuhook hook install` writes at the hook path.
 *
 * It only forwards; Python stays the one implementation of every decision (issue 21). It reads the OCI state
 * from stdin (a state over MAX_STATE bytes goes to the Python entry, below, never to the service), connects to `gpuhook service` ($GPUHOOK_SERVICE_SOCKET, else
 * /run/gpuhook/service.sock), sends its arguments, $GPUHOOK_CONFIG and the state (service/protocol.py, with
 * an O_DIRECTORY fd of /proc/<pid> over SCM_RIGHTS when the state names a pid), and relays the answer: the
 * one stderr line and the exit status.
 *
 * When nothing listens (connect: ENOENT or ECONNREFUSED, nothing sent yet) it execs the Python entry beside it
 * (its own path + ".py", today's -IS script) with the same arguments and the same state on stdin (a memfd):
 * the same result as before the service existed. Once a request is sent it never falls back, so a container
 * is never injected twice; a service that does not answer within the timeout ($GPUHOOK_SERVICE_TIMEOUT_MS,
 * default 5000, below runc's default hook timeout) fails the start with one line.
 *
 * --help and --version go straight to the Python entry; so does a `cdi-hook …` call the service DECLINED (one only
 * click can word: help, a malformed option), since the service did nothing for it.
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
#define DECLINED 256 /* protocol.DECLINED: the service took nothing on; run the call in-process */

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

/* Growable buffer for the JSON header. */
struct buf { char *p; size_t n, cap; };

static void put(struct buf *b, const char *s, size_t n) {
    if (b->n + n > MAX_HEADER) fail("arguments are too long for the service", NULL);
    if (b->n + n > b->cap) {
        b->cap = (b->n + n) * 2;
        b->p = realloc(b->p, b->cap);
        if (!b->p) fail("out of memory", NULL);
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
}

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
static void fallback(char **argv, const char *state, size_t len, int rest) {
    char self[PATH_MAX - 4];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n < 0) fail("cannot find the Python entry (readlink /proc/self/exe)", strerror(errno));
    self[n] = 0;
    char script[PATH_MAX];
    snprintf(script, sizeof script, "%s.py", self);
    if (!state) {  /* --help, --version: stdin untouched */
        execv(script, argv);
        fail("cannot run the Python entry", strerror(errno));
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
    fprintf(stderr, "gpuhook-hook: service not running and cannot run %s: %s\n", script, strerror(errno));
    exit(1);
}

static int timeout_ms(void) {
    const char *v = getenv("GPUHOOK_SERVICE_TIMEOUT_MS");
    long t = v && *v ? strtol(v, NULL, 10) : DEFAULT_TIMEOUT_MS;
    return t > 0 && t < 600000 ? (int)t : DEFAULT_TIMEOUT_MS;
}

/* Wait until fd is ready for `events` or the deadline passes; exits with one line on the deadline. */
static void wait_for(int fd, short events, long long deadline, const char *sock_path, int ms) {
    for (;;) {
        long long left = deadline - now_ms();
        if (left <= 0) {
            fprintf(stderr, "gpuhook-hook: service %s gave no answer within %d ms: the start fails\n", sock_path, ms);
            exit(1);
        }
        struct pollfd p = {.fd = fd, .events = events};
        int r = poll(&p, 1, (int)left);
        if (r > 0) return;
        if (r < 0 && errno != EINTR) fail("poll", strerror(errno));
    }
}

static int is_direct(int argc, char **argv) {
    if (argc < 2) return 0;
    return !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "--version");
}

int main(int argc, char **argv) {
    if (is_direct(argc, argv)) fallback(argv, NULL, 0, 0), exit(1);
    size_t len;
    int over;
    char *state = read_state(&len, &over);
    if (over) fallback(argv, state, len, 1);  /* nothing sent: the in-process hook reads and words it */
    const char *sock_path = getenv("GPUHOOK_SERVICE_SOCKET");
    if (!sock_path || !*sock_path) sock_path = DEFAULT_SOCKET;
    int ms = timeout_ms();
    long long deadline = now_ms() + ms;

    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    if (strlen(sock_path) >= sizeof addr.sun_path) fail("service socket path is too long", sock_path);
    strcpy(addr.sun_path, sock_path);
    int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (s < 0) fail("socket", strerror(errno));
    struct timeval tv = {.tv_sec = ms / 1000, .tv_usec = (ms % 1000) * 1000};
    setsockopt(s, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);  /* a full backlog: connect waits this long */
    if (connect(s, (struct sockaddr *)&addr, sizeof addr) < 0) {
        if (errno == ENOENT || errno == ECONNREFUSED) {
            close(s);
            fallback(argv, state, len, 0);
        }
        fprintf(stderr, "gpuhook-hook: cannot reach the service at %s: %s\n", sock_path, strerror(errno));
        return 1;
    }
    /* From here on the request may reach the service: never fall back. */
    long pid = find_pid(state, len);
    int pid_fd = -1;
    if (pid > 0) {
        char proc[32];
        snprintf(proc, sizeof proc, "/proc/%ld", pid);
        pid_fd = open(proc, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    }
    struct buf h = {0};
    char num[64];
    put(&h, "{\"v\": 1, \"argv\": [", 18);
    for (int i = 1; i < argc; i++) {
        if (i > 1) put(&h, ", ", 2);
        put_json_string(&h, argv[i]);
    }
    snprintf(num, sizeof num, "], \"state\": %zu, \"config_env\": ", len);
    put(&h, num, strlen(num));
    const char *config_env = getenv("GPUHOOK_CONFIG");
    if (config_env && *config_env) put_json_string(&h, config_env);
    else put(&h, "null", 4);
    put(&h, pid_fd >= 0 ? ", \"pid_fd\": true}" : ", \"pid_fd\": false}", pid_fd >= 0 ? 17 : 18);

    size_t total = 4 + h.n + len;
    char *msg = malloc(total);
    if (!msg) fail("out of memory", NULL);
    uint32_t hl = (uint32_t)h.n;
    unsigned char be[4] = {hl >> 24, hl >> 16, hl >> 8, hl};
    memcpy(msg, be, 4);
    memcpy(msg + 4, h.p, h.n);
    if (len) memcpy(msg + 4 + h.n, state, len);

    size_t off = 0;
    int first = 1;
    while (off < total) {
        wait_for(s, POLLOUT, deadline, sock_path, ms);
        struct iovec iov = {.iov_base = msg + off, .iov_len = total - off};
        struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1};
        char control[CMSG_SPACE(sizeof(int))];
        if (first && pid_fd >= 0) {
            memset(control, 0, sizeof control);
            mh.msg_control = control;
            mh.msg_controllen = sizeof control;
            struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
            c->cmsg_level = SOL_SOCKET;
            c->cmsg_type = SCM_RIGHTS;
            c->cmsg_len = CMSG_LEN(sizeof(int));
            memcpy(CMSG_DATA(c), &pid_fd, sizeof(int));
        }
        ssize_t w = sendmsg(s, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w < 0 && (errno == EINTR || errno == EAGAIN)) continue;
        if (w < 0 && (errno == EPIPE || errno == ECONNRESET)) break;  /* refused unread: its answer may wait */
        if (w < 0) {
            fprintf(stderr, "gpuhook-hook: service %s dropped the request: %s: the start fails\n", sock_path,
                    strerror(errno));
            return 1;
        }
        first = 0;
        off += (size_t)w;
    }

    /* The answer: u32 code, u32 length, the stderr line; the service closes after it. */
    unsigned char *ans = malloc(8 + MAX_ANSWER);
    size_t got = 0;
    if (!ans) fail("out of memory", NULL);
    for (;;) {
        wait_for(s, POLLIN, deadline, sock_path, ms);
        ssize_t r = recv(s, ans + got, 8 + MAX_ANSWER - got, MSG_DONTWAIT);
        if (r < 0 && (errno == EINTR || errno == EAGAIN)) continue;
        if (r < 0 && errno == ECONNRESET) break;
        if (r < 0) {
            fprintf(stderr, "gpuhook-hook: service %s: %s: the start fails\n", sock_path, strerror(errno));
            return 1;
        }
        if (r == 0) break;
        got += (size_t)r;
        if (got >= 8 && be32(ans + 4) <= MAX_ANSWER && got >= 8 + be32(ans + 4)) break;
        if (got == 8 + MAX_ANSWER) break;
    }
    if (got < 8) {
        fprintf(stderr, "gpuhook-hook: service %s closed without an answer: the start fails\n", sock_path);
        return 1;
    }
    uint32_t code = be32(ans), size = be32(ans + 4);
    if (size > MAX_ANSWER || got < 8 + size) {
        fprintf(stderr, "gpuhook-hook: service %s sent a malformed answer: the start fails\n", sock_path);
        return 1;
    }
    if (code == DECLINED && size == 0) {  /* nothing was done: the Python entry answers it */
        close(s);
        fallback(argv, state, len, 0);
    }
    if (size) {
        fwrite(ans + 8, 1, size, stderr);
        if (ans[8 + size - 1] != '\n') fputc('\n', stderr);
    }
    return code > 255 ? 1 : (int)code;
}
