"""The batch command `triattn-infer` (also `python -m triattn_cupy`).

    main      the command line (argparse) and the entry point
    pipeline  the batch job: planning, reader / worker / writer threads
    backends  the compute backends: GPU (TriangleAttention) and CPU (NumPy)
    io        finding, reading and checking inputs; atomic output writes
    report    progress and the closing summary
    demo      `triattn-infer --demo`, the quick start

The entry point is `triattn_cupy.cli.main.main`. Importing this package touches neither
CuPy nor the GPU.
"""
