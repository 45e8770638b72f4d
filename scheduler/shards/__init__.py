"""Shards: several PostgreSQL databases, each led by one fenced replica.

``config`` parses which shards exist, ``assignment`` decides (purely) which shards this
node should lead, ``leadership`` holds the per-shard election keys in etcd and tells
its owner when a shard is gained or lost.
"""
