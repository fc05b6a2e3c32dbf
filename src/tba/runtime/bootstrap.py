"""Ray bootstrap: a private loopback-only instance on one machine, or joining a cluster."""

from __future__ import annotations

import logging
import os

import ray

from tba.config import Config
from tba.logger import release_library_loggers

# MALLOC_ARENA_MAX: glibc's per-thread arenas otherwise inflate each worker's RSS by GBs of freed memory
WORKER_ENV = {"TOKENIZERS_PARALLELISM": "false", "MALLOC_ARENA_MAX": "2"}


def loopback_only() -> None:
    """Keep Ray on 127.0.0.1: its single-machine switch (read by the driver at call time and by the daemons
    from the environment they inherit) binds every gRPC server to loopback and stops Ray from rewriting a
    loopback address into the machine's external IP."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray._private.ray_constants.ENABLE_RAY_CLUSTER = False


def _is_loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")


def init_ray(cfg: Config) -> None:
    """Join ``run.ray_address``, or start a private local instance that listens on loopback only.

    The local instance gets at least enough CPUs for the trainer's ranks and every searcher (``threads`` each).
    Ray's driver-side log records go through the root logger (:func:`tba.logger.release_library_loggers`).
    """
    release_library_loggers()  # `import ray` gave the ray logger a console handler of its own
    env = {"env_vars": WORKER_ENV}
    address = cfg.run.ray_address
    if address:
        loopback = _is_loopback(address)
        if loopback:
            loopback_only()
        ray.init(address=address, runtime_env=env, logging_level=logging.WARNING,
                 **({"_node_ip_address": "127.0.0.1"} if loopback else {}))
        return
    loopback_only()
    need = cfg.trainer.threads * cfg.trainer.num_workers + cfg.searcher.num_searchers * cfg.searcher.threads + 1
    # address="local": always a private instance, never a cluster some other job left running
    ray.init(address="local", num_cpus=max(os.cpu_count() or 1, need), include_dashboard=False,
             _node_ip_address="127.0.0.1", runtime_env=env, logging_level=logging.WARNING,
             configure_logging=True)
