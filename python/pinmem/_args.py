"""Checks of integer arguments, shared by the file calls (pinmem/__init__.py) and the loaders
(loader.py, _iterable.py), so that one rule and one wording serve every integer argument."""

import operator as _operator

from ._pinmem import InvalidError


def int_arg(name, value, lo=None, hi=None, *, none_ok=False, fn=None):
    """value as an int within lo..hi (either bound may be None), refusing floats, strings and
    bools rather than truncating them (int() cut 1.5 to 1; a value past C's int raised
    OverflowError from the extension); a NumPy or torch integer is one (__index__). None is
    returned for None when none_ok. InvalidError otherwise, naming the argument (after `fn: `
    when fn is given) and what it must be."""
    where = f"{fn}: {name}" if fn else name
    if value is None and none_ok:
        return None
    if lo is None and hi is None:
        rule = "an integer"
    elif hi is None:
        rule = f">= {lo}"
    elif lo is None:
        rule = f"<= {hi}"
    else:
        rule = f"{lo}..{hi}"
    if none_ok:
        rule += " or None"
    if isinstance(value, bool):  # an int to Python, never meant as a number here
        raise InvalidError(f"PM_ERR_INVALID: {where} must be {rule}, not {value!r}")
    if not hasattr(type(value), "__index__"):
        raise InvalidError(f"PM_ERR_INVALID: {where} must be an integer"
                           f"{' or None' if none_ok else ''}, not {type(value).__name__} "
                           f"{value!r:.40}")
    v = _operator.index(value)
    if lo is not None and v < lo or hi is not None and v > hi:
        raise InvalidError(f"PM_ERR_INVALID: {where} must be {rule}, not {v}")
    return v
