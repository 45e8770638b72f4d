"""Leadership: which replica may dispatch, and why a stale one cannot.

Two guarantees of docs/architecture.md live here:

3. **One dispatcher at a time, fenced.** ``elector`` grants at most one node a term
   per shard, whose epoch is the etcd revision that created the shard's election key
   (strictly increasing); ``replica`` raises the shard's ``leader_fence`` to that epoch
   (``takeover``) before any duty acts, so PostgreSQL refuses every write of an older
   epoch (``scheduler.store.fenced``).
4. **Bounded failover.** ``elector`` keeps the node's lease alive and stops trusting it
   before etcd could hand a key to another (the trust window, ``lease``); standbys
   watch the prefix and campaign on delete; ``replica`` stops every duty before a key
   is given up, and revokes the lease at once on SIGTERM, so a crashed leader is
   replaced within lease TTL + 1 s.

An unsharded cluster is the one shard ``main`` on ``<prefix>/leader``: the same
elector and replica, reporting under the single-leader names (``report``).
``assignment`` is the elector's pure decision of which shards to lead; ``etcd_client``
builds the gRPC client (keepalives, TLS). This package sits above the duties: the
replica imports them and hands each a ``scheduler.duties.context.DutyContext``; nothing
below imports it (tests/unit/test_import_graph.py).
"""
