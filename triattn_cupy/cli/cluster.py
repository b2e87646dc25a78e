"""`triattn-infer --scheduler ADDRESS` and `--cluster local`: the batch on a Dask cluster.

The run itself is `cluster_run.run_batch`; this module holds the two flags and connects
to (or starts) the cluster. Dask is imported only when one of the flags is given (then
`cluster_run`, which imports it, is imported).
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os

from .._install import pip_install
from .backends import SetupError

logger = logging.getLogger("triattn_cupy.cli")

CONNECT_TIMEOUT_S = 30


def add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "Dask cluster (needs triattn-cupy[distributed])",
        "The files are spread over the workers of a Dask cluster; every other option means "
        "what it means in a local run. Workers must see INPUT and --output-dir at the same "
        "paths (a shared filesystem) and run the same version of triattn-cupy.")
    exclusive = group.add_mutually_exclusive_group()
    exclusive.add_argument(
        "--scheduler", metavar="ADDRESS",
        help="address of a running Dask scheduler (tcp://host:8786) or a scheduler file "
             "(JSON, from `dask scheduler --scheduler-file`); start one GPU worker per GPU "
             "with `dask cuda worker ADDRESS`, CPU workers with `dask worker ADDRESS`")
    exclusive.add_argument(
        "--cluster", choices=("local",),
        help="local: start a Dask cluster on this host for the run: one worker per GPU "
             "(--devices) through dask-cuda, or with --device cpu, CPU workers")


def wants_cluster(args) -> bool:
    return bool(getattr(args, "scheduler", None) or getattr(args, "cluster", None))


def run_on_cluster(args):
    """The run described by `args` on the cluster its flags name; a `RunResult`."""
    from . import cluster_run  # (imports Dask, where installed)

    try:
        cluster_run.require_dask()
    except ImportError as exc:
        raise SetupError(f"--scheduler and --cluster: {exc}") from None  # (names the extra)
    with _client(args) as (client, args):
        logger.info("Dask cluster at %s: %d worker%s", client.scheduler.address,
                    _worker_count(client), "s" if _worker_count(client) != 1 else "")
        return cluster_run.run_batch(client, args)


def _worker_count(client) -> int:
    return len(client.scheduler_info().get("workers", {}))


@contextlib.contextmanager
def _client(args):
    """(client, args as the cluster run takes them)."""
    from distributed import Client

    if args.scheduler:
        target = args.scheduler
        is_file = os.path.isfile(target)
        try:
            client = (Client(scheduler_file=target, timeout=CONNECT_TIMEOUT_S) if is_file
                      else Client(target, timeout=CONNECT_TIMEOUT_S))
        except (OSError, TimeoutError, ValueError) as exc:
            raise SetupError(f"--scheduler: cannot reach the Dask scheduler at {target}: "
                             f"{type(exc).__name__}: {exc}") from None
        with client:
            try:
                client.wait_for_workers(1, timeout=CONNECT_TIMEOUT_S)
            except (OSError, TimeoutError) as exc:
                raise SetupError(f"--scheduler: the Dask cluster at {target} has no "
                                 f"workers ({type(exc).__name__}: {exc}); start them with "
                                 f"`dask worker {target}` or `dask cuda worker`") from None
            yield client, args
        return
    with _local_cluster(args) as (cluster, args):
        with Client(cluster) as client:
            yield client, args


@contextlib.contextmanager
def _local_cluster(args):
    from . import pipeline

    kind, devices = pipeline.resolve_devices(args)
    cluster_args = argparse.Namespace(**vars(args))
    cluster_args.device, cluster_args.devices = kind, None
    if kind == "cpu":
        from distributed import LocalCluster

        workers = max(1, (os.cpu_count() or 2) // 2)
        cluster = LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                               dashboard_address=":0")
    else:
        try:
            from dask_cuda import LocalCUDACluster
        except Exception as exc:  # ImportError, or CUDA bindings that do not load
            raise SetupError(f"--cluster local on GPUs needs dask-cuda ("
                             f"{pip_install('distributed-cuda')}): {type(exc).__name__}: "
                             f"{exc}; or use --devices "
                             f"without --cluster") from None
        # The workers' CUDA_VISIBLE_DEVICES replaces this process's: name the same GPUs.
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible:
            names = [v.strip() for v in visible.split(",")]
            devices = [names[d] for d in devices]
        # Two threads per GPU worker: one file is read or written while another computes.
        cluster = LocalCUDACluster(
            CUDA_VISIBLE_DEVICES=",".join(map(str, devices)), threads_per_worker=2,
            dashboard_address=":0")
    with cluster:
        yield cluster, cluster_args
