"""The cache's name, which transformers changed in 5.24.

Before 5.24, `generate()` carried a key/value cache as `past_key_values` and a recurrent state as `cache_params`: the
keyword it passes to `forward` and the output field it reads back. From 5.24 both are `cache`, and a metaclass on
`ModelOutput` renames the old keywords at construction, so an output field still named the old way never receives its
value (a TypeError). The models here speak the new name: their forwards take `cache` (and the old names, which callers
and older versions of `generate()` pass), and their outputs have a `cache` field, stored under the old name where the
installed transformers reads that one.

This file is copied into model folders for `trust_remote_code` loading, so the choice is made when it is imported, on
the transformers of whoever loads the model, not on the one that saved it.
"""

import dataclasses
import functools


def _generate_reads_cache() -> bool:
    """Whether the installed `generate()` carries the cache as `cache` (transformers >= 5.24)."""
    try:
        from transformers.generation.utils import ALL_CACHE_NAMES
    except ImportError:  # the list is gone: a transformers newer than 5.24, which reads `cache`
        return True
    return "cache" in ALL_CACHE_NAMES


CACHE_RENAMED = _generate_reads_cache()


def one_cache(cache, **old_names):
    """The cache given as `cache` or under one of its old names (`past_key_values=...`, `cache_params=...`)."""
    given = {name: value for name, value in {"cache": cache, **old_names}.items() if value is not None}
    if len(given) > 1:
        raise ValueError(f"the cache was given twice ({' and '.join(given)}): pass it once, as `cache`")
    return next(iter(given.values()), None)


def cache_field(old_name: str):
    """Decorate a `ModelOutput` dataclass with a `cache` field. On transformers >= 5.24 it is returned as it is. On an
    older one the field is renamed `old_name`, the name that version's `generate()` reads, while `Output(cache=...)`
    and `output.cache` keep working, so the code using it is the same on every version."""

    def rename(cls):
        if CACHE_RENAMED:
            return cls
        # A dataclass's fields cannot be renamed in place (its __init__ is generated): build the class again.
        fields = [(old_name if f.name == "cache" else f.name, f.type, dataclasses.field(default=f.default))
                  for f in dataclasses.fields(cls)]
        namespace = {"__doc__": cls.__doc__, "cache": property(lambda self: getattr(self, old_name))}
        renamed = dataclasses.make_dataclass(cls.__name__, fields, bases=cls.__bases__, namespace=namespace)
        renamed.__module__, renamed.__qualname__ = cls.__module__, cls.__qualname__
        init = renamed.__init__

        @functools.wraps(init)
        def __init__(self, *args, cache=None, **kwargs):
            if cache is not None:
                kwargs[old_name] = one_cache(cache, **{old_name: kwargs.get(old_name)})
            init(self, *args, **kwargs)

        renamed.__init__ = __init__
        return renamed

    return rename
