"""Echo in models this project did not write: a package's own transformer, made tensor-parallel
through echo_jax's public helpers without changing the package's code.

    python -m models.external.recurrentgemma_tp --help

`recurrentgemma_tp`: RecurrentGemma's Griffin (PyPI `recurrentgemma`, Google DeepMind's Flax
Linen model), its parameters sharded over a ("data", "tp") mesh and its projections routed through
`echo_jax.flax.site_with_carrier` by a Flax method interceptor (docs/external_model.md).
"""
