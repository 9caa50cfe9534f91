"""The kubelet device plugin (API v1beta1 over gRPC): advertises GPUs with health, answers Allocate with CDI names.

Modules: devices (what is advertised), topology (NVLink/PCI/NUMA-aware preferred allocation), allocate (Allocate
answers), health (XID events, nodes, lost GPUs), state (the health board), server (the DevicePlugin service),
registration (Register with retry), watch + lifecycle (kubelet restarts, signals), cdispec (the spec written at
start), labels + featurefile (GPU feature labels for node-feature-discovery), config (NVIDIA's v1 config file),
settings (flag > environment > file precedence), devicespecs (Allocate's DeviceSpecs). The click command is
cli/plugin.py. api_pb2*.py are generated from api.proto (regen.sh).
"""
