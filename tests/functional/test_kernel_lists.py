"""What a fused kernel's step reads its tensors with (`zero.functional.kernels.steps.flatten`):
the structure of a list or dict of tensors kept from step to step, the leaves read afresh."""

import optree
import pytest
import torch

from zero.functional.kernels.steps import flatten

T = [torch.randn(3), torch.nn.Parameter(torch.randn(2, 2)), torch.randn(1)]


@pytest.mark.parametrize("tree", [
    T, [], {"b": T[0], "a": T[1], "c": T[2]}, {"a": T[1], "b": T[0], "c": T[2]},
    [T[0], [T[1], T[2]]], [T[0], None, T[1]], (T[0], T[1]), {"a": {"x": T[0]}, "b": T[1]}, T[0],
], ids=["list", "empty", "dict", "dict-sorted", "nested", "none", "tuple", "nested-dict", "one-tensor"])
def test_flatten_is_optrees_flatten(tree):
    for _ in range(2):  # the second call reads the kept structure
        leaves, treedef = flatten(tree)
        theirs, their_def = optree.tree_flatten(tree)
        assert treedef == their_def and len(leaves) == len(theirs)
        assert all(a is b for a, b in zip(leaves, theirs))


def test_a_tree_of_the_same_length_but_another_structure_is_flattened_afresh():
    flatten([T[0], T[1]])
    leaves, treedef = flatten([T[0], [T[1], T[2]]])
    assert treedef == optree.tree_structure([T[0], [T[1], T[2]]]) and len(leaves) == 3
    with pytest.raises(ValueError):  # a dict by other names is not taken for the kept one
        flatten({"a": T[0], "b": T[1]})[1].flatten_up_to({"a": T[0], "z": T[1]})
    leaves, treedef = flatten({"a": T[0], "z": T[1]})
    assert treedef == optree.tree_structure({"a": T[0], "z": T[1]})
