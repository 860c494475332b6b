"""Quality against speed: scores, evaluation runs, comparisons and study reports.

- ``metrics``: BLEU, ROUGE-L, BERTScore and paired-bootstrap intervals;
- ``evaluate``: ``skipdecode evaluate`` (generate at each speedup, score, keep the outputs);
- ``compare``: ``skipdecode compare`` (two reports on the same items, with intervals);
- ``report``: a study's tables from several reports (``python -m skipdecode.evaluation.report``).
"""

from .compare import compare
from .evaluate import evaluate, load_items
from .metrics import paired_bleu_bootstrap, paired_rouge_bootstrap, reference_streams, rouge_l_per_item, score

__all__ = ["compare", "evaluate", "load_items", "paired_bleu_bootstrap", "paired_rouge_bootstrap",
           "reference_streams", "rouge_l_per_item", "score"]
