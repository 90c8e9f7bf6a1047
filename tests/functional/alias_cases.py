"""The alias table the parity and property tests share: each alias with non-default arguments,
spelled with Optax's argument names so the same call builds the zero and the Optax optimizer."""

LR = 1e-2

ALIASES = {
    "sgd": dict(learning_rate=LR, momentum=0.9),
    "adam": dict(learning_rate=LR),
    "adamw": dict(learning_rate=LR, weight_decay=0.05),
    "adagrad": dict(learning_rate=LR),
    "adadelta": dict(learning_rate=1.0, weight_decay=0.01),
    "adamax": dict(learning_rate=LR),
    "rmsprop": dict(learning_rate=LR, centered=True, momentum=0.9),
    "rprop": dict(learning_rate=LR),
    "lion": dict(learning_rate=1e-3, weight_decay=0.01),
    "lamb": dict(learning_rate=LR, weight_decay=0.01),
    "nadam": dict(learning_rate=LR),
    "radam": dict(learning_rate=LR),
}


# Optax's other aliases (zero.functional.aliases): the parity tests run them too.
MORE_ALIASES = {
    "adabelief": dict(learning_rate=LR, nesterov=True),
    "amsgrad": dict(learning_rate=LR, bias_correction_nu=False),
    "adamaxw": dict(learning_rate=LR, weight_decay=0.05),
    "adan": dict(learning_rate=LR, weight_decay=0.01),
    "fromage": dict(learning_rate=LR),
    "lars": dict(learning_rate=LR, weight_decay=0.01, nesterov=True),
    "novograd": dict(learning_rate=LR, weight_decay=0.01),
    "optimistic_gradient_descent": dict(learning_rate=LR, alpha=0.7, beta=0.1),
    "sign_sgd": dict(learning_rate=LR),
    "signum": dict(learning_rate=LR, beta=0.8),
    "yogi": dict(learning_rate=LR),
    "optimistic_adam_v2": dict(learning_rate=LR, alpha=0.8, beta=0.3),
    "nadamw": dict(learning_rate=LR, weight_decay=0.02),
    "adafactor": dict(learning_rate=LR, min_dim_size_to_factor=2, momentum=0.9, weight_decay_rate=0.01),
    # L-BFGS's direction at a fixed rate (its line searches need the loss: tests/functional/test_optax_catalogue.py)
    "lbfgs": dict(learning_rate=LR, memory_size=3, linesearch=None),
}


# zero's contrib rules (zero.functional.contrib), as the backends' matrices run them beside the aliases.
CONTRIB = {
    "adamw_8bit": dict(learning_rate=1e-2, weight_decay=0.01),
    "adamw_4bit": dict(learning_rate=1e-2, weight_decay=0.01, block_size=64),
    "adam_8bit": dict(learning_rate=1e-2),
    "adam_4bit": dict(learning_rate=1e-2),
    "muon": dict(learning_rate=1e-2, weight_decay=0.01),
    "muon_8bit": dict(learning_rate=1e-2, weight_decay=0.01),  # its momentum in int8 codes (#67)
    # bases and roots recomputed within the tests' few steps
    "soap": dict(learning_rate=1e-2, weight_decay=0.01, precondition_frequency=2),
    "shampoo": dict(learning_rate=1e-2, graft_type="rmsprop", start_preconditioning_step=2,
                    preconditioning_compute_steps=2, block_size=16),
    # Optax's contrib rules (#66): element-wise, and Prodigy's sums over the model (one all-reduce a step)
    "adopt": dict(learning_rate=1e-2, nesterov=True),
    "ademamix": dict(learning_rate=1e-2, weight_decay=0.01),
    "simplified_ademamix": dict(learning_rate=1e-2, alpha=2.0),
    "schedule_free_adamw": dict(learning_rate=1e-2, warmup_steps=3, weight_decay=0.01),
    "schedule_free_sgd": dict(learning_rate=1e-2, weight_decay=0.01),
    "prodigy": dict(learning_rate=1.0, weight_decay=0.01),
    "dog": dict(weight_decay=0.01),
    "dowg": dict(learning_rate=0.5),
    "madgrad": dict(learning_rate=1e-2, weight_decay=0.01),
    "cocob": dict(weight_decay=0.01),
    "acprop": dict(learning_rate=1e-2),
    "dadapt_adamw": dict(learning_rate=0.5, weight_decay=0.01),
    "galore": dict(learning_rate=1e-2, rank=4, update_proj_gap=2),
}


def build(module, name: str, **extra):
    """``module.<name>(**ALIASES[name], **extra)`` for ``module`` zero.functional or optax."""
    return getattr(module, name)(**(ALIASES | MORE_ALIASES)[name], **extra)


# Schedules spelled with Optax's names, built by ``make(module)`` for zero.functional and optax
# alike: the parity test compares them with Optax, the schedule test its two ways of working one out.
SCHEDULES = [
    lambda m: m.linear_schedule(0.1, 0.01, 20, 5), lambda m: m.polynomial_schedule(1.0, 0.1, 2.0, 30),
    lambda m: m.cosine_decay_schedule(0.1, 30, alpha=0.1, exponent=2.0),
    lambda m: m.exponential_decay(0.1, 4, 0.7, 3, True, 0.02),
    lambda m: m.exponential_decay(0.1, 4, 1.3, end_value=0.3),
    lambda m: m.warmup_cosine_decay_schedule(0.0, 0.1, 10, 40, 0.01),
    lambda m: m.piecewise_constant_schedule(0.1, {10: 0.5, 25: 0.1}), lambda m: m.constant_schedule(0.3),
    lambda m: m.join_schedules([m.constant_schedule(0.1), m.linear_schedule(0.1, 0.0, 10)], [15]),
    lambda m: m.warmup_constant_schedule(0.0, 0.1, 10),
    lambda m: m.warmup_exponential_decay_schedule(0.0, 0.1, 10, 5, 0.7, 3, True, 0.02),
]
