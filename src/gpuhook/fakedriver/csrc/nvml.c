/* Mock libnvidia-ml.so.1 for gpuhook's simulated driver.
 *
 * Serves the GPU table linked in from the generated table.c with the real
 * NVML ABI (struct layouts, versioned entry points, return codes), so that
 * pynvml runs its real code path. Compiled once per bitness and cached; the
 * table (including the fake root path) is linked in per fake driver.
 *
 * Driver presence: when <root>/dev/nvidiactl is a 195:255 node we are on the
 * fake's "host" and its /dev and /proc are used; otherwise (inside a
 * container) the real /dev is used, so only injected GPUs are visible, as
 * with the real library. Test control files live in <root>/run/fake-nvml/.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stddef.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <time.h>
#include <unistd.h>

#include "fakenvml.h"

#define API __attribute__((visibility("default")))

typedef int nvmlReturn_t;
enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NO_PERMISSION = 4,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_TIMEOUT = 10,
    NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18,
    NVML_ERROR_MEMORY = 20,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25,
    NVML_ERROR_UNKNOWN = 999,
};

#define NVIDIA_MAJOR 195
#define CTL_MINOR 255
#define RESERVED_BYTES (555ULL << 20)
#define EVENT_XID 0x8ULL
#define SUPPORTED_EVENTS 0x1FULL /* ECC single/double, PState, XID, clock */
#define NO_INSTANCE 0xFFFFFFFFu
#define HANDLE_MAGIC 0x4e564d4cu
#define EVSET_MAGIC 0x45565354u

struct dev {
    unsigned magic;
    int is_mig;
    unsigned row; /* row in fake_gpus or fake_migs */
};
typedef struct dev *nvmlDevice_t;

typedef struct {
    char busIdLegacy[16];
    unsigned domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;

typedef struct {
    unsigned long long total, free, used;
} nvmlMemory_t;

typedef struct {
    unsigned version;
    unsigned long long total, reserved, free, used;
} nvmlMemory_v2_t;

typedef struct {
    unsigned multiprocessorCount, sharedCopyEngineCount, sharedDecoderCount, sharedEncoderCount;
    unsigned sharedJpegCount, sharedOfaCount, gpuInstanceSliceCount, computeInstanceSliceCount;
    unsigned long long memorySizeMB;
} nvmlDeviceAttributes_t;

typedef struct {
    nvmlDevice_t device;
    unsigned long long eventType, eventData;
    unsigned gpuInstanceId, computeInstanceId;
} nvmlEventData_t;

struct evset {
    unsigned magic;
    pthread_mutex_t lock;
    long cursor;                           /* bytes of the xid file consumed */
    long start[FAKE_MAX_GPUS];             /* file size at registration, -1 = none */
    unsigned long long mask[FAKE_MAX_GPUS];
};
typedef struct evset *nvmlEventSet_t;

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static int g_refcount;
static int g_host_mode;
static unsigned g_visible[FAKE_MAX_GPUS]; /* visible index -> table row */
static unsigned g_nvisible;
static struct dev g_gpu_handles[FAKE_MAX_GPUS];
static struct dev g_mig_handles[FAKE_MAX_GPUS * FAKE_MAX_MIG_PER_GPU];

/* ---- helpers ------------------------------------------------------------ */

/* The driver root: where it was built, or GPUHOOK_FAKE_DRIVER_ROOT, where a container mounts it (a device
 * plugin's pod sees the node's driver root at /driver-root, not at the path the library was built for). */
static const char *root_dir(void)
{
    const char *moved = getenv("GPUHOOK_FAKE_DRIVER_ROOT");
    return moved != NULL && moved[0] == '/' ? moved : fake_root;
}

static void control_path(char *out, size_t n, const char *name)
{
    snprintf(out, n, "%s/run/fake-nvml/%s", root_dir(), name);
}

static int control_exists(const char *name)
{
    char p[PATH_MAX];
    control_path(p, sizeof p, name);
    return access(p, F_OK) == 0;
}

static int is_node(const char *path, unsigned maj, unsigned min)
{
    struct stat st;
    if (stat(path, &st) != 0 || !S_ISCHR(st.st_mode))
        return 0;
    return major(st.st_rdev) == maj && minor(st.st_rdev) == min;
}

static void dev_path(char *out, size_t n, const char *name)
{
    if (g_host_mode)
        snprintf(out, n, "%s/dev/%s", root_dir(), name);
    else
        snprintf(out, n, "/dev/%s", name);
}

static int initialized(void)
{
    int r;
    pthread_mutex_lock(&g_lock);
    r = g_refcount > 0;
    pthread_mutex_unlock(&g_lock);
    return r;
}

#define CHECK_INIT()                                                                              \
    do {                                                                                          \
        if (!initialized())                                                                       \
            return NVML_ERROR_UNINITIALIZED;                                                      \
    } while (0)

static nvmlReturn_t copy_str(const char *s, char *buf, unsigned len)
{
    if (buf == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(s) + 1 > len)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(buf, s, strlen(s) + 1);
    return NVML_SUCCESS;
}

static int gpu_lost(unsigned row)
{
    char name[32];
    snprintf(name, sizeof name, "lost-%u", fake_gpus[row].index);
    return control_exists(name);
}

/* Resolve a handle: exactly one of *gpu / *mig is set on success. */
static nvmlReturn_t resolve(nvmlDevice_t h, const struct fake_gpu **gpu, const struct fake_mig **mig)
{
    uintptr_t p = (uintptr_t)h;
    uintptr_t g0 = (uintptr_t)g_gpu_handles, m0 = (uintptr_t)g_mig_handles;
    *gpu = NULL;
    *mig = NULL;
    if (h == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (p >= g0 && p < g0 + sizeof g_gpu_handles && (p - g0) % sizeof(struct dev) == 0) {
        if (h->magic != HANDLE_MAGIC || h->row >= fake_gpu_count)
            return NVML_ERROR_INVALID_ARGUMENT;
        *gpu = &fake_gpus[h->row];
    } else if (p >= m0 && p < m0 + sizeof g_mig_handles && (p - m0) % sizeof(struct dev) == 0) {
        if (h->magic != HANDLE_MAGIC || h->row >= fake_mig_count)
            return NVML_ERROR_INVALID_ARGUMENT;
        *mig = &fake_migs[h->row];
    } else {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    return gpu_lost(*gpu ? (*gpu)->index : (*mig)->gpu) ? NVML_ERROR_GPU_IS_LOST : NVML_SUCCESS;
}

#define RESOLVE(h, g, m)                                                                          \
    const struct fake_gpu *g;                                                                     \
    const struct fake_mig *m;                                                                     \
    do {                                                                                          \
        nvmlReturn_t r_;                                                                          \
        CHECK_INIT();                                                                             \
        r_ = resolve((h), &g, &m);                                                                \
        if (r_ != NVML_SUCCESS)                                                                   \
            return r_;                                                                            \
    } while (0)

/* Calls that only a full GPU (not a MIG device) answers, as with the real library. */
#define RESOLVE_GPU(h, g)                                                                         \
    RESOLVE(h, g, mig_);                                                                          \
    if (g == NULL)                                                                                \
        return NVML_ERROR_NOT_SUPPORTED

static int visible_index(unsigned row)
{
    for (unsigned i = 0; i < g_nvisible; i++)
        if (g_visible[i] == row)
            return (int)i;
    return -1;
}

/* ---- init --------------------------------------------------------------- */

/* The kernel module's version must match the library's, as NVML checks. */
static nvmlReturn_t check_module_version(void)
{
    char p[PATH_MAX], line[512];
    FILE *f;
    snprintf(p, sizeof p, "%s/proc/driver/nvidia/version", root_dir());
    f = fopen(p, "re");
    if (f == NULL)
        return NVML_ERROR_DRIVER_NOT_LOADED;
    if (fgets(line, sizeof line, f) == NULL) {
        fclose(f);
        return NVML_ERROR_DRIVER_NOT_LOADED;
    }
    fclose(f);
    for (char *save = NULL, *tok = strtok_r(line, " \t\n", &save); tok; tok = strtok_r(NULL, " \t\n", &save)) {
        if (tok[0] >= '0' && tok[0] <= '9' && strchr(tok, '.') != NULL && strspn(tok, "0123456789.") == strlen(tok))
            return strcmp(tok, fake_driver_version) == 0 ? NVML_SUCCESS : NVML_ERROR_LIB_RM_VERSION_MISMATCH;
    }
    return NVML_ERROR_DRIVER_NOT_LOADED;
}

static nvmlReturn_t attach(void)
{
    char p[PATH_MAX];
    snprintf(p, sizeof p, "%s/dev/nvidiactl", root_dir());
    g_host_mode = is_node(p, NVIDIA_MAJOR, CTL_MINOR);
    if (g_host_mode) {
        nvmlReturn_t r = check_module_version();
        if (r != NVML_SUCCESS)
            return r;
    } else if (!is_node("/dev/nvidiactl", NVIDIA_MAJOR, CTL_MINOR)) {
        return NVML_ERROR_DRIVER_NOT_LOADED;
    }
    g_nvisible = 0;
    for (unsigned row = 0; row < fake_gpu_count && row < FAKE_MAX_GPUS; row++) {
        char name[32];
        snprintf(name, sizeof name, "nvidia%u", fake_gpus[row].minor);
        dev_path(p, sizeof p, name);
        if (is_node(p, NVIDIA_MAJOR, fake_gpus[row].minor))
            g_visible[g_nvisible++] = row;
        g_gpu_handles[row] = (struct dev){HANDLE_MAGIC, 0, row};
    }
    for (unsigned row = 0; row < fake_mig_count && row < FAKE_MAX_GPUS * FAKE_MAX_MIG_PER_GPU; row++)
        g_mig_handles[row] = (struct dev){HANDLE_MAGIC, 1, row};
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlInitWithFlags(unsigned int flags)
{
    nvmlReturn_t r = NVML_SUCCESS;
    (void)flags;
    pthread_mutex_lock(&g_lock);
    if (g_refcount == 0) {
        if (control_exists("fail-init"))
            r = NVML_ERROR_DRIVER_NOT_LOADED;
        else
            r = attach();
    }
    if (r == NVML_SUCCESS)
        g_refcount++;
    pthread_mutex_unlock(&g_lock);
    return r;
}

API nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
API nvmlReturn_t nvmlInit(void) { return nvmlInitWithFlags(0); }

API nvmlReturn_t nvmlShutdown(void)
{
    nvmlReturn_t r = NVML_SUCCESS;
    pthread_mutex_lock(&g_lock);
    if (g_refcount == 0)
        r = NVML_ERROR_UNINITIALIZED;
    else
        g_refcount--;
    pthread_mutex_unlock(&g_lock);
    return r;
}

API const char *nvmlErrorString(nvmlReturn_t result)
{
    switch (result) {
    case 0: return "Success";
    case 1: return "Uninitialized";
    case 2: return "Invalid Argument";
    case 3: return "Not Supported";
    case 4: return "Insufficient Permissions";
    case 5: return "Already Initialized";
    case 6: return "Not Found";
    case 7: return "Insufficient Size";
    case 8: return "Insufficient External Power";
    case 9: return "Driver Not Loaded";
    case 10: return "Timeout";
    case 11: return "Interrupt request issue";
    case 12: return "NVML Shared Library Not Found";
    case 13: return "Function Not Found";
    case 14: return "Corrupted infoROM";
    case 15: return "GPU is lost";
    case 16: return "GPU requires restart";
    case 17: return "The operating system has blocked the request.";
    case 18: return "RM has detected an NVML/RM version mismatch.";
    case 19: return "In use by another client";
    case 20: return "Insufficient Memory";
    case 21: return "No data";
    case 25: return "Argument version mismatch";
    case 26: return "Deprecated";
    case 27: return "Not Ready";
    default: return "Unknown Error";
    }
}

/* ---- system ------------------------------------------------------------- */

API nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length)
{
    CHECK_INIT();
    return copy_str(fake_driver_version, version, length);
}

API nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length)
{
    CHECK_INIT();
    return copy_str(fake_nvml_version, version, length);
}

API nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *v)
{
    CHECK_INIT();
    if (v == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    *v = fake_cuda_version;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *v) { return nvmlSystemGetCudaDriverVersion(v); }

/* ---- enumeration -------------------------------------------------------- */

API nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count)
{
    CHECK_INIT();
    if (count == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    *count = g_nvisible;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetCount(unsigned int *count) { return nvmlDeviceGetCount_v2(count); }

/* In a container a node the device cgroup denies cannot be opened. */
static nvmlReturn_t check_access(unsigned row)
{
    char p[PATH_MAX], name[32];
    int fd;
    if (g_host_mode)
        return NVML_SUCCESS; /* the fake's nodes have no driver behind them */
    snprintf(name, sizeof name, "nvidia%u", fake_gpus[row].minor);
    dev_path(p, sizeof p, name);
    fd = open(p, O_RDWR | O_CLOEXEC | O_NONBLOCK);
    if (fd >= 0) {
        close(fd);
        return NVML_SUCCESS;
    }
    return (errno == EPERM || errno == EACCES) ? NVML_ERROR_NO_PERMISSION : NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)
{
    unsigned row;
    nvmlReturn_t r;
    CHECK_INIT();
    if (device == NULL || index >= g_nvisible)
        return NVML_ERROR_INVALID_ARGUMENT;
    row = g_visible[index];
    if (gpu_lost(row))
        return NVML_ERROR_GPU_IS_LOST;
    r = check_access(row);
    if (r != NVML_SUCCESS)
        return r;
    *device = &g_gpu_handles[row];
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device)
{
    return nvmlDeviceGetHandleByIndex_v2(index, device);
}

static nvmlReturn_t found(nvmlDevice_t h, unsigned gpu_row, nvmlDevice_t *out)
{
    if (gpu_lost(gpu_row))
        return NVML_ERROR_GPU_IS_LOST;
    *out = h;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device)
{
    CHECK_INIT();
    if (uuid == NULL || device == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    for (unsigned i = 0; i < g_nvisible; i++) {
        const struct fake_gpu *g = &fake_gpus[g_visible[i]];
        if (strcmp(g->uuid, uuid) == 0)
            return found(&g_gpu_handles[g_visible[i]], g->index, device);
        for (unsigned k = 0; g->mig_enabled && k < g->mig_count; k++)
            if (strcmp(fake_migs[g->mig_first + k].uuid, uuid) == 0)
                return found(&g_mig_handles[g->mig_first + k], g->index, device);
    }
    return NVML_ERROR_NOT_FOUND;
}

/* Accepts domain:bus:device.function, domain:bus:device and bus:device.function (hex). */
static int parse_bus_id(const char *s, unsigned *dom, unsigned *bus, unsigned *dev)
{
    unsigned a, b, c, d;
    char tail;
    if (sscanf(s, "%x:%x:%x.%x%c", &a, &b, &c, &d, &tail) == 4) {
        *dom = a, *bus = b, *dev = c;
        return d == 0;
    }
    if (sscanf(s, "%x:%x:%x%c", &a, &b, &c, &tail) == 3) {
        *dom = a, *bus = b, *dev = c;
        return 1;
    }
    if (sscanf(s, "%x:%x.%x%c", &a, &b, &c, &tail) == 3) {
        *dom = 0, *bus = a, *dev = b;
        return c == 0;
    }
    return -1;
}

API nvmlReturn_t nvmlDeviceGetHandleByPciBusId_v2(const char *pciBusId, nvmlDevice_t *device)
{
    unsigned dom, bus, dev;
    int ok;
    CHECK_INIT();
    if (pciBusId == NULL || device == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    ok = parse_bus_id(pciBusId, &dom, &bus, &dev);
    if (ok < 0)
        return NVML_ERROR_INVALID_ARGUMENT;
    for (unsigned i = 0; ok && i < g_nvisible; i++) {
        const struct fake_gpu *g = &fake_gpus[g_visible[i]];
        if (g->domain == dom && g->bus == bus && g->device == dev)
            return found(&g_gpu_handles[g_visible[i]], g->index, device);
    }
    return NVML_ERROR_NOT_FOUND;
}

API nvmlReturn_t nvmlDeviceGetHandleByPciBusId(const char *pciBusId, nvmlDevice_t *device)
{
    return nvmlDeviceGetHandleByPciBusId_v2(pciBusId, device);
}

/* ---- device queries ----------------------------------------------------- */

API nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index)
{
    RESOLVE_GPU(device, g);
    if (index == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    *index = (unsigned)visible_index(g->index);
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length)
{
    RESOLVE(device, g, m);
    return copy_str(g ? g->uuid : m->uuid, uuid, length);
}

API nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length)
{
    RESOLVE(device, g, m);
    return copy_str(g ? g->name : m->name, name, length);
}

API nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t device, unsigned int *minor_number)
{
    RESOLVE_GPU(device, g);
    if (minor_number == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    *minor_number = g->minor;
    return NVML_SUCCESS;
}

/* NVML's two spellings of a PCI address (legacy 4-digit domain and 8-digit), and its parts. */
static void fill_pci(nvmlPciInfo_t *pci, unsigned domain, unsigned bus, unsigned device, unsigned function)
{
    memset(pci, 0, sizeof *pci);
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "%04X:%02X:%02X.%X", domain, bus, device, function);
    snprintf(pci->busId, sizeof pci->busId, "%08X:%02X:%02X.%X", domain, bus, device, function);
    pci->domain = domain;
    pci->bus = bus;
    pci->device = device;
}

API nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci)
{
    RESOLVE_GPU(device, g);
    if (pci == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    fill_pci(pci, g->domain, g->bus, g->device, g->function);
    pci->pciDeviceId = g->pci_device_id;
    pci->pciSubSystemId = g->pci_subsystem_id;
    return NVML_SUCCESS;
}

/* The unversioned (v1) entry point, which libnvidia-container still calls: the v1 struct is v3's first 36 bytes
 * (legacy bus id and the numbers) followed by four reserved words, without v3's 32-byte busId. */
API nvmlReturn_t nvmlDeviceGetPciInfo(nvmlDevice_t device, nvmlPciInfo_t *pci)
{
    nvmlPciInfo_t full;
    nvmlReturn_t r;
    if (pci == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    r = nvmlDeviceGetPciInfo_v3(device, &full);
    if (r != NVML_SUCCESS)
        return r;
    memset(pci, 0, offsetof(nvmlPciInfo_t, busId) + 4 * sizeof(unsigned));
    memcpy(pci, &full, offsetof(nvmlPciInfo_t, busId));
    return NVML_SUCCESS;
}

static unsigned long long total_bytes(const struct fake_gpu *g, const struct fake_mig *m)
{
    return g ? g->memory_bytes : m->memory_bytes;
}

API nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory)
{
    unsigned long long reserved;
    RESOLVE(device, g, m);
    if (memory == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    reserved = g ? RESERVED_BYTES : 0;
    memory->total = total_bytes(g, m);
    memory->used = reserved;
    memory->free = memory->total - reserved;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory)
{
    unsigned long long reserved;
    RESOLVE(device, g, m);
    if (memory == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (memory->version != (unsigned)(sizeof(nvmlMemory_v2_t) | (2u << 24)))
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    reserved = g ? RESERVED_BYTES : 0;
    memory->total = total_bytes(g, m);
    memory->reserved = reserved;
    memory->used = 0;
    memory->free = memory->total - reserved;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t device, int *major_, int *minor_)
{
    RESOLVE_GPU(device, g);
    if (major_ == NULL || minor_ == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    *major_ = g->cc_major;
    *minor_ = g->cc_minor;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetBrand(nvmlDevice_t device, int *type)
{
    RESOLVE_GPU(device, g);
    if (type == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    *type = g->brand;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetArchitecture(nvmlDevice_t device, unsigned int *arch)
{
    RESOLVE_GPU(device, g);
    if (arch == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    *arch = (unsigned)g->arch;
    return NVML_SUCCESS;
}

/* Compute mode, kept per GPU in the control file compute-mode-<index> (absent: 0, DEFAULT); with the control
 * file compute-mode-denied, setting it answers NO_PERMISSION (as for a caller without root). */
API nvmlReturn_t nvmlDeviceGetComputeMode(nvmlDevice_t device, int *mode)
{
    RESOLVE_GPU(device, g);
    if (mode == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    char name[64], p[PATH_MAX];
    snprintf(name, sizeof name, "compute-mode-%u", g->index);
    control_path(p, sizeof p, name);
    *mode = 0;
    FILE *f = fopen(p, "r");
    if (f != NULL) {
        if (fscanf(f, "%d", mode) != 1)
            *mode = 0;
        fclose(f);
    }
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceSetComputeMode(nvmlDevice_t device, int mode)
{
    RESOLVE_GPU(device, g);
    if (mode < 0 || mode > 3 || mode == 1)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (control_exists("compute-mode-denied"))
        return NVML_ERROR_NO_PERMISSION;
    char name[64], p[PATH_MAX];
    snprintf(name, sizeof name, "compute-mode-%u", g->index);
    control_path(p, sizeof p, name);
    FILE *f = fopen(p, "w");
    if (f == NULL)
        return NVML_ERROR_UNKNOWN;
    fprintf(f, "%d\n", mode);
    fclose(f);
    return NVML_SUCCESS;
}

/* Only where GPU memory is itself a NUMA node (Grace Hopper); an x86 H100 says no.
 * The GPU's CPU-side NUMA node comes from sysfs or nvmlDeviceGetMemoryAffinity. */
API nvmlReturn_t nvmlDeviceGetNumaNodeId(nvmlDevice_t device, unsigned int *node)
{
    RESOLVE_GPU(device, g);
    (void)g;
    if (node == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    return NVML_ERROR_NOT_SUPPORTED;
}

API nvmlReturn_t nvmlDeviceGetMemoryAffinity(nvmlDevice_t device, unsigned int nodeSetSize,
                                             unsigned long *nodeSet, int scope)
{
    const unsigned bits = 8 * sizeof(unsigned long);
    RESOLVE_GPU(device, g);
    if (nodeSet == NULL || nodeSetSize == 0 || (scope != 0 && scope != 1))
        return NVML_ERROR_INVALID_ARGUMENT;
    memset(nodeSet, 0, nodeSetSize * sizeof *nodeSet);
    if (g->numa_node >= 0 && (unsigned)g->numa_node / bits < nodeSetSize)
        nodeSet[g->numa_node / bits] = 1UL << (g->numa_node % bits);
    return NVML_SUCCESS;
}

/* ---- NVLink and the PCI tree -------------------------------------------- */

/* A GPU without NVLink says NOT_SUPPORTED; a link number past the hardware's is INVALID_ARGUMENT;
 * links the layout does not connect are inactive. */
static nvmlReturn_t nvlink_row(const struct fake_gpu *g, unsigned link, const struct fake_nvlink **out)
{
    *out = NULL;
    if (fake_nvlink_count[g->index] == 0)
        return NVML_ERROR_NOT_SUPPORTED;
    if (link >= FAKE_NVLINK_MAX_LINKS)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (link < fake_nvlink_count[g->index])
        *out = &fake_nvlinks[fake_nvlink_first[g->index] + link];
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t device, unsigned int link, unsigned int *is_active)
{
    const struct fake_nvlink *l;
    nvmlReturn_t r;
    RESOLVE_GPU(device, g);
    if (is_active == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    r = nvlink_row(g, link, &l);
    if (r != NVML_SUCCESS)
        return r;
    *is_active = l != NULL;
    return NVML_SUCCESS;
}

static nvmlReturn_t active_link(nvmlDevice_t device, unsigned link, const struct fake_nvlink **out)
{
    const struct fake_gpu *g;
    const struct fake_mig *m;
    nvmlReturn_t r;
    CHECK_INIT();
    r = resolve(device, &g, &m);
    if (r != NVML_SUCCESS)
        return r;
    if (g == NULL)
        return NVML_ERROR_NOT_SUPPORTED;
    r = nvlink_row(g, link, out);
    if (r == NVML_SUCCESS && *out == NULL)
        return NVML_ERROR_INVALID_ARGUMENT; /* an inactive link has no far end */
    return r;
}

API nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo_v2(nvmlDevice_t device, unsigned int link, nvmlPciInfo_t *pci)
{
    const struct fake_nvlink *l;
    nvmlReturn_t r;
    if (pci == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    r = active_link(device, link, &l);
    if (r != NVML_SUCCESS)
        return r;
    fill_pci(pci, l->domain, l->bus, l->device, l->function);
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo(nvmlDevice_t device, unsigned int link, nvmlPciInfo_t *pci)
{
    return nvmlDeviceGetNvLinkRemotePciInfo_v2(device, link, pci);
}

API nvmlReturn_t nvmlDeviceGetNvLinkRemoteDeviceType(nvmlDevice_t device, unsigned int link, int *type)
{
    const struct fake_nvlink *l;
    nvmlReturn_t r;
    if (type == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    r = active_link(device, link, &l);
    if (r != NVML_SUCCESS)
        return r;
    *type = l->remote_type;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetTopologyCommonAncestor(nvmlDevice_t device1, nvmlDevice_t device2, int *level)
{
    const struct fake_gpu *b;
    const struct fake_mig *m;
    nvmlReturn_t r;
    RESOLVE_GPU(device1, a);
    if (level == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    r = resolve(device2, &b, &m);
    if (r != NVML_SUCCESS)
        return r;
    if (b == NULL)
        return NVML_ERROR_NOT_SUPPORTED;
    *level = fake_topology[a->index][b->index];
    return NVML_SUCCESS;
}

/* Whether an NVLink joins two GPUs: directly, or through NVSwitches both reach. */
static int nvlinked(const struct fake_gpu *a, const struct fake_gpu *b)
{
    for (unsigned i = 0; i < fake_nvlink_count[a->index]; i++) {
        const struct fake_nvlink *l = &fake_nvlinks[fake_nvlink_first[a->index] + i];
        if (l->remote_type == 0 && l->domain == b->domain && l->bus == b->bus && l->device == b->device)
            return 1;
        if (l->remote_type == 2)
            for (unsigned k = 0; k < fake_nvlink_count[b->index]; k++) {
                const struct fake_nvlink *o = &fake_nvlinks[fake_nvlink_first[b->index] + k];
                if (o->remote_type == 2 && o->domain == l->domain && o->bus == l->bus && o->device == l->device)
                    return 1;
            }
    }
    return 0;
}

/* nvmlGpuP2PStatus_t: OK 0, NOT_SUPPORTED 5. Index 2 (NVLINK) needs an NVLink; the others go over PCIe. */
API nvmlReturn_t nvmlDeviceGetP2PStatus(nvmlDevice_t device1, nvmlDevice_t device2, int index, int *status)
{
    const struct fake_gpu *b;
    const struct fake_mig *m;
    nvmlReturn_t r;
    RESOLVE_GPU(device1, a);
    if (status == NULL || index < 0 || index > 5)
        return NVML_ERROR_INVALID_ARGUMENT;
    r = resolve(device2, &b, &m);
    if (r != NVML_SUCCESS)
        return r;
    if (b == NULL)
        return NVML_ERROR_NOT_SUPPORTED;
    *status = (index == 2 && !nvlinked(a, b)) || index == 5 ? 5 : 0;
    return NVML_SUCCESS;
}

/* ---- MIG ---------------------------------------------------------------- */

API nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *current, unsigned int *pending)
{
    RESOLVE_GPU(device, g);
    if (current == NULL || pending == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    *current = *pending = g->mig_enabled ? 1 : 0;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t device, unsigned int *count)
{
    RESOLVE_GPU(device, g);
    if (count == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    *count = g->mig_enabled ? FAKE_MAX_MIG_PER_GPU : 0;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t device, unsigned int index,
                                                     nvmlDevice_t *mig_device)
{
    RESOLVE(device, g, m);
    if (m != NULL || mig_device == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (!g->mig_enabled)
        return NVML_ERROR_NOT_SUPPORTED;
    if (index >= FAKE_MAX_MIG_PER_GPU)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (index >= g->mig_count)
        return NVML_ERROR_NOT_FOUND;
    *mig_device = &g_mig_handles[g->mig_first + index];
    return NVML_SUCCESS;
}

/* GPU instances, as far as discovery asks: a handle by GI id and its info (profile id, placement). */
typedef struct {
    unsigned start, size;
} nvmlGpuInstancePlacement_t;

typedef struct {
    nvmlDevice_t device;
    unsigned id, profileId;
    nvmlGpuInstancePlacement_t placement;
} nvmlGpuInstanceInfo_t;

static struct dev g_gi_handles[FAKE_MAX_GPUS * FAKE_MAX_MIG_PER_GPU];

API nvmlReturn_t nvmlDeviceGetGpuInstanceById(nvmlDevice_t device, unsigned int id, struct dev **gpu_instance)
{
    RESOLVE(device, g, m);
    if (m != NULL || gpu_instance == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (!g->mig_enabled)
        return NVML_ERROR_NOT_SUPPORTED;
    for (unsigned i = 0; i < g->mig_count; i++) {
        unsigned row = g->mig_first + i;
        if (fake_migs[row].gi == id) {
            g_gi_handles[row].magic = HANDLE_MAGIC;
            g_gi_handles[row].is_mig = 1;
            g_gi_handles[row].row = row;
            *gpu_instance = &g_gi_handles[row];
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_FOUND;
}

API nvmlReturn_t nvmlGpuInstanceGetInfo(struct dev *gpu_instance, nvmlGpuInstanceInfo_t *info)
{
    uintptr_t p = (uintptr_t)gpu_instance, g0 = (uintptr_t)g_gi_handles;
    CHECK_INIT();
    if (info == NULL || p < g0 || p >= g0 + sizeof g_gi_handles || (p - g0) % sizeof(struct dev) != 0 ||
        gpu_instance->magic != HANDLE_MAGIC || gpu_instance->row >= fake_mig_count)
        return NVML_ERROR_INVALID_ARGUMENT;
    const struct fake_mig *m = &fake_migs[gpu_instance->row];
    info->device = &g_gpu_handles[m->gpu];
    info->id = m->gi;
    info->profileId = m->profile_id;
    info->placement.start = m->placement_start;
    info->placement.size = m->placement_size;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceIsMigDeviceHandle(nvmlDevice_t device, unsigned int *is_mig)
{
    RESOLVE(device, g, m);
    (void)g;
    if (is_mig == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    *is_mig = m != NULL;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetGpuInstanceId(nvmlDevice_t device, unsigned int *id)
{
    RESOLVE(device, g, m);
    (void)g;
    if (id == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (m == NULL)
        return NVML_ERROR_NOT_SUPPORTED;
    *id = m->gi;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetComputeInstanceId(nvmlDevice_t device, unsigned int *id)
{
    RESOLVE(device, g, m);
    (void)g;
    if (id == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (m == NULL)
        return NVML_ERROR_NOT_SUPPORTED;
    *id = m->ci;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetDeviceHandleFromMigDeviceHandle(nvmlDevice_t mig_device, nvmlDevice_t *device)
{
    RESOLVE(mig_device, g, m);
    (void)g;
    if (m == NULL || device == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    *device = &g_gpu_handles[m->gpu];
    return NVML_SUCCESS;
}

/* The real API answers MIG device handles only. */
API nvmlReturn_t nvmlDeviceGetAttributes_v2(nvmlDevice_t device, nvmlDeviceAttributes_t *attrs)
{
    RESOLVE(device, g, m);
    (void)g;
    if (attrs == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (m == NULL)
        return NVML_ERROR_NOT_SUPPORTED;
    attrs->multiprocessorCount = m->sm_count;
    attrs->sharedCopyEngineCount = m->ce_count;
    attrs->sharedDecoderCount = m->dec_count;
    attrs->sharedEncoderCount = m->enc_count;
    attrs->sharedJpegCount = m->jpg_count;
    attrs->sharedOfaCount = m->ofa_count;
    attrs->gpuInstanceSliceCount = m->gi_slices;
    attrs->computeInstanceSliceCount = m->ci_slices;
    attrs->memorySizeMB = m->memory_bytes >> 20;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetAttributes(nvmlDevice_t device, nvmlDeviceAttributes_t *attrs)
{
    return nvmlDeviceGetAttributes_v2(device, attrs);
}

/* ---- events ------------------------------------------------------------- */

static long xid_file_size(void)
{
    char p[PATH_MAX];
    struct stat st;
    control_path(p, sizeof p, "xid");
    return stat(p, &st) == 0 ? (long)st.st_size : 0;
}

static nvmlReturn_t check_set(nvmlEventSet_t set)
{
    return (set != NULL && set->magic == EVSET_MAGIC) ? NVML_SUCCESS : NVML_ERROR_INVALID_ARGUMENT;
}

API nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set)
{
    struct evset *s;
    CHECK_INIT();
    if (set == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    s = calloc(1, sizeof *s);
    if (s == NULL)
        return NVML_ERROR_MEMORY;
    s->magic = EVSET_MAGIC;
    pthread_mutex_init(&s->lock, NULL);
    s->cursor = xid_file_size();
    for (unsigned i = 0; i < FAKE_MAX_GPUS; i++)
        s->start[i] = -1;
    *set = s;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set)
{
    CHECK_INIT();
    if (check_set(set) != NVML_SUCCESS)
        return NVML_ERROR_INVALID_ARGUMENT;
    set->magic = 0;
    pthread_mutex_destroy(&set->lock);
    free(set);
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t device, unsigned long long *types)
{
    RESOLVE_GPU(device, g);
    (void)g;
    if (types == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    *types = SUPPORTED_EVENTS;
    return NVML_SUCCESS;
}

/* Tests wait for this line before writing an XID: events before registration are lost. */
static void log_registration(unsigned gpu_index, unsigned long long types)
{
    char p[PATH_MAX];
    FILE *f;
    control_path(p, sizeof p, "registrations");
    f = fopen(p, "ae");
    if (f == NULL)
        return;
    fprintf(f, "%d %u 0x%llx\n", (int)getpid(), gpu_index, types);
    fclose(f);
}

API nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long types, nvmlEventSet_t set)
{
    RESOLVE_GPU(device, g);
    if (check_set(set) != NVML_SUCCESS)
        return NVML_ERROR_INVALID_ARGUMENT;
    if ((types & ~SUPPORTED_EVENTS) != 0)
        return NVML_ERROR_NOT_SUPPORTED;
    pthread_mutex_lock(&set->lock);
    if (set->start[g->index] < 0)
        set->start[g->index] = xid_file_size();
    set->mask[g->index] |= types;
    pthread_mutex_unlock(&set->lock);
    log_registration(g->index, types);
    return NVML_SUCCESS;
}

/* Fill *data from the next deliverable line of the xid file; 1 when one was found. */
static int next_xid(struct evset *s, nvmlEventData_t *data)
{
    char p[PATH_MAX], *line = NULL;
    size_t cap = 0;
    ssize_t n;
    int hit = 0;
    FILE *f;
    control_path(p, sizeof p, "xid");
    f = fopen(p, "re");
    if (f == NULL)
        return 0;
    if (xid_file_size() < s->cursor) { /* truncated: start over */
        s->cursor = 0;
        for (unsigned i = 0; i < FAKE_MAX_GPUS; i++)
            if (s->start[i] > 0)
                s->start[i] = 0;
    }
    fseek(f, s->cursor, SEEK_SET);
    while (!hit && (n = getline(&line, &cap, f)) > 0 && line[n - 1] == '\n') {
        long at = s->cursor;
        unsigned idx, gi = NO_INSTANCE, ci = NO_INSTANCE;
        unsigned long long xid;
        int vis;
        s->cursor += n;
        if (sscanf(line, "%u %llu %u %u", &idx, &xid, &gi, &ci) < 2 || idx >= fake_gpu_count)
            continue;
        if (s->start[idx] < 0 || at < s->start[idx] || !(s->mask[idx] & EVENT_XID))
            continue;
        vis = visible_index(idx);
        if (vis < 0)
            continue;
        data->device = &g_gpu_handles[idx];
        data->eventType = EVENT_XID;
        data->eventData = xid;
        data->gpuInstanceId = gi;
        data->computeInstanceId = ci;
        hit = 1;
    }
    free(line);
    fclose(f);
    return hit;
}

static int registered_lost(struct evset *s)
{
    for (unsigned i = 0; i < fake_gpu_count && i < FAKE_MAX_GPUS; i++)
        if (s->start[i] >= 0 && gpu_lost(i))
            return 1;
    return 0;
}

static long long now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

API nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms)
{
    long long deadline = now_ms() + timeoutms;
    CHECK_INIT();
    if (check_set(set) != NVML_SUCCESS || data == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (control_exists("wait-at-once")) { /* a driver whose wait does not block: counted, answered at once */
        char p[PATH_MAX];
        FILE *f;
        control_path(p, sizeof p, "wait-calls");
        if ((f = fopen(p, "ae")) != NULL) {
            fputc('w', f);
            fclose(f);
        }
        return NVML_ERROR_TIMEOUT;
    }
    for (;;) {
        int hit, lost;
        long long left;
        pthread_mutex_lock(&set->lock);
        hit = next_xid(set, data);
        lost = !hit && registered_lost(set);
        pthread_mutex_unlock(&set->lock);
        if (hit)
            return NVML_SUCCESS;
        if (lost)
            return NVML_ERROR_GPU_IS_LOST;
        left = deadline - now_ms();
        if (left <= 0)
            return NVML_ERROR_TIMEOUT;
        if (left > 10)
            left = 10;
        nanosleep(&(struct timespec){0, (long)left * 1000000L}, NULL);
    }
}

API nvmlReturn_t nvmlEventSetWait(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms)
{
    return nvmlEventSetWait_v2(set, data, timeoutms);
}
