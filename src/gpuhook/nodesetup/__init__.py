"""`gpuhook node-setup`: what the node-setup DaemonSet does to a node (install gpuhook under one host prefix,
configure and reload the container runtime, keep the /dev/char links) and how it is undone, to the byte."""
