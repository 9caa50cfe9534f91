/* A driver library without behaviour: a real ELF shared object whose soname,
 * path and dependencies are what matters (ldconfig, readelf, dlopen). */
#ifndef FAKE_LIBRARY
#error FAKE_LIBRARY must be defined
#endif

__attribute__((visibility("default"))) const char *gpuhook_fake_library(void)
{
    return FAKE_LIBRARY;
}
