"""Gradients as a part a mode composes (ZeRO-2): the `GradientSource` (hooks and rounds in the
plan's order) over the `BucketEngine` (fill, start, land, drain; it owns the tensors reductions
land in), DDP's unused-parameter protocol (`Unused`), and the collective by a pluggable
`zero.backends.comm.Reducer`."""
