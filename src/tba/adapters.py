"""LoRA adapters (``model.lora``) with peft: add one to a model, switch it off for the reference, pack and
load it for publication.

With an adapter the policy is base + (alpha / r) B A on the targeted linear layers, B initialised to zero
(Hu et al. 2021, LoRA eq. 3), so the policy starts equal to the base; the reference pi_ref is the same base
with the adapter disabled (peft's ``disable_adapter``), so no second copy of the weights is kept where the
base lives. Publications carry the adapter's tensors only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from tba.config import LoraSettings
from tba.types import PackedWeights
from tba.weights import pack_tensors, unique_tensors, unpack_weights


def lora_config(settings: LoraSettings):
    """The peft ``LoraConfig`` of ``settings`` (``alpha`` None: 2 x r; B starts at zero)."""
    from peft import LoraConfig

    return LoraConfig(r=settings.r, lora_alpha=settings.alpha or 2 * settings.r, lora_dropout=settings.dropout,
                      target_modules=settings.target_modules, task_type="CAUSAL_LM", init_lora_weights=True)


def add_adapter(model, settings: LoraSettings):
    """``model`` wrapped with a fresh LoRA adapter (a peft ``PeftModel``; only the adapter's parameters
    require grad). With B = 0 its outputs equal ``model``'s exactly until the adapter is trained.

    Raises:
        ValueError: a target module matches none of the model's modules (see :func:`check_lora`).
    """
    from peft import get_peft_model

    return get_peft_model(model, lora_config(settings))


def has_adapter(model) -> bool:
    """Whether ``model`` is a peft model (holds a LoRA adapter)."""
    from peft import PeftModel

    return isinstance(model, PeftModel)


@contextlib.contextmanager
def adapter_off(model) -> Iterator:
    """``model`` with its adapter disabled inside the block (the base, i.e. pi_ref); a model without one as
    it is."""
    if has_adapter(model):
        with model.disable_adapter():
            yield model
    else:
        yield model


def adapter_tensors(model) -> list[tuple[str, torch.Tensor]]:
    """The adapter's tensors under PEFT's saved names (``get_peft_model_state_dict``: the adapter name left
    out), e.g. ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` [r, in_features]."""
    from peft import get_peft_model_state_dict

    return list(get_peft_model_state_dict(model).items())


def adapter_config_dict(model) -> dict:
    """The adapter's ``LoraConfig`` as JSON-safe dict (what ``adapter_config.json`` holds; 'all-linear'
    resolved to the module names it matched, which any PEFT reader, vLLM's too, understands)."""
    out = model.peft_config[model.active_adapter].to_dict()
    return {k: sorted(v) if isinstance(v, set) else v for k, v in out.items()}


def pack_adapter(model, dtype: torch.dtype | None = None) -> PackedWeights:
    """The adapter of ``model`` packed for publication (:func:`tba.weights.pack_tensors`, ``adapter`` set)."""
    return pack_tensors(adapter_tensors(model), dtype, adapter=adapter_config_dict(model))


def merged_tensors(model) -> list[tuple[str, torch.Tensor]]:
    """The full weights of base + adapter under the base model's own names (what ``merge_and_unload``'s
    model would hold, tied tensors once), computed without touching ``model``: each adapted layer's
    ``base_layer.weight`` plus peft's ``get_delta_weight`` ((alpha / r) B A, LoRA eq. 3), the rest as is.
    Packed with :func:`tba.weights.pack_tensors`, it loads into an engine of the base architecture."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    deltas = {name: m.get_delta_weight(m.active_adapters[0]) for name, m in base.named_modules()
              if isinstance(m, LoraLayer)}
    out = []
    with torch.no_grad():
        for name, t in unique_tensors(base):
            if ".lora_" in name:
                continue
            module, _, leaf = name.removesuffix(".base_layer.weight").partition(".base_layer.")
            if name.endswith(".base_layer.weight"):
                out.append((f"{module}.weight", t + deltas[module].to(t.dtype)))
            else:  # an adapted layer's other tensors (a bias) lose ".base_layer"; the rest keep their name
                out.append((f"{module}.{leaf}" if leaf else name, t))
    return out


def load_adapter(model, packed: PackedWeights) -> None:
    """Copy a published adapter (:func:`pack_adapter`) into ``model``'s adapter in place (cast to its dtype).

    Raises:
        ValueError: ``packed`` holds full weights, or its tensor names or shapes differ from ``model``'s
            adapter (another rank or target modules); nothing is loaded then.
    """
    from peft import set_peft_model_state_dict

    if packed.adapter is None or not has_adapter(model):
        raise ValueError("published weights and model disagree on LoRA: model.lora.r must be the same for "
                         "searchers and trainer")
    target = dict(adapter_tensors(model))
    shapes = {name: tuple(shape) for name, _, shape, _ in packed.entries}
    if set(shapes) != set(target) or any(tuple(target[n].shape) != s for n, s in shapes.items()):
        raise ValueError(f"published adapter does not match this model's: missing "
                         f"{sorted(set(target) - set(shapes))[:3]}, unexpected {sorted(set(shapes) - set(target))[:3]} "
                         "(or shapes differ)")
    with torch.no_grad():
        set_peft_model_state_dict(model, unpack_weights(packed))


def check_lora(model_path: str, settings: LoraSettings) -> None:
    """Check before anything loads that ``settings.target_modules`` match modules of the model at
    ``model_path`` (built from its config on the meta device: no weights read).

    Raises:
        ValueError: one line: a target matches no module (naming the linear modules the model has).
    """
    if settings.r is None or settings.target_modules == "all-linear":
        return
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
    names = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    unknown = [t for t in settings.target_modules if not any(n == t or n.endswith(f".{t}")
                                                             for n, _ in model.named_modules())]
    if unknown:
        raise ValueError(f"model.lora.target_modules: {', '.join(unknown)} match no module of {model_path}; its "
                         f"linear modules are {', '.join(sorted(names))} (or 'all-linear')")
