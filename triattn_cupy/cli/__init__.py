"""The batch command `triattn-infer` (also `python -m triattn_cupy`).

    main      the command line (argparse) and the entry point
    pipeline  the batch job: reader / worker / writer threads, signals
    plan      which files are inputs, where their outputs go, what is skipped or refused
    backends  the compute backends: GPU (TriangleAttention) and CPU (NumPy)
    io        finding, reading and checking inputs (headers before data)
    outputs   atomic writes, provenance, temporary files left by ended runs
    claims    per-output claims, so that several runs split one batch
    report    progress and the closing summary
    demo      `triattn-infer --demo`, the quick start

The entry point is `triattn_cupy.cli.main.main`. Importing this package touches neither
CuPy nor the GPU.
"""
