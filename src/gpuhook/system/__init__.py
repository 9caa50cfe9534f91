"""Host set-up commands (`gpuhook system …`), NVIDIA's `nvidia-ctk system` counterparts: what a host needs
beside the runtimes' configuration for GPUs to keep working in containers."""
