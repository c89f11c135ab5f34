"""Models for echo_jax: a Flax tensor-parallel decoder (Qwen3 / Llama family) with Echo at every
tensor-parallel site, its configs and presets, and HF safetensors / GGUF checkpoint loaders.

    from models import config, model, loaders
    cfg = config.get_config("tiny")
    comm = config.CommConfig(tp=4, echo=echo_jax.EchoConfig(bits=4))
    full = model.init_params(jax.random.key(0), cfg)
    logits = model.apply_simulated(model.shard_params(full, 4), tokens, cfg, comm)
"""
