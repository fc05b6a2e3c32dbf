"""Held-out evals of the trainer's current policy through the ``run.eval_engine`` (plain objects, no Ray).

The trainer actor holds one :class:`PolicyEvaluator`; it lives here, Ray-free, so the tests drive it in one
process exactly as the actor does.
"""

from __future__ import annotations

import copy

from tba.adapters import has_adapter
from tba.config import Config
from tba.runtime.build import build_eval_engine, generation_dtype
from tba.trainer import pack_policy


class PolicyEvaluator:
    """Runs the task's :meth:`~tba.tasks.Task.evaluate` on a copy of the trainer's policy in the generation
    dtype. With ``run.eval_engine`` 'vllm' one vLLM engine is built at the first eval and given the
    trainer's weights (``Trainer.publish_weights``, the packs searchers get) before every eval; with 'hf'
    each eval wraps the copy in a fresh ``HFEngine``.

    Args:
        cfg: the run config, ``run.eval_engine`` resolved (:func:`tba.placement.resolve_placement`).
        policy_path: the policy's folder (a vLLM engine is built from it).
        tokenizer, task: the policy's tokenizer and the run's task.
    """

    def __init__(self, cfg: Config, policy_path: str, tokenizer, task):
        self.cfg, self.policy_path, self.tokenizer, self.task = cfg, policy_path, tokenizer, task
        self.gen_dtype = generation_dtype(cfg)
        self._vllm = None

    def evaluate(self, trainer) -> dict:
        """The task's held-out metrics for ``trainer``'s current policy (its :meth:`~tba.trainer.Trainer.full_model`;
        left in train mode afterwards); a
        LoRA adapter is merged into the copy's weights (peft's ``merge_and_unload``, in float32 before the
        cast), so the hf engine decodes a plain model."""
        source = trainer.full_model()  # the unsharded policy (a sharded trainer's other ranks gather with it)
        model = copy.deepcopy(source)
        if has_adapter(model):
            model = model.merge_and_unload()
        model = model.to(self.gen_dtype).eval()
        if self.cfg.run.eval_engine == "vllm":
            if self._vllm is None:
                self._vllm = build_eval_engine(self.cfg, self.policy_path, model, self.tokenizer, self.task)
            self._vllm.load_weights(pack_policy(source, self.gen_dtype, trainer.publish_merged))
            engine = self._vllm
        else:
            engine = build_eval_engine(self.cfg, self.policy_path, model, self.tokenizer, self.task)
        try:
            return self.task.evaluate(engine, self.tokenizer, self.cfg.run.eval_batch_size,
                                      self.cfg.searcher.max_new_tokens, policy=model)
        finally:
            trainer.model.train()

    def close(self) -> None:
        """Free the vLLM engine, if one was built."""
        if self._vllm is not None:
            self._vllm.close()
            self._vllm = None
