"""SOAP as a user's own Optax transformation in JAX (the JAX mesh tests' rule; Optax has no SOAP
on main): the algorithm of `zero.functional.contrib.soap`, which the checks show it equals in
float64, in ``jnp`` and ``lax.cond``. Vectors keep no factor (``precondition_1d=False``)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax


class SoapState(NamedTuple):
    count: jax.Array
    exp_avg: Any
    exp_avg_sq: Any
    gg: Any
    q: Any


def _gram(g, axis):
    others = [a for a in range(g.ndim) if a != axis]
    return jnp.tensordot(g, g, axes=(others, others))


def _rotate(x, bases, back=False):
    for q in bases:
        x = jnp.tensordot(x, q, axes=([0], [1 if back else 0])) if q.size else jnp.moveaxis(x, 0, -1)
    return x


def _eigenbasis(m):
    _, v = jnp.linalg.eigh(m + 1e-30 * jnp.eye(m.shape[0], dtype=m.dtype))
    return v[:, ::-1]


def _refreshed(gg, q, nu):
    bases = []
    for axis, (f, b) in enumerate(zip(gg, q)):
        if f.size:
            product = f @ b
            order = jnp.argsort(-(b * product).sum(axis=0), stable=True)
            nu = jnp.take(nu, order, axis=axis)
            b = jnp.linalg.qr(product[:, order].astype(jnp.float32))[0].astype(product.dtype)
        bases.append(b)
    return tuple(bases), nu


def scale_by_soap(b1=0.95, b2=0.95, shampoo_beta=-1.0, eps=1e-8, precondition_frequency=10, max_precond_dim=10000):
    beta = b2 if shampoo_beta < 0 else shampoo_beta

    def factors(p):
        keep = [p.ndim > 1 and d <= max_precond_dim for d in p.shape]
        return tuple(jnp.zeros((d, d), p.dtype) if k else jnp.zeros((0,), p.dtype) for d, k in zip(p.shape, keep))

    def init(params):
        leaves, tdef = jax.tree.flatten(params)
        like = lambda make: tdef.unflatten([make(p) for p in leaves])  # noqa: E731
        return SoapState(jnp.zeros([], jnp.int32), like(jnp.zeros_like), like(jnp.zeros_like), like(factors),
                         like(factors))

    def leaf(g, mu, nu, gg, q, c):
        gg = tuple(f + (1 - beta) * (_gram(g, a) - f) if f.size else f for a, f in enumerate(gg))
        t = jnp.maximum(c, 1).astype(g.dtype)

        def first():
            return jnp.zeros_like(g), mu, nu, tuple(_eigenbasis(f) if f.size else f for f in gg)

        def later():
            mu2 = mu + (1 - b1) * (g - mu)
            nu2 = nu + (1 - b2) * (jnp.square(_rotate(g, q)) - nu)
            u = _rotate(_rotate(mu2, q) / (jnp.sqrt(nu2) + eps), q, back=True) * jnp.sqrt(1 - b2**t) / (1 - b1**t)
            q2, nu3 = jax.lax.cond(c % precondition_frequency == 0, _refreshed, lambda a, b, n: (b, n), gg, q, nu2)
            return u, mu2, nu3, q2

        u, mu, nu, q = jax.lax.cond(c == 0, first, later)
        return u, mu, nu, gg, q

    def update(updates, state, params=None):
        leaves, tdef = jax.tree.flatten(updates)
        cols = [tdef.flatten_up_to(x) for x in (state.exp_avg, state.exp_avg_sq, state.gg, state.q)]
        out = [leaf(g, *st, state.count) for g, *st in zip(leaves, *cols)]
        if not out:  # a device that owns none of these params
            return updates, state._replace(count=optax.safe_increment(state.count))
        u, mu, nu, gg, q = (tdef.unflatten(list(col)) for col in zip(*out))
        return u, SoapState(optax.safe_increment(state.count), mu, nu, gg, q)

    return optax.GradientTransformation(init, update)


def _decay_after_update(learning_rate, weight_decay):
    """p <- (p + u)(1 - lr wd), nothing at the first step (the authors' order, as zero's soap)."""
    def update(updates, state, params=None):
        k = jnp.where(state == 0, 0.0, learning_rate * weight_decay)
        return jax.tree.map(lambda u, p: u * (1 - k) - k * p, updates, params), optax.safe_increment(state)

    return optax.GradientTransformation(lambda params: jnp.zeros([], jnp.int32), update)


def soap(learning_rate, weight_decay=0.0, **kwargs):
    return optax.chain(scale_by_soap(**kwargs), optax.scale_by_learning_rate(learning_rate),
                       _decay_after_update(learning_rate, weight_decay))
