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


def build(module, name: str, **extra):
    """``module.<name>(**ALIASES[name], **extra)`` for ``module`` zero.functional or optax."""
    return getattr(module, name)(**ALIASES[name], **extra)
