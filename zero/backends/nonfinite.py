"""Where gradients that hold NaN or inf were found, as ZeRO's messages say it (`where`).

The policy (``nonfinite=``: warn, skip or raise) and the check (`all_finite`) are
`zero.functional.adapters.nonfinite`'s, one for every zero optimizer. Where zero reduces the
gradients itself (``reduce_scatter_grads=True``) each rank checks its own gradients before the
reduction, so the ranks named are the ones that made them; under DDP the gradients a rank gets
are already averaged over every rank, so the ranks named are the ones whose part of the model
holds them. The check costs one pass over the gradients a rank checks (its own, or its part after
DDP) and no collective of its own: each rank's flag rides in the step's check-in
(`zero.backends.consistency`). Only when some rank flags do the ranks exchange the params' names.
A step driven by a loss scaler (``torch.amp.GradScaler``) is the scaler's to skip: not checked here.
"""

from __future__ import annotations

__all__ = ["where"]


def where(ranks: list[int] | None, local: bool) -> str:
    listed = ", ".join(map(str, ranks or ()))
    if local:
        return f"first seen in the gradients of rank {listed}, before their reduction"
    after = "found after DDP's all-reduce (every rank then holds them: the rank that made them cannot be told)"
    return after if ranks is None else f"{after} in the part of the model rank {listed} steps"
