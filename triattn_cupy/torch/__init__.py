"""triattn_cupy.torch: the kernels as a drop-in for PyTorch models' inference.

    import triattn_cupy.torch as tt
    model = tt.accelerate(model)            # every triangle attention block, found and routed
    with torch.inference_mode(): model(...)  # the kernels, on torch's stream, in its dtypes

    with tt.accelerated(precision="bf16"):   # every block of the process, by its class,
        run_my_pipeline()                    # whichever way the model is built or loaded
    print(tt.report())                       # blocks, calls through the kernels, fallbacks

A call the kernels do not compute runs the block's original forward, warned once per block
and reason (`FallbackWarning`); strict=True raises `FallbackError` instead. `triattn-run`
runs a model's own command line with its blocks routed. `triangle_attention(pair, mask,
weights)` is the functional form on torch tensors. All go through the registered op
``torch.ops.triattn.triangle_attention`` (traceable by torch.compile, replayable in CUDA
graphs). Importing `triattn_cupy` never imports torch; importing this subpackage does
(pip install "triattn-cupy[torch]", or
pip install ".[torch]" from a source checkout).
"""
from .ops import IO_DTYPES, triangle_attention
from .blocks import accelerate, accelerated_blocks, report, restore
from .fallbacks import FallbackError, FallbackWarning, Report
from .routing import accelerated, disable, enable, enabled

__all__ = ["triangle_attention", "accelerate", "restore", "accelerated_blocks", "IO_DTYPES",
           "report", "Report", "FallbackWarning", "FallbackError", "enable", "disable",
           "enabled", "accelerated"]
