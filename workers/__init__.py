"""duetime workers: the execution runtime (see workers.worker)."""
