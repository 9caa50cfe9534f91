"""gpuhook: NVIDIA GPUs in containers through CDI, an OCI prestart hook and a kubelet device plugin."""

__version__ = "0.1.0"
