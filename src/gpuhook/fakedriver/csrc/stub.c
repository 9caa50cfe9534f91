/* A driver library without behaviour: a real ELF shared object whose soname,
 * path and dependencies are what matters (ldconfig, readelf, dlopen). */
#ifndef FAKE_LIBRARY
#error FAKE_LIBRARY must be defined
#endif

__attribute__((visibility("default"))) const char *gpuhook_fake_library(void)
{
    return FAKE_LIBRARY;
}

#ifdef FAKE_ABI_NOTE
/* The GNU ABI tag (Linux 2.3.99) NVIDIA's libnvidia-tls carries: libnvidia-container's driver lookup takes a
 * libnvidia-tls only with it (and fails the whole lookup without). */
__asm__(".section .note.ABI-tag,\"a\",@note\n"
        ".balign 4\n"
        ".long 4, 16, 1\n"
        ".asciz \"GNU\"\n"
        ".long 0, 2, 3, 99\n"
        ".previous\n");
#endif
