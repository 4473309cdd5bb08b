"""Planning: from an `ir.Graph` to a `Plan`.

Owns meshes (abstract: axis names and sizes plus a topology), placements (Replicate, Shard(dim),
Partial(sum) per mesh axis), the sharding-rule registry, the cost model (roofline compute,
alpha-beta communication, resharding), the per-rank memory model, the ILP solver (HiGHS) and the
`Plan` itself. Imports only `meshplan.ir` (and `meshplan._errors`, `meshplan.telemetry`).

Built in a later issue; this package is a placeholder so the layout and import direction hold.
"""

__all__: list[str] = []
