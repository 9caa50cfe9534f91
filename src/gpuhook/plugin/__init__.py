"""The kubelet device plugin (API v1beta1 over gRPC): advertises GPUs with health, answers Allocate with CDI names.

Modules: devices (what is advertised), topology (NUMA/PCI, preferred allocation), allocate (Allocate answers),
health (XID events, nodes, lost GPUs), state (the health board), server (the DevicePlugin service),
registration (Register with retry), watch + lifecycle (kubelet restarts, signals), cdispec (the spec written at
start), cli (`gpuhook device-plugin`), bench (measurements). api_pb2*.py are generated from api.proto (regen.sh).
"""
