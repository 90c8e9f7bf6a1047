"""In-place kernel steps: the same maths as the rules, run by torch's own kernels on the params
and state in place, for chains whose links spell a rule torch has a kernel for.

`matching` reads a chain's specs as a rule; `fused` (torch's fused kernels) and `multi_tensor`
(torch's multi-tensor implementations, and Lion on foreach ops) step it in place over what
`steps` gives every kernel; `chains` fits a chain to a kernel and says which path a
transformation takes (`explain`). A new kernel goes in `fused` or `multi_tensor`, matched from
the chain's specs; the rules never live here.
"""
