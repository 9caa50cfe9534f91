/* A driver binary without behaviour (nvidia-debugdump, nvidia-persistenced,
 * nv-fabricmanager, the MPS pair): it runs, says what it is and exits 0. */
#include <stdio.h>
#include <string.h>

#ifndef FAKE_TOOL
#error FAKE_TOOL and FAKE_DRIVER_VERSION must be defined
#endif

int main(int argc, char **argv)
{
    if (argc > 1 && (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0)) {
        printf("%s: gpuhook simulated driver binary\n", FAKE_TOOL);
        return 0;
    }
    printf("%s:  version %s\n", FAKE_TOOL, FAKE_DRIVER_VERSION);
    return 0;
}
