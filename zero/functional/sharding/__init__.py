"""Whole-tensor and whole-model quantities when a rank steps only pieces of the model: a package
of its concerns (`context`: the installed sharding and the stepped pieces; `norms`; `axes`: sums
over axes; `whole`: rules that need whole tensors; `heads`: or whole heads of them; `blocks`:
low-bit blocks), its names here.

Most rules are element-wise and step a piece of a tensor exactly as they would the whole. A
few need quantities over whole tensors or the whole model: `clip_by_global_norm` (the global
norm), `scale_by_trust_ratio` (LAMB, LARS: each tensor's norm), `apply_if_finite` (is every
update finite), Prodigy's sums over the model (`total_sums`). They ask this module, never
compute those over their leaves themselves:

- with no sharding installed (one process, or a plain optimizer) the answers come from the
  leaves alone;
- a sharded backend installs a `Sharding` around its local step: it says which pieces of which
  whole tensors each leaf holds, and gives a ``reduce`` that sums a tensor over the ranks. Each
  answer is then one partial sum per piece and one small ``reduce``.

Sums over some axes of each tensor (`axis_sums`, `axis_means`: ``centralize``'s row means,
``clip_by_block_rms``'s mean square, ``adaptive_grad_clip``'s unit norms) are answered the same
way: one partial sum per piece and unit, one ``reduce`` of every unit of every tensor.

Every rank must ask the same questions in the same order, since each is a collective: a
sharded `zero.functional.Optimizer` therefore steps every param group on every step, even one
with no gradients on this rank.
"""

from zero.functional.sharding.axes import AxesOf, axis_means, axis_sums, every_axis, reads_axes
from zero.functional.sharding.blocks import block_sizes, quantized
from zero.functional.sharding.context import (
    Pieces,
    Sharding,
    every_group,
    installed,
    name_of,
    stepping,
    subset,
    whole_hint,
)
from zero.functional.sharding.heads import head_counts, reads_heads, whole_heads, whole_shapes
from zero.functional.sharding.norms import (
    all_finite,
    global_norm,
    inner_products,
    tensor_norms,
    total_norm,
    total_sums,
)
from zero.functional.sharding.placeholders import is_placeholder, placeholder
from zero.functional.sharding.whole import (
    ParamsRefused,
    cut_tensors,
    defer_refusal,
    needs_whole,
    pieces_unknown,
    whole_tensors,
    whole_tree,
)

__all__ = ["Pieces", "Sharding", "installed", "every_group", "stepping", "subset", "global_norm", "total_norm",
           "tensor_norms", "all_finite", "total_sums", "inner_products", "whole_tensors", "needs_whole", "axis_sums",
           "axis_means", "every_axis",
           "quantized", "block_sizes", "cut_tensors", "whole_tree", "name_of", "whole_hint", "placeholder",
           "pieces_unknown", "ParamsRefused", "is_placeholder", "AxesOf", "reads_axes", "whole_heads", "reads_heads",
           "head_counts", "whole_shapes", "defer_refusal"]
