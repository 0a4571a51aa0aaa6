"""Communication: transports (gloo, NCCL, in-process loopback) over one base, the call header, consensus, topology."""
