"""Loading the model for a model subcommand, and the kernels it runs on as the commands print them."""

import mlx_h2o


def _attention_desc() -> str:
    import mlx.core as mx

    from ..hook import fast_cpu_attention_enabled

    if fast_cpu_attention_enabled() and mx.default_device() == mx.cpu:
        return f"fused CPU kernel ({mlx_h2o._ext.kernel_isa()}, {mlx_h2o._ext.kernel_threads()} threads)"
    return "mlx-lm stock"


def _layers_desc(model) -> str:
    from ..cpu_layers import cpu_layer_kernels_used, mlx_has_layer_kernels

    n = cpu_layer_kernels_used(model)
    fork = "MLX's own (the fork's CPU kernels)" if mlx_has_layer_kernels() else None
    if n:
        return f"{fork}; {n} MLPs on mlx-h2o's swiglu kernel" if fork else f"{n} modules on mlx-h2o's CPU kernels"
    return fork or "MLX's own"


def _load(args):
    mlx_h2o.use_fast_cpu_attention(args.attention == "fused")
    return mlx_h2o.load(args.model, weights=args.weights)
