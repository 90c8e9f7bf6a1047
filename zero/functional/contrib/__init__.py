"""Rules from ``optax.contrib``: one rule a module, each named and shaped as Optax's (its state
layout included) and re-exported from here, as ``optax.contrib.<name>`` is; SOAP (named as Optax's
pull request names it) and Shampoo (Scalable Shampoo's), with their whole-matrix kernels in
`kronecker`; ADOPT, AdEMAMix (and its simplified form), schedule-free learning (with the
in-place swap to and from its evaluation params that ``Optimizer.eval()`` runs) and Prodigy (its
sums over the model asked of `zero.functional.sharding`); and torchao's low-bit Adam
(``adamw_8bit`` ...), which Optax does not have, with state no sharding changes.
"""

from zero.functional.contrib._acprop import acprop, scale_by_acprop
from zero.functional.contrib._ademamix import (
    ScaleByAdemamixState,
    ScaleBySimplifiedAdEMAMixState,
    ademamix,
    scale_by_ademamix,
    scale_by_simplified_ademamix,
    simplified_ademamix,
)
from zero.functional.contrib._adopt import adopt, scale_by_adopt
from zero.functional.contrib._cocob import COCOBState, cocob, scale_by_cocob
from zero.functional.contrib._complex_valued import (
    SplitRealAndImaginaryArrays,
    SplitRealAndImaginaryState,
    split_real_and_imaginary,
)
from zero.functional.contrib._dadapt_adamw import DAdaptAdamWState, dadapt_adamw
from zero.functional.contrib._dog import DoGState, DoWGState, dog, dowg, scale_by_dog, scale_by_dowg
from zero.functional.contrib._galore import GaLoreDimensionNumbers, GaLoreState, galore, scale_by_galore
from zero.functional.contrib._lowbit import (
    ScaleByLowBitAdamState,
    adam_4bit,
    adam_8bit,
    adamw_4bit,
    adamw_8bit,
    scale_by_adam_4bit,
    scale_by_adam_8bit,
)
from zero.functional.contrib._madgrad import MadgradState, madgrad, scale_by_madgrad
from zero.functional.contrib._mechanic import MechanicState, mechanize
from zero.functional.contrib._momo import MomoAdamState, MomoState, momo, momo_adam
from zero.functional.contrib._muon import MuonState, muon, muon_8bit, scale_by_muon, scale_by_shape
from zero.functional.contrib._privacy import (
    DifferentiallyPrivateAggregateState,
    differentially_private_aggregate,
    dpsgd,
)
from zero.functional.contrib._prodigy import ProdigyState, prodigy
from zero.functional.contrib._reduce_on_plateau import ReduceLROnPlateauState, reduce_on_plateau
from zero.functional.contrib._sam import NormalizeState, SAMState, normalize, sam
from zero.functional.contrib._schedule_free import (
    ScheduleFreeState,
    schedule_free,
    schedule_free_adamw,
    schedule_free_eval_params,
    schedule_free_sgd,
    schedule_free_states,
    swap_eval,
    swap_train,
)
from zero.functional.contrib._shampoo import ShampooState, scale_by_shampoo, shampoo
from zero.functional.contrib._soap import SoapState, decay_after_update, scale_by_soap, soap
from zero.functional.contrib._sophia import (
    HutchinsonState,
    SophiaState,
    hutchinson_estimator_diag_hessian,
    scale_by_sophia,
    sophia,
)
from zero.functional.contrib.newton_schulz import MuonDimensionNumbers, orthogonalize_via_newton_schulz

__all__ = ["ScaleByLowBitAdamState", "adam_4bit", "adam_8bit", "adamw_4bit", "adamw_8bit", "scale_by_adam_4bit",
           "scale_by_adam_8bit", "MuonState", "muon", "muon_8bit", "scale_by_muon", "scale_by_shape",
           "MuonDimensionNumbers", "orthogonalize_via_newton_schulz", "SoapState", "scale_by_soap", "soap",
           "decay_after_update", "ShampooState", "scale_by_shampoo", "shampoo", "adopt", "scale_by_adopt",
           "ScaleByAdemamixState", "scale_by_ademamix", "ademamix", "ScaleBySimplifiedAdEMAMixState",
           "scale_by_simplified_ademamix", "simplified_ademamix", "ScheduleFreeState", "schedule_free",
           "schedule_free_sgd", "schedule_free_adamw", "schedule_free_eval_params", "schedule_free_states",
           "swap_eval", "swap_train", "ProdigyState", "prodigy", "DoGState", "scale_by_dog", "dog", "DoWGState",
           "scale_by_dowg", "dowg", "acprop", "scale_by_acprop", "COCOBState", "cocob", "scale_by_cocob",
           "MadgradState", "madgrad", "scale_by_madgrad", "DAdaptAdamWState", "dadapt_adamw", "MechanicState",
           "mechanize", "MomoState", "momo", "MomoAdamState", "momo_adam", "ReduceLROnPlateauState",
           "reduce_on_plateau", "NormalizeState", "SAMState", "normalize", "sam", "SplitRealAndImaginaryArrays",
           "SplitRealAndImaginaryState", "split_real_and_imaginary", "DifferentiallyPrivateAggregateState",
           "differentially_private_aggregate", "dpsgd", "GaLoreDimensionNumbers", "GaLoreState", "galore",
           "scale_by_galore", "HutchinsonState", "SophiaState", "hutchinson_estimator_diag_hessian", "scale_by_sophia",
           "sophia"]
