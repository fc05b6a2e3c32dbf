"""Thin Ray actor adapters around the buffer, the searchers and the trainer (docs/algorithm.md section 2).

Each actor owns one plain object and forwards calls to it; what runs where, and when, is the driver's
(:mod:`tba.runtime.driver`).
"""

from __future__ import annotations

import copy
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
    """The trainer, and evaluation of its current policy on the task's held-out set. ``run_dir``: the run
    directory, for the third-party log (:func:`tba.runtime.build.quiet_libraries`)."""

    def __init__(self, cfg: dict, policy_path: str, ref_path: str, run_dir: str | None = None):
        from tba.runtime.build import build_trainer, generation_dtype, quiet_libraries
        from tba.runtime.evaluation import PolicyEvaluator
        from tba.tasks import build_task

        quiet_libraries(run_dir, "trainer")
        self.cfg = Config.model_validate(cfg)
        self.task = build_task(self.cfg)
        self.trainer, self.tokenizer = build_trainer(self.cfg, policy_path, ref_path, len(self.task.train))
        self.gen_dtype = generation_dtype(self.cfg)
        self.evaluator = PolicyEvaluator(self.cfg, policy_path, self.tokenizer, self.task)

    def train_step(self, buffer, num_prompts: int, group_size: int):
        """Sample a batch from the buffer and take one optimizer step; None if the buffer is not ready."""
        batch = ray.get(buffer.sample.remote(num_prompts, group_size, self.trainer.step_count))
        return None if batch is None else self.trainer.step(batch)

    def publish(self) -> list:
        """Put the current weights (generation dtype) in the object store; returns ``[ref]``."""
        return [ray.put(self.trainer.publish_weights(self.gen_dtype))]

    def evaluate(self) -> dict:
        """The task's held-out metrics for the current policy (:class:`tba.runtime.evaluation.PolicyEvaluator`)."""
        return self.evaluator.evaluate(self.trainer)

    def step_count(self) -> int:
        """Optimizer steps taken (including skipped ones)."""
        return self.trainer.step_count

    def save_checkpoint(self, directory: str) -> None:
        """Weights, optimizer, scheduler, step and RNG into ``directory`` (safetensors + JSON)."""
        t = self.trainer
        checkpoint.save_trainer(Path(directory), t.model, t.optimizer, t.scheduler,
                                t.extra_state())

    def load_checkpoint(self, directory: str) -> int:
        """Restore :meth:`save_checkpoint`; returns the trainer step."""
        t = self.trainer
        t.load_extra_state(checkpoint.load_trainer(Path(directory), t.model, t.optimizer, t.scheduler))
        return t.step_count

    def save(self, path: str) -> str:
        """Save the policy and tokenizer in Hugging Face format: with a LoRA adapter a PEFT adapter folder
        (``PeftModel.from_pretrained(base, path)`` loads it) and, with ``trainer.save_merged``, the adapter
        merged into a copy of the base weights under ``path/merged``."""
        from tba.adapters import has_adapter

        model = self.trainer.model
        model.save_pretrained(path)
        self.tokenizer.save_pretrained(path)
        if has_adapter(model) and self.cfg.trainer.save_merged:
            merged = copy.deepcopy(model).merge_and_unload()
            merged.save_pretrained(f"{path}/merged")
            self.tokenizer.save_pretrained(f"{path}/merged")
        return path
