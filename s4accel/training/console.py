"""What the libraries print that a user does not need: kept off the console, warnings that matter left alone."""

from __future__ import annotations

import logging


class _DropTiedWeightsNote(logging.Filter):
    """Accelerate logs "Removed shared tensor {'lm_head.weight'} while saving" at every checkpoint of a model whose
    output layer shares the embedding's weights. That sharing is by design (`tie_word_embeddings`), and
    `from_pretrained` ties them again on load, so the line says nothing."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Removed shared tensor" not in record.getMessage()


def quiet_libraries(progress_bars: bool) -> None:
    """Called once per process before anything is built. transformers' "Writing model shards" / "Loading weights"
    bars are always off (a bar for one file that takes milliseconds); `progress_bars=False` (`log.progress_bar:
    false`, or a command that prints only its result) turns off every `datasets` bar too."""
    import datasets
    from transformers.utils import logging as hf_logging

    logger = logging.getLogger("accelerate.utils.other")
    if not any(isinstance(f, _DropTiedWeightsNote) for f in logger.filters):
        logger.addFilter(_DropTiedWeightsNote())
    hf_logging.disable_progress_bar()
    if not progress_bars:
        datasets.disable_progress_bars()
