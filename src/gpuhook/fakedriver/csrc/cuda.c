/* Mock libcuda.so.1 for gpuhook's simulated driver.
 *
 * It runs inside containers, so it looks at the caller's real /dev, never the
 * fake root: a GPU counts when /dev/nvidia<N> is a 195:N node the caller may
 * open (a device cgroup denial, EPERM/EACCES, hides it; ENXIO, the fake
 * node's usual answer, does not). FAKE_CUDA_VERSION is set at compile time.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#define API __attribute__((visibility("default")))

#ifndef FAKE_CUDA_VERSION
#error FAKE_CUDA_VERSION must be defined
#endif

typedef int CUresult;
typedef int CUdevice;
enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_NO_DEVICE = 100,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_UNKNOWN = 999,
};

static int g_initialized;
static int g_count;

static int usable_node(const char *path, unsigned maj, unsigned min)
{
    struct stat st;
    int fd;
    if (stat(path, &st) != 0 || !S_ISCHR(st.st_mode) || major(st.st_rdev) != maj || minor(st.st_rdev) != min)
        return 0;
    fd = open(path, O_RDWR | O_CLOEXEC | O_NONBLOCK);
    if (fd >= 0) {
        close(fd);
        return 1;
    }
    return errno != EPERM && errno != EACCES;
}

static int count_gpus(void)
{
    DIR *d = opendir("/dev");
    struct dirent *e;
    int n = 0;
    if (d == NULL)
        return 0;
    while ((e = readdir(d)) != NULL) {
        const char *digits = e->d_name + 6;
        char path[300];
        if (strncmp(e->d_name, "nvidia", 6) != 0 || *digits == '\0' || strspn(digits, "0123456789") != strlen(digits))
            continue;
        snprintf(path, sizeof path, "/dev/%s", e->d_name);
        if (usable_node(path, 195, (unsigned)atoi(digits)))
            n++;
    }
    closedir(d);
    return n;
}

API CUresult cuInit(unsigned int flags)
{
    if (flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (!usable_node("/dev/nvidiactl", 195, 255))
        return CUDA_ERROR_NO_DEVICE;
    g_count = count_gpus();
    if (g_count == 0)
        return CUDA_ERROR_NO_DEVICE;
    if (!usable_node("/dev/nvidia-uvm", 508, 0))
        return CUDA_ERROR_UNKNOWN; /* what CUDA reports without nvidia-uvm */
    g_initialized = 1;
    return CUDA_SUCCESS;
}

API CUresult cuDriverGetVersion(int *version)
{
    if (version == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    *version = FAKE_CUDA_VERSION;
    return CUDA_SUCCESS;
}

API CUresult cuDeviceGetCount(int *count)
{
    if (count == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    *count = g_count;
    return CUDA_SUCCESS;
}

API CUresult cuDeviceGet(CUdevice *device, int ordinal)
{
    if (device == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (ordinal < 0 || ordinal >= g_count)
        return CUDA_ERROR_INVALID_DEVICE;
    *device = ordinal;
    return CUDA_SUCCESS;
}

static const char *error_name(CUresult e)
{
    switch (e) {
    case CUDA_SUCCESS: return "CUDA_SUCCESS";
    case CUDA_ERROR_INVALID_VALUE: return "CUDA_ERROR_INVALID_VALUE";
    case CUDA_ERROR_NOT_INITIALIZED: return "CUDA_ERROR_NOT_INITIALIZED";
    case CUDA_ERROR_NO_DEVICE: return "CUDA_ERROR_NO_DEVICE";
    case CUDA_ERROR_INVALID_DEVICE: return "CUDA_ERROR_INVALID_DEVICE";
    case CUDA_ERROR_UNKNOWN: return "CUDA_ERROR_UNKNOWN";
    default: return NULL;
    }
}

static const char *error_string(CUresult e)
{
    switch (e) {
    case CUDA_SUCCESS: return "no error";
    case CUDA_ERROR_INVALID_VALUE: return "invalid argument";
    case CUDA_ERROR_NOT_INITIALIZED: return "initialization error";
    case CUDA_ERROR_NO_DEVICE: return "no CUDA-capable device is detected";
    case CUDA_ERROR_INVALID_DEVICE: return "invalid device ordinal";
    case CUDA_ERROR_UNKNOWN: return "unknown error";
    default: return NULL;
    }
}

API CUresult cuGetErrorName(CUresult error, const char **str)
{
    if (str == NULL || (*str = error_name(error)) == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    return CUDA_SUCCESS;
}

API CUresult cuGetErrorString(CUresult error, const char **str)
{
    if (str == NULL || (*str = error_string(error)) == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    return CUDA_SUCCESS;
}
