"""Metric functions a test recipe names as `testing_metrics:function` (`task.metrics`)."""

import torch


def errors(predictions, labels):
    """A dict of metrics: how many samples are wrong, and how many were scored."""
    return {"errors": int((predictions != labels).sum()), "scored": labels.numel()}


def returns_text(predictions, labels):
    return "not a number"


def one_argument(predictions):
    return 0.0


def label_dtype(predictions, labels):
    return float(predictions.dtype == torch.int64 and labels.dtype == torch.int64)


def not_a_number(predictions, labels):
    return float("nan")


def raises(predictions, labels):
    raise ZeroDivisionError("division by zero")

