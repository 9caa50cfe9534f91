/* The GPU table the NVML mock serves. The data lives in a small generated
 * table.c compiled per fake driver; nvml.c is compiled once and cached. */
#ifndef GPUHOOK_FAKENVML_H
#define GPUHOOK_FAKENVML_H

#define FAKE_MAX_GPUS 16
#define FAKE_MAX_MIG_PER_GPU 7

struct fake_mig {
    unsigned gpu;          /* table index of the parent GPU */
    unsigned index;        /* position among its GPU's MIG devices */
    const char *uuid;      /* MIG-... */
    const char *name;      /* "<gpu name> MIG 1g.10gb" */
    unsigned gi, ci;
    unsigned long long memory_bytes;
    unsigned sm_count, ce_count, dec_count, enc_count, jpg_count, ofa_count;
    unsigned gi_slices, ci_slices;
    unsigned profile_id;   /* the GPU-instance profile's id (nvidia-smi mig -lgip's ID) */
    unsigned placement_start, placement_size; /* in memory slices */
};

struct fake_gpu {
    unsigned index;        /* table (host) index: the control files use it */
    unsigned minor;
    const char *uuid;
    const char *name;
    unsigned domain, bus, device, function;
    unsigned pci_device_id, pci_subsystem_id;
    unsigned long long memory_bytes;
    int cc_major, cc_minor;
    int brand;             /* nvmlBrandType_t */
    int arch;              /* nvmlDeviceArchitecture_t */
    int numa_node;
    int mig_enabled;
    unsigned mig_first;    /* first row in fake_migs */
    unsigned mig_count;
};

/* NVLink: the active links of each GPU (rows ordered by GPU) and the PCI tree. */
#define FAKE_NVLINK_MAX_LINKS 18
struct fake_nvlink {
    unsigned domain, bus, device, function; /* the far end */
    int remote_type;                         /* nvmlIntNvLinkDeviceType_t: 0 GPU, 2 NVSwitch */
};

extern const char fake_root[];
extern const char fake_driver_version[];
extern const char fake_nvml_version[];
extern const int fake_cuda_version;
extern const unsigned fake_gpu_count;
extern const struct fake_gpu fake_gpus[];
extern const unsigned fake_mig_count;
extern const struct fake_mig fake_migs[];
extern const unsigned fake_nvlink_first[FAKE_MAX_GPUS]; /* first row in fake_nvlinks per GPU */
extern const unsigned fake_nvlink_count[FAKE_MAX_GPUS];
extern const struct fake_nvlink fake_nvlinks[];
extern const unsigned char fake_topology[FAKE_MAX_GPUS][FAKE_MAX_GPUS]; /* nvmlGpuTopologyLevel_t */

#endif
