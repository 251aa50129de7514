"""Classification scores from every evaluated sample's predicted and true class, in torch: the confusion matrix,
each class's precision and recall, and macro-F1, with scikit-learn's definitions (a class never predicted has
precision 0, a class absent from the labels recall 0; the macro average runs over the classes found in the labels or
the predictions, so a class the evaluation split lacks and the model never predicts does not count as an F1 of 0)."""

from __future__ import annotations

import torch


def confusion_matrix(predictions: torch.Tensor, labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    """(C, C) counts: row = true class, column = predicted class."""
    index = labels.long() * num_classes + predictions.long()
    return torch.bincount(index, minlength=num_classes * num_classes).reshape(num_classes, num_classes)


def classification_scores(predictions: torch.Tensor, labels: torch.Tensor, names: list[str]) -> dict:
    """`f1_macro`, `precision/<class>` and `recall/<class>` for each class by name, and `confusion_matrix`:
    `{"labels": names, "matrix": [[count, ...], ...]}` (rows the true class, columns the predicted one)."""
    counts = confusion_matrix(predictions, labels, len(names))
    cm = counts.double()
    hits, predicted, actual = cm.diagonal(), cm.sum(0), cm.sum(1)
    precision = torch.where(predicted > 0, hits / predicted.clamp(min=1), 0.0)
    recall = torch.where(actual > 0, hits / actual.clamp(min=1), 0.0)
    occurs = predicted + actual > 0  # 2 x hits + false positives + false negatives: F1's denominator
    f1 = 2 * hits / (predicted + actual).clamp(min=1)
    scores = {"f1_macro": f1[occurs].mean().item() if occurs.any() else 0.0}
    scores.update({f"precision/{name}": p for name, p in zip(names, precision.tolist())})
    scores.update({f"recall/{name}": r for name, r in zip(names, recall.tolist())})
    scores["confusion_matrix"] = {"labels": list(names), "matrix": counts.tolist()}
    return scores


def confusion_text(confusion: dict) -> str:
    """A confusion matrix as a Markdown table, rows the true class: TensorBoard's text panel renders it, and
    `s4accel eval` prints it."""
    names = [str(n).replace("|", "\\|") for n in confusion["labels"]]
    lines = ["| true \\ predicted | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    lines += [f"| {name} | " + " | ".join(map(str, row)) + " |" for name, row in zip(names, confusion["matrix"])]
    return "\n".join(lines)
