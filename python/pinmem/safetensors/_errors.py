"""The errors of pinmem.safetensors.

DESIGN. Code written for the safetensors package catches its SafetensorError; code written for
pinmem catches pinmem.Error and its per-status classes (FormatError, InvalidError, ...). Both must
keep working, so every error pinmem.safetensors raises for a file or an argument is an instance
of SafetensorError, which derives from pinmem.Error and, when the package is installed, from
the package's SafetensorError; each raise uses a subclass that is also the pinmem class of its
status (a bad header: FormatError; a bad argument or a closed file: InvalidError, a ValueError),
and, where Python code expects one, the built-in class too (a missing name: KeyError; an index
out of range: IndexError). str(e) is the detail alone, as the package's; e.status, e.code and
e.message are pinmem's.
"""
import pinmem as _pm

try:  # the package's class, when it is there (its module is small: no framework is imported)
    from safetensors import SafetensorError as _PackageError
except ImportError:
    _PackageError = None

_BASES = (_pm.Error,) + ((_PackageError,) if _PackageError is not None else ())


class SafetensorError(*_BASES):
    """Every error pinmem.safetensors raises for a file or an argument: a pinmem.Error and, when
    the safetensors package is installed, its SafetensorError."""

    __module__ = "pinmem.safetensors"


class SafetensorFormatError(SafetensorError, _pm.FormatError):
    """A file that is not valid safetensors (pinmem.FormatError)."""


class SafetensorInvalidError(SafetensorError, _pm.InvalidError):
    """A bad argument, or a closed file (pinmem.InvalidError, a ValueError)."""


class SafetensorUnsupportedError(SafetensorError, _pm.UnsupportedError):
    """A dtype the framework asked for lacks (pinmem.UnsupportedError)."""


class SafetensorKeyError(SafetensorError, KeyError):
    """No tensor of that name (also a KeyError)."""

    def __str__(self):  # KeyError quotes its argument
        return str(self.args[0]) if self.args else ""


class SafetensorIndexError(SafetensorError, IndexError):
    """A slice index out of the tensor's range (also an IndexError)."""


class SafetensorTypeError(SafetensorError, _pm.InvalidError, TypeError):
    """A value that is not what a save takes (a ValueError, as the package raises, and a
    TypeError, as pinmem raised)."""


class SharedTensorsError(SafetensorError, _pm.InvalidError, RuntimeError):
    """Tensors that share memory, refused by a save (a RuntimeError, as the package raises)."""


class NoDataError(SafetensorError, _pm.InvalidError, NotImplementedError):
    """A tensor without data (the meta device) given to a save (a NotImplementedError, a
    RuntimeError, as the package's)."""


for _cls in list(globals().values()):
    if isinstance(_cls, type) and issubclass(_cls, SafetensorError):
        _cls.__module__ = "pinmem.safetensors"

_STATUS = {SafetensorFormatError: _pm.PM_ERR_FORMAT, SafetensorUnsupportedError:
           _pm.PM_ERR_UNSUPPORTED}
_BY_STATUS = {_pm.PM_ERR_FORMAT: SafetensorFormatError, _pm.PM_ERR_INVALID: SafetensorInvalidError,
              _pm.PM_ERR_UNSUPPORTED: SafetensorUnsupportedError}
_NAMES = {getattr(_pm, k): k for k in dir(_pm) if k.startswith("PM_ERR_")}


def error(cls, text):
    """An instance of cls (a SafetensorError class) with text, and pinmem's attributes."""
    e = cls(text)
    code = _STATUS.get(cls, _pm.PM_ERR_INVALID)
    e.status, e.code, e.message = _NAMES.get(code, "PM_ERR_INVALID"), code, text
    return e


_SAVING = {}  # an I/O error class -> its class for saves (saving)


def saving(e):
    """e, an I/O error of a save (an OSError, pinmem's IoError), as an instance of a class
    that is both SafetensorError, as the package's save raises ("Error while serializing: I/O
    error"), and e's own class (FileNotFoundError, IoError, ...), with e's arguments and
    attributes (errno, filename; status, code, message). Anything else as it is."""
    if isinstance(e, SafetensorError) or not isinstance(e, (OSError, _pm.IoError)):
        return e
    cls = type(e)
    dual = _SAVING.get(cls)
    if dual is None:
        dual = _SAVING[cls] = type(f"Safetensor{cls.__name__}", (SafetensorError, cls),
                                   {"__module__": "pinmem.safetensors",
                                    "__doc__": f"A save's {cls.__name__}: a SafetensorError "
                                               "too."})
    if isinstance(e, OSError) and e.errno is not None:
        new = dual(e.errno, e.strerror, e.filename, None, e.filename2)
    else:
        new = dual(*e.args)
    new.__dict__.update(getattr(e, "__dict__", {}))
    return new


def fail(status, text):
    """Raise the SafetensorError class of pinmem status `status` with text."""
    raise error(_BY_STATUS.get(status, SafetensorInvalidError), text)
