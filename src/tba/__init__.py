"""tba: Trajectory Balance with Asynchrony (arXiv 2503.18929) for LLM post-training.

Searchers generate and score responses off-policy, a replay buffer keeps them per prompt, and one
trainer learns from the buffer with the trajectory balance loss.

The Python API (docs/python-api.md)::

    from tba import load_config, train

    summary = train(load_config("configs/quickstart.yaml", {"trainer.max_steps": 20}))

The names below are imported on first use, so ``import tba`` loads neither pydantic nor torch nor Ray.
"""

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (~15 ms); type checkers read it the same

__version__ = "0.1.0"

#: public name -> the module that defines it
_EXPORTS = {"Config": "tba.config", "ConfigError": "tba.config", "load_config": "tba.config",
            "train": "tba.api", "RunSummary": "tba.api"}
__all__ = ["Config", "ConfigError", "RunSummary", "load_config", "train", "__version__"]

if TYPE_CHECKING:  # for type checkers and IDEs; at run time __getattr__ imports them
    from tba.api import RunSummary, train
    from tba.config import Config, ConfigError, load_config


def __getattr__(name: str):
    """Import a public name's module the first time the name is used (PEP 562)."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'tba' has no attribute {name!r}")
    value = getattr(__import__(_EXPORTS[name], fromlist=[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
