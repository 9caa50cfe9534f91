/* Runs inside test containers: load the driver the way a CUDA program does and report what it sees. */
#include <dlfcn.h>
#include <stdio.h>

int main(void) {
    void *h = dlopen("libcuda.so.1", RTLD_NOW);
    if (!h) {
        printf("dlopen-failed %s\n", dlerror());
        return 2;
    }
    int (*cu_init)(unsigned) = (int (*)(unsigned))dlsym(h, "cuInit");
    int (*cu_count)(int *) = (int (*)(int *))dlsym(h, "cuDeviceGetCount");
    int (*cu_version)(int *) = (int (*)(int *))dlsym(h, "cuDriverGetVersion");
    if (!cu_init || !cu_count || !cu_version) {
        printf("dlsym-failed\n");
        return 3;
    }
    int count = -1, version = -1;
    int rc_init = cu_init(0);
    cu_count(&count);
    cu_version(&version);
    printf("cuInit=%d count=%d version=%d\n", rc_init, count, version);
    return 0;
}
