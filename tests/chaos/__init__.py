"""Chaos tests: real ``duetime`` processes under crashes, pauses, signals and partitions.

Every test here is marked ``chaos``, bounded by a timeout, and kills the processes it
started in ``finally`` (``tests/support/procs.py``). ``DUETIME_TEST_SOAK=1`` (``make
chaos``) repeats the failover rounds to measure failover times over several runs.
"""
