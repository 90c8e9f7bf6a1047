"""The fast paths: the same maths as the rules, run with fewer dispatches or in place.

`packing` runs a rule's list maths on small CPU leaves packed into one tensor; `elementwise` holds
the fused list forms of the maths the rules share; `kernels` gives chains that spell a rule torch
has a fused or multi-tensor kernel for an in-place step on that kernel. A new kernel goes in
`kernels` (matched from the chain's specs); the rules themselves never live here.
"""
