"""Thin Ray actor adapters around the buffer, the searchers and the trainer (docs/algorithm.md section 2).

Each actor owns one plain object and forwards calls to it; what runs where, and when, is the driver's
(:mod:`tba.runtime.driver`).
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import ray

from tba import checkpoint
from tba.buffer import ReplayBuffer
from tba.config import Config
from tba.runtime.exchange import AddReply, SearcherMetrics, WeightBoard


@ray.remote
class BufferActor:
    """The replay buffer, the weight board and the searcher metrics: one round trip of a searcher delivers
    its samples and fetches newer weights.

    Args:
        cfg: the run config as a dict (``buffer`` section and ``run.seed``).
        run_dir: the run directory, for the third-party log (:func:`tba.logger.route_worker`).
    """

    def __init__(self, cfg: dict, run_dir: str | None = None):
        from tba.logger import route_worker

        route_worker(run_dir, "buffer")  # no transformers here: quiet_libraries would import it
        c = Config.model_validate(cfg)
        self.buffer = ReplayBuffer(c.buffer, c.run.seed)
        self.min_fill = c.buffer.min_fill
        self.board = WeightBoard(c.trainer.generation_lag)
        self.metrics = SearcherMetrics()
        self.stop = False

    def add(self, samples, metrics: dict, searcher_id: int, searcher_version: int) -> AddReply:
        """Store a searcher's samples; reply with the stop flag, the served version and its weights if newer
        than ``searcher_version``."""
        self.buffer.add(samples)
        self.metrics.add(len(samples), metrics, searcher_id, searcher_version)
        return AddReply(stop=self.stop, version=self.board.version, weights=self.board.newer_than(searcher_version))

    def publish(self, version: int, weights_ref: list, reset: bool = False) -> None:
        """Make ``weights_ref`` (a one-element list, so Ray does not resolve it) the newest policy
        (:meth:`WeightBoard.publish`)."""
        self.board.publish(version, weights_ref, reset)

    def sync(self, min_version: int) -> int:
        """See :meth:`ReplayBuffer.sync`."""
        return self.buffer.sync(min_version)

    def sample(self, num_prompts: int, group_size: int, step: int):
        """A batch, or None while the buffer holds fewer than ``buffer.min_fill`` samples."""
        if len(self.buffer) < self.min_fill:
            return None
        return self.buffer.sample(num_prompts, group_size, step)

    def set_stop(self) -> None:
        """Searchers finish their current batch and return."""
        self.stop = True

    def state_dict(self) -> dict:
        """Buffer contents and sampling state plus counters (JSON-safe; weights are the trainer's)."""
        return {"buffer": self.buffer.state_dict(), **self.metrics.state_dict()}

    def load_state_dict(self, state: dict) -> int:
        """Restore :meth:`state_dict`; returns the number of samples now held."""
        self.buffer.load_state_dict(state["buffer"])
        self.metrics.load_state_dict(state)
        return len(self.buffer)

    def last_seen(self) -> dict[int, float]:
        """Each searcher's newest call to :meth:`add` (wall time, seconds since the epoch), by searcher id."""
        return dict(self.metrics.last_seen)

    def stats(self, drain: bool = True) -> dict:
        """Buffer stats, counters and the mean of searcher metrics since the last drain."""
        return {**self.buffer.stats(), **self.metrics.summary(drain)}


@ray.remote
class SearcherActor:
    """One searcher: generates with the newest weights it has, pushes samples, never waits for training.
    ``run_dir``: the run directory, for the third-party log (:func:`tba.runtime.build.quiet_libraries`)."""

    def __init__(self, cfg: dict, policy_path: str, ref_path: str, searcher_id: int, run_dir: str | None = None):
        from tba.runtime.build import build_searcher, quiet_libraries

        quiet_libraries(run_dir, f"searcher {searcher_id}")
        self.searcher = build_searcher(Config.model_validate(cfg), policy_path, ref_path, searcher_id)

    def node_id(self) -> str:
        """Ray node this searcher runs on."""
        return ray.get_runtime_context().get_node_id()

    def state_dict(self) -> dict:
        """Prompt cursor and RNG (answered while ``run`` is busy: the actor has two threads)."""
        return self.searcher.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` before ``run`` starts."""
        self.searcher.load_state_dict(state)

    def last_reward_error(self) -> str | None:
        """The reason of this searcher's newest reward failure, if any."""
        return self.searcher.last_reward_error

    def run(self, buffer, max_batches: int | None = None) -> int:
        """Loop: load newer weights if published -> generate a batch -> add it. Returns batches made."""
        s = self.searcher
        reply: AddReply = ray.get(buffer.add.remote([], {}, s.searcher_id, s.version))
        made = 0
        while not reply.stop and (max_batches is None or made < max_batches):
            if reply.weights is not None:
                s.load_weights(reply.version, ray.get(reply.weights[0]))
            samples, metrics = s.step()
            reply = ray.get(buffer.add.remote(samples, metrics, s.searcher_id, s.version))
            s.delivered()
            made += 1
        return made


@ray.remote
class TrainerActor:
    """The trainer, and evaluation of its current policy on the task's held-out set; or one rank of N
    (``trainer.num_workers``, :class:`tba.runtime.trainer_group.TrainerGroup` starts them and fans calls out).

    Args:
        cfg: the run config as a dict.
        policy_path, ref_path: the prepared model folders.
        run_dir: the run directory, for the third-party log (:func:`tba.runtime.build.quiet_libraries`).
        rank, world: this rank and N; with N > 1 or ``trainer.fsdp`` the actor first joins the ranks'
            process group (:func:`tba.parallel.init_group`) at ``127.0.0.1:port``.
        port: the rendezvous port (on this node: the ranks are packed on one).

    Rank 0 does what a single trainer does (the batch's metrics, publication, evals, checkpoint files, the
    final save); the other ranks train their prompt groups and join the collectives of a sharded trainer.
    """

    def __init__(self, cfg: dict, policy_path: str, ref_path: str, run_dir: str | None = None, rank: int = 0,
                 world: int = 1, port: int | None = None):
        from tba import parallel
        from tba.runtime.build import _device, build_trainer, generation_dtype, quiet_libraries
        from tba.runtime.evaluation import PolicyEvaluator
        from tba.tasks import build_task

        quiet_libraries(run_dir, "trainer" if world == 1 else f"trainer rank {rank}")
        self.cfg = Config.model_validate(cfg)
        self.rank = rank
        if world > 1 or self.cfg.trainer.fsdp:
            port = port if port is not None else parallel.free_port()  # N = 1 (fsdp): a group of itself
            parallel.init_group(rank, world, port, _device(self.cfg), self.cfg.trainer.collective_timeout_s)
        self.task = build_task(self.cfg)
        self.trainer, self.tokenizer = build_trainer(self.cfg, policy_path, ref_path, len(self.task.train))
        self.gen_dtype = generation_dtype(self.cfg)
        self.evaluator = PolicyEvaluator(self.cfg, policy_path, self.tokenizer, self.task)

    def pid(self) -> int:
        """This actor's process id (the fault tests kill one rank)."""
        return os.getpid()

    def train_step(self, buffer, num_prompts: int, group_size: int):
        """Sample a batch from the buffer and take one optimizer step; None if the buffer is not ready."""
        batch = ray.get(buffer.sample.remote(num_prompts, group_size, self.trainer.step_count))
        return self.train_batch(batch)

    def train_batch(self, batch):
        """One optimizer step on ``batch`` (the whole batch: a rank trains its own prompt groups of it); its
        metrics on rank 0, None on the others and when ``batch`` is None (the buffer was not ready)."""
        if batch is None:
            return None
        metrics = self.trainer.step(batch)
        return metrics if self.rank == 0 else None

    def publish(self) -> list | None:
        """Put the current weights (generation dtype) in the object store; returns ``[ref]`` on rank 0 (the
        other ranks of a sharded trainer join the gather and return None)."""
        if self.rank != 0 and not self.trainer.sharded:
            return None
        packed = self.trainer.publish_weights(self.gen_dtype)
        return None if packed is None else [ray.put(packed)]

    def evaluate(self) -> dict | None:
        """The task's held-out metrics for the current policy (:class:`tba.runtime.evaluation.PolicyEvaluator`),
        on rank 0; None on the others (which gather a sharded policy with it)."""
        if self.rank == 0:
            return self.evaluator.evaluate(self.trainer)
        if self.trainer.sharded:
            self.trainer.full_model()
        return None

    def step_count(self) -> int:
        """Optimizer steps taken (including skipped ones)."""
        return self.trainer.step_count

    def save_checkpoint(self, directory: str) -> None:
        """Weights, optimizer, scheduler, step and RNG into ``directory``: safetensors + JSON from rank 0 (the
        ranks of an unsharded trainer hold the same state), or, sharded, a torch.distributed.checkpoint that
        every rank writes its shards to."""
        t = self.trainer
        if t.sharded:
            checkpoint.save_trainer_sharded(Path(directory), t.model, t.optimizer, t.scheduler, t.extra_state())
        elif self.rank == 0:
            checkpoint.save_trainer(Path(directory), t.model, t.optimizer, t.scheduler, t.extra_state())

    def load_checkpoint(self, directory: str) -> int:
        """Restore :meth:`save_checkpoint` (every rank reads it); returns the trainer step."""
        t = self.trainer
        load = checkpoint.load_trainer_sharded if t.sharded else checkpoint.load_trainer
        t.load_extra_state(load(Path(directory), t.model, t.optimizer, t.scheduler))
        return t.step_count

    def save(self, path: str) -> str | None:
        """Save the policy and tokenizer in Hugging Face format (rank 0; the others join a sharded gather):
        with a LoRA adapter a PEFT adapter folder (``PeftModel.from_pretrained(base, path)`` loads it) and,
        with ``trainer.save_merged``, the adapter merged into a copy of the base weights under ``path/merged``."""
        from tba.adapters import has_adapter

        model = self.trainer.full_model()
        if self.rank != 0:
            return None
        model.save_pretrained(path)
        self.tokenizer.save_pretrained(path)
        if has_adapter(model) and self.cfg.trainer.save_merged:
            merged = copy.deepcopy(model).merge_and_unload()
            merged.save_pretrained(f"{path}/merged")
            self.tokenizer.save_pretrained(f"{path}/merged")
        return path
