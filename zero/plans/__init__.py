"""The plan layer: pure functions from parameter metadata to placement and cost (stdlib only).

metadata (`meta`) -> ownership (`partition`) or element shards (`layout.flat_layout`) -> bucket
and sync layouts (`layout`), DDP buckets (`ddp_buckets`), what each rank's local optimizer sees
(`shards`) -> what it all costs (`accounting`, `cost`; each rule's cost model in `costs/`, a
registry) -> one printable, saveable `Plan` (`plan`, its fields `plan_fields`) -> what each rank
holds under it (`holdings`: the seam every executor and state format reads, with `chunks`' boxes
of each param for sharded checkpoints), what the executor's peak is (`footprint`) and a JAX
mesh's padding (`mesh_padding`).
`averaging_schedule` is post-local SGD's schedule; `presets` are shape lists of known models.
The public names are re-exported by the package root: ``zero.make_plan``, ``zero.partition`` ...
"""

from zero._lazy import module_getattr

__getattr__ = module_getattr(__name__)  # a submodule not imported yet resolves on first access
