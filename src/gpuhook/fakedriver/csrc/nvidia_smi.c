/* Mock nvidia-smi: like the real one it dlopens libnvidia-ml.so.1 through the
 * dynamic loader (so inside a container it needs the injected library and a
 * fresh ld cache) and lists what NVML shows it. Modes: --version, -L, none. */
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

#ifndef FAKE_DRIVER_VERSION
#error FAKE_DRIVER_VERSION must be defined
#endif

typedef void *dev_t_;
typedef int (*init_fn)(void);
typedef const char *(*errstr_fn)(int);
typedef int (*strget_fn)(char *, unsigned);
typedef int (*intget_fn)(int *);
typedef int (*count_fn)(unsigned *);
typedef int (*byidx_fn)(unsigned, dev_t_ *);
typedef int (*devstr_fn)(dev_t_, char *, unsigned);
typedef int (*devuint_fn)(dev_t_, unsigned *);
typedef int (*migmode_fn)(dev_t_, unsigned *, unsigned *);
typedef int (*migidx_fn)(dev_t_, unsigned, dev_t_ *);

static void *sym(void *lib, const char *name)
{
    void *p = dlsym(lib, name);
    if (p == NULL) {
        printf("Failed to resolve %s in libnvidia-ml.so.1\n", name);
    }
    return p;
}

static void list_mig(void *lib, dev_t_ gpu)
{
    migmode_fn mode = (migmode_fn)sym(lib, "nvmlDeviceGetMigMode");
    devuint_fn maxc = (devuint_fn)sym(lib, "nvmlDeviceGetMaxMigDeviceCount");
    migidx_fn byidx = (migidx_fn)sym(lib, "nvmlDeviceGetMigDeviceHandleByIndex");
    devstr_fn uuid = (devstr_fn)sym(lib, "nvmlDeviceGetUUID");
    devstr_fn name = (devstr_fn)sym(lib, "nvmlDeviceGetName");
    unsigned cur = 0, pend = 0, max = 0, shown = 0;
    if (!mode || !maxc || !byidx || !uuid || !name || mode(gpu, &cur, &pend) != 0 || !cur || maxc(gpu, &max) != 0)
        return;
    for (unsigned i = 0; i < max; i++) {
        dev_t_ m;
        char u[96], n[96];
        const char *profile;
        if (byidx(gpu, i, &m) != 0 || uuid(m, u, sizeof u) != 0 || name(m, n, sizeof n) != 0)
            continue;
        profile = strstr(n, " MIG ");
        printf("  MIG %-11s Device %2u: (UUID: %s)\n", profile ? profile + 5 : n, shown++, u);
    }
}

static int list(void *lib)
{
    count_fn count = (count_fn)sym(lib, "nvmlDeviceGetCount_v2");
    byidx_fn byidx = (byidx_fn)sym(lib, "nvmlDeviceGetHandleByIndex_v2");
    devstr_fn uuid = (devstr_fn)sym(lib, "nvmlDeviceGetUUID");
    devstr_fn name = (devstr_fn)sym(lib, "nvmlDeviceGetName");
    unsigned n = 0;
    if (!count || !byidx || !uuid || !name || count(&n) != 0)
        return 999;
    if (n == 0) {
        printf("No devices were found\n");
        return 6;
    }
    for (unsigned i = 0; i < n; i++) {
        dev_t_ d;
        char u[96], nm[96];
        if (byidx(i, &d) != 0 || uuid(d, u, sizeof u) != 0 || name(d, nm, sizeof nm) != 0) {
            printf("Unable to determine the device handle for GPU%u: Unknown Error\n", i);
            continue;
        }
        printf("GPU %u: %s (UUID: %s)\n", i, nm, u);
        list_mig(lib, d);
    }
    return 0;
}

static int versions(void *lib, int header)
{
    strget_fn drv = (strget_fn)sym(lib, "nvmlSystemGetDriverVersion");
    strget_fn nvml = (strget_fn)sym(lib, "nvmlSystemGetNVMLVersion");
    intget_fn cuda = (intget_fn)sym(lib, "nvmlSystemGetCudaDriverVersion");
    char d[80] = "", v[80] = "";
    int c = 0;
    if (!drv || !nvml || !cuda || drv(d, sizeof d) != 0 || nvml(v, sizeof v) != 0 || cuda(&c) != 0)
        return 999;
    if (header) {
        printf("NVIDIA-SMI %s    Driver Version: %s    CUDA Version: %d.%d\n", FAKE_DRIVER_VERSION, d, c / 1000,
               (c % 1000) / 10);
        return 0;
    }
    printf("NVIDIA-SMI version  : %s\nNVML version        : %s\nDRIVER version      : %s\n", FAKE_DRIVER_VERSION,
           v, d);
    printf("CUDA Version        : %d.%d\n", c / 1000, (c % 1000) / 10);
    return 0;
}

int main(int argc, char **argv)
{
    void *lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    init_fn init;
    errstr_fn errstr;
    int r;
    if (lib == NULL) {
        printf("NVIDIA-SMI couldn't find libnvidia-ml.so library in your system. Please make sure that the "
               "NVIDIA Display Driver is properly installed and present in your system.\nPlease also try "
               "adding directory that contains libnvidia-ml.so to your system PATH.\n");
        return 12;
    }
    init = (init_fn)sym(lib, "nvmlInit_v2");
    errstr = (errstr_fn)sym(lib, "nvmlErrorString");
    if (!init || !errstr)
        return 13;
    r = init();
    if (r == 9) {
        printf("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure that "
               "the latest NVIDIA driver is installed and running.\n\n");
        return r;
    }
    if (r != 0) {
        printf("Failed to initialize NVML: %s\n", r == 18 ? "Driver/library version mismatch" : errstr(r));
        return r;
    }
    if (argc > 1 && strcmp(argv[1], "--version") == 0)
        return versions(lib, 0);
    if (argc > 1 && strcmp(argv[1], "-L") == 0)
        return list(lib);
    r = versions(lib, 1);
    return r != 0 ? r : list(lib);
}
