"""Shards seen from outside the leader: routing a producer's jobs to a shard
(``router``) and reading every shard's state for ``duetime status`` and the dashboard
(``status``). Which shards exist is configuration (``scheduler.config.shards``); who
leads them is ``scheduler.leadership``.
"""
