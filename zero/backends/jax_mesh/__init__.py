"""The same plans on a JAX device mesh: ZeRO-1 optimizer state for Optax, placed by a `zero.Plan`.

Imports jax and optax, never torch. `init` places ``tx.init(params)`` by the plan along one
mesh axis, `update` gives the jitted step; `gather_state` / `place_state` move a state between
the mesh's layout and Optax's (and so, through `zero.functional.from_optax_state`, to a torch
run and back); `save` / `restore` write it with Orbax and read it back under any plan and mesh
size; `state_bytes` says what each device holds, `device_bytes` what it will hold. A hybrid plan
(``make_plan(..., "flat", optimizer="muon")``) steps each whole param on its owner device alone
(`zero.backends.jax_mesh.hybrid`).
"""

from zero._lazy import module_getattr
from zero.backends.jax_mesh.buffers import packing
from zero.backends.jax_mesh.checkpoint import restore, save
from zero.backends.jax_mesh.executor import device_bytes, gather_state, init, place_state, state_bytes, update

__all__ = ["device_bytes", "gather_state", "init", "packing", "place_state", "restore", "save", "state_bytes",
           "update"]

__getattr__ = module_getattr(__name__)  # a submodule not imported yet resolves on first access
