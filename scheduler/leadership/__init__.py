"""Leadership: which replica may dispatch, and why a stale one cannot.

Two guarantees of docs/architecture.md live here:

3. **One dispatcher at a time, fenced.** ``election`` grants at most one replica a
   term, whose epoch is the etcd revision that created the election key (strictly
   increasing); ``fence`` makes PostgreSQL refuse every claim of an older epoch once a
   newer leader has raised ``leader_fence``, and takes the fence from a frozen zombie
   that still holds it.
4. **Bounded failover.** ``election`` keeps the lease alive and stops trusting it
   before etcd could hand the key to another (the trust window); standbys watch the key
   and campaign on delete; ``replica`` stops every duty before it resigns, and resigns
   at once on SIGTERM, so a crashed leader is replaced within lease TTL + 1 s.

``etcd_client`` builds the gRPC client (keepalives, TLS) the election talks through.
``sharded`` is the replica of a sharded cluster: per shard it does what ``replica``
does, on the per-shard keys of ``scheduler.shards.leadership``; both raise the fence
through ``takeover``.
The duties (``scheduler.duties``) never import this package's replica: the replica
imports them and hands each a ``scheduler.duties.context.DutyContext``.
"""
