"""Test toolkit shared by integration and chaos tests.

- ``wait``: ``wait_for(condition, timeout=...)``, the only way tests poll.
- ``procs``: child processes with captured output, signals, and guaranteed cleanup.
- ``etcd``: a private etcd server tests may stop, kill and restart; the shared endpoint.
- ``proxy``: a TCP fault proxy (cut, refuse, latency, blackhole) in front of any service.
"""
