"""Rule costs as a registry: one cost model per family behind one small protocol (`RuleCost`:
state bytes, step flops, whole or not, block), and the names plans take (`COSTS`, `cost_of`).

- ``base``: the protocol and the element-wise family (``slots`` tensors like the param, scalars);
- ``newton_schulz``: matrices orthogonalised whole (Muon);
- ``lowbit``: block-wise quantized moments (torchao's 8- and 4-bit Adam);
- ``kronecker``: Kronecker-factored preconditioners (SOAP, Shampoo), their matrices whole;
- ``low_rank``: matrices stepped in a low-rank projection (GaLore), whole;
- ``registry``: name -> model. Adding a rule: its rule file, its cost (a registry line, or a family
  module), one row of the contract test (tests/functional/test_rule_contract.py), the re-exports.
"""

from zero.plans.costs.base import Elementwise, RuleCost
from zero.plans.costs.kronecker import Shampoo, Soap
from zero.plans.costs.low_rank import LowRank
from zero.plans.costs.lowbit import LOW_BIT_MIN_NUMEL, LowBit
from zero.plans.costs.newton_schulz import NewtonSchulz
from zero.plans.costs.registry import COSTS, cost_of

__all__ = ["RuleCost", "Elementwise", "NewtonSchulz", "LowBit", "LOW_BIT_MIN_NUMEL", "Soap", "Shampoo", "LowRank",
           "COSTS", "cost_of"]
