"""The batch command `triattn-infer` (also `python -m triattn_cupy`).

    main      the command line (argparse) and the entry point
    pipeline  the batch job: reader / worker / writer threads, signals
    filejob   one file's steps (read, compute, write with provenance), run by the
              pipeline's threads and by the workers of a Dask cluster
    plan      which files are inputs, where their outputs go, what is skipped or refused
    backends  the compute backends: GPU (TriangleAttention) and CPU (NumPy)
    io        finding, reading and checking inputs (headers before data)
    outputs   atomic writes, provenance, what lies at an output path
    claims    per-output claims, so that several runs split one batch
    runfiles  a run's hidden files (claims, temporaries): names, holders, the sweep
    report    progress and the closing summary
    demo      `triattn-infer --demo`, the quick start
    cluster   --scheduler / --cluster: the flags, connecting to the Dask cluster
    cluster_run    the batch on a Dask cluster, the client's side (imports Dask); also
                   behind triattn_cupy.distributed, which depends on this package
    cluster_tasks  what a Dask worker runs for it (imports Dask; only cluster_run imports it)

The entry point is `triattn_cupy.cli.main.main`. Importing this package touches neither
CuPy nor the GPU, nor Dask.
"""
