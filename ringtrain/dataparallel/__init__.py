"""Data parallelism: one thin layer over Horovod's ring-allreduce."""
