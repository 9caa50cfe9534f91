"""`gpuhook dra-plugin`: a kubelet Dynamic Resource Allocation driver (resource.k8s.io/v1) named gpu.nvidia.com.

devices (inventory -> ResourceSlice devices), publish (the slice through the API), claim (a claim's allocation,
parsed once), config (opaque GpuConfig/MigDeviceConfig), prepare (NodePrepareResources' work), claimspec (the
claim's CDI spec), checkpoint (prepared claims across restarts), server (the gRPC services), driver (the process).
"""
