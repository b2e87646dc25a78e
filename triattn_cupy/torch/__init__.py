"""triattn_cupy.torch: the kernels as a drop-in for PyTorch models' inference.

    import triattn_cupy.torch as tt
    model = tt.accelerate(model)            # every triangle attention block, found and routed
    with torch.inference_mode(): model(...)  # the kernels, on torch's stream, in its dtypes

`triangle_attention(pair, mask, weights)` is the functional form on torch tensors. Both go
through the registered op ``torch.ops.triattn.triangle_attention`` (traceable by
torch.compile, replayable in CUDA graphs). Importing `triattn_cupy` never imports torch;
importing this subpackage does (pip install "triattn-cupy[torch]", or
pip install ".[torch]" from a source checkout).
"""
from .ops import IO_DTYPES, triangle_attention
from .blocks import accelerate, accelerated_blocks, restore

__all__ = ["triangle_attention", "accelerate", "restore", "accelerated_blocks", "IO_DTYPES"]
