"""The fast paths: the same maths as the rules, run with fewer dispatches or in place.

`packing` runs a rule's list maths on small CPU leaves packed into one tensor; `elementwise` holds
the fused list forms of the maths the rules share. The in-place steps: `matching` reads a chain's
specs as a rule, `kernels` (torch's fused kernels) and `foreach_kernels` (torch's multi-tensor
implementations, and Lion) step it in place over what `steps` gives every kernel, and `chains`
fits a chain to a kernel and says which path a transformation takes (`explain`). A new kernel
goes in `kernels` or `foreach_kernels`, matched from the chain's specs; the rules never live here.
"""
